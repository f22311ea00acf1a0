"""JSON Lines files that survive a kill: whole-record writes, torn-tail repair, resume.

Each record is written with one ``os.write`` of its encoded line on a file opened ``O_APPEND``, so a
process killed between records leaves whole lines; a kill inside the write of a huge line can still
leave a torn last line, which :func:`repair_tail` cuts off (with a warning) before anything is
appended after it. An existing output is never emptied: a new run refuses it, ``append``/``resume``
repair its tail and add to it. A write that fails (a full disk, a file size limit) cuts the part of its
line that got written, so the file still ends with a whole line, and raises :class:`OutputWriteError`.

Files are read a line at a time with a cap on a line's length (:func:`iter_lines`, :data:`MAX_LINE_BYTES`):
memory stays bounded whatever a damaged file holds (a gigabyte of NUL bytes, a binary tail).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Iterator

import agent_loop.files as files

MODES = ("new", "append", "resume")
MAX_LINE_BYTES = 32 << 20  # a longer line is skipped unread, not loaded (no episode we write comes near it)
_BLOCK = 1 << 20


class OutputWriteError(OSError):
    """A record could not be written (its partial line was cut off); the message names the file."""


class OutputExistsError(FileExistsError):
    """The output file already holds records and neither append nor resume was asked for."""


def repair_tail(path: str | Path) -> int:
    """Cut a torn last line (bytes after the last newline) off ``path``; returns how many bytes were cut.

    A missing or empty file, or one that ends with a newline, is left alone.
    """
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # scan back in blocks for the last newline: O(length of the torn line), not of the file
        end, keep = size, 0
        while end > 0:
            start = max(0, end - (1 << 20))
            f.seek(start)
            block = f.read(end - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    warnings.warn(f"{path}: cut a torn last line ({size - keep} bytes, from an interrupted write) before appending",
                  stacklevel=2)
    return size - keep


def check_output(path: str | Path, mode: str = "new") -> None:
    """Raise before any work is done if ``path`` cannot be written in ``mode`` (nothing is opened or changed).

    ``new``: the file must not exist or be empty; ``append``/``resume``: its folder must be writable.
    """
    if mode not in MODES:
        raise ValueError(f"output mode must be one of {MODES}, got {mode!r}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, not a file")
    if mode == "new" and path.exists() and path.stat().st_size > 0:
        raise OutputExistsError(
            f"{path} already exists ({path.stat().st_size} bytes) and is left untouched: "
            "pass --resume to play only the episodes it lacks, --append to add to it, or another --out")
    parent = path.parent if str(path.parent) else Path(".")
    existing = next((p for p in (parent, *parent.parents) if p.exists()), Path("."))
    if not os.access(existing, os.W_OK):
        raise PermissionError(f"cannot write {path}: {existing} is not writable")


class JsonlWriter:
    """Appends one line per record, each with a single ``os.write`` (no buffering to lose on a kill).

    ``mode``: ``new`` refuses a non-empty existing file; ``append`` and ``resume`` repair a torn tail
    first and add to the file.
    """

    def __init__(self, path: str | Path, mode: str = "new"):
        check_output(path, mode)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        files.before_write()
        if mode != "new":
            repair_tail(self.path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write_line(self, line: str) -> None:
        """Append ``line`` whole, or raise OutputWriteError with the file as it was (a partial line is cut)."""
        data = (line.rstrip("\n") + "\n").encode("utf-8")
        view = memoryview(data)
        files.before_write()
        start = os.fstat(self.fd).st_size  # one writer (the run's lock), so this is where the line begins
        try:
            while view:  # a regular file takes it in one call; loop only for the rare short write
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as error:
            os.ftruncate(self.fd, start)  # shrinking is allowed under a size limit and on a full disk
            raise OutputWriteError(error.errno, f"cannot write {self.path}: {error.strerror}") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_lines(f, max_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, int, bytes | None, bool]]:
    """``(number, offset, line, whole)`` for each line of the binary file ``f``, in constant memory.

    ``number`` is 1-based, ``offset`` the byte where the line starts, ``line`` its bytes (None when it is
    longer than ``max_bytes``: skipped unread), ``whole`` whether it ends with a newline (False only for
    the last line of a file that does not end with one).
    """
    number, offset = 0, 0
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            return
        number, start = number + 1, offset
        offset += len(line)
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while True:  # skip the rest of the oversized line, a block at a time
                block = f.readline(_BLOCK)
                offset += len(block)
                if not block or block.endswith(b"\n"):
                    break
            yield number, start, None, bool(block)
            continue
        yield number, start, line, line.endswith(b"\n")


def written_episodes(path: str | Path, seed: int, task: str | None = None) -> set[int]:
    """Episode indices already in ``path`` for ``seed`` (and ``task``, if given); a torn last line is ignored.

    Read a line at a time (memory: the set, not the file). A bad line before the last raises ValueError
    naming its line number: the file is not ours to guess about.
    """
    path = Path(path)
    if not path.exists():
        return set()
    done: set[int] = set()
    with open(path, "rb") as f:
        for number, _, raw, whole in iter_lines(f):
            if raw is not None and not raw.strip():
                continue
            try:
                if raw is None:
                    raise ValueError(f"longer than {MAX_LINE_BYTES} bytes")
                info = json.loads(raw)["info"]
            except (ValueError, KeyError, TypeError) as error:
                if not whole:
                    continue  # torn tail: repaired when the file is opened for appending
                raise ValueError(f"{path}: line {number} is not a trajectory record ({error}); "
                                 "cannot resume from it") from None
            if info.get("seed") == seed and (task is None or info.get("task") == task):
                done.add(int(info["index"]))
    return done


def count_lines(path: str | Path) -> int:
    """How many whole lines ``path`` holds (0 when missing), read a block at a time."""
    try:
        with open(path, "rb") as f:
            return sum(block.count(b"\n") for block in iter(lambda: f.read(_BLOCK), b""))
    except FileNotFoundError:
        return 0
