"""JSON Lines files that survive a kill: whole-record writes, torn-tail repair, resume.

Each record is written with one ``os.write`` of its encoded line on a file opened ``O_APPEND``, so a
process killed between records leaves whole lines; a kill inside the write of a huge line can still
leave a torn last line, which :func:`repair_tail` cuts off (with a warning) before anything is
appended after it. An existing output is never emptied: a new run refuses it, ``append``/``resume``
repair its tail and add to it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

MODES = ("new", "append", "resume")


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
        if mode != "new":
            repair_tail(self.path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write_line(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode("utf-8")
        view = memoryview(data)
        while view:  # a regular file takes it in one call; loop only for the rare short write
            written = os.write(self.fd, view)
            view = view[written:]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def written_episodes(path: str | Path, seed: int, task: str | None = None) -> set[int]:
    """Episode indices already in ``path`` for ``seed`` (and ``task``, if given); a torn last line is ignored.

    A bad line before the last raises ValueError naming its line number: the file is not ours to guess about.
    """
    path = Path(path)
    if not path.exists():
        return set()
    done: set[int] = set()
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    last = len(lines) - 1  # after the final newline: b"" for a whole file, the torn bytes otherwise
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            info = json.loads(raw)["info"]
        except (ValueError, KeyError, TypeError) as error:
            if number - 1 == last:
                continue  # torn tail: repaired when the file is opened for appending
            raise ValueError(f"{path}: line {number} is not a trajectory record ({error}); cannot resume from it") from None
        if info.get("seed") == seed and (task is None or info.get("task") == task):
            done.add(int(info["index"]))
    return done
