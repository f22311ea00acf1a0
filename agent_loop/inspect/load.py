"""Read a rollouts JSON Lines file one line at a time, keeping the good lines of a damaged file.

Nothing is loaded whole: :func:`iter_records` yields one :class:`Record` per good line (with its
1-based line number and byte offset, so a record can be read again with :func:`read_at`). A bad
line becomes one message naming the file and the line; after :data:`MAX_PROBLEMS` messages the rest
are only counted. Lines are read with a cap on their length (``agent_loop.runners.jsonl.iter_lines``): a
longer one (a binary tail without newlines) is skipped unread, with a message, so memory stays bounded
and the good lines before and after it are shown. A file that is not JSON Lines at all (its first line
binary, or its first lines not JSON objects) raises :class:`InputError` with one message: the command
prints one line and exits 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from agent_loop.runners.jsonl import MAX_LINE_BYTES, iter_lines
from agent_loop.types import Trajectory

MAX_PROBLEMS = 20  # messages kept per file; further bad lines are counted
SNIFF_BYTES = 8192  # the start of the file (of its first line) checked for binary data
NOT_JSON_LINES = 3  # this many lines that are not even damaged JSON objects, before any good one: not JSON Lines


class InputError(ValueError):
    """The input cannot be read as a JSON Lines file of trajectories (one message; exit status 2)."""


@dataclass
class Problems:
    """Messages about bad lines: the first ``limit`` kept, the rest counted."""

    limit: int = MAX_PROBLEMS
    messages: list[str] = field(default_factory=list)
    more: int = 0

    def add(self, message: str) -> None:
        if len(self.messages) < self.limit:
            self.messages.append(message)
        else:
            self.more += 1

    def lines(self) -> list[str]:
        """The messages, plus one line counting those left out."""
        return self.messages + ([f"... and {self.more} more bad lines"] if self.more else [])

    def __len__(self) -> int:
        return len(self.messages) + self.more


@dataclass
class Record:
    """One good line: the trajectory, its 1-based line number and the byte offset where the line starts."""

    trajectory: Trajectory
    line: int
    offset: int


def parse_line(raw: bytes) -> Trajectory:
    """One line -> a checked Trajectory; raises ValueError (json.JSONDecodeError, UnicodeDecodeError included)."""
    data = json.loads(raw.decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    try:
        traj = Trajectory.from_dict(data)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    traj.check()
    return traj


def open_checked(path: Path):
    """Open ``path`` for reading bytes, or raise InputError (missing, a folder, binary data)."""
    if path.is_dir():
        raise InputError(f"{path}: is a folder, expected a JSON Lines file")
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    head = f.read(SNIFF_BYTES)
    f.seek(0)
    if b"\n" in head:  # only the first line: good lines followed by a damaged tail are still shown
        head = head[: head.index(b"\n") + 1]
    nul = head.find(b"\x00")
    if nul >= 0:
        f.close()
        raise InputError(f"{path}: not a JSON Lines file (binary data: a NUL byte at offset {nul})")
    try:  # the last 3 bytes may be a character cut by the sniff window
        head[: len(head) - 3 if len(head) == SNIFF_BYTES else len(head)].decode("utf-8")
    except UnicodeDecodeError as exc:
        f.close()
        raise InputError(f"{path}: not a JSON Lines file (not UTF-8 text: byte {exc.start} is {head[exc.start]:#04x})") from None
    return f


def iter_records(path: str | Path, problems: Problems) -> Iterator[Record]:
    """Yield each good line of ``path`` in order; bad lines go to ``problems`` as ``FILE:LINE: why``.

    Raises InputError before yielding anything when the file cannot be opened or is not JSON Lines.
    """
    path = Path(path)
    with open_checked(path) as f:
        parsed_json, not_json = False, 0
        for number, start, raw, whole in iter_lines(f):
            where = f"{path}:{number}"
            if raw is None:
                problems.add(f"{where}: longer than {MAX_LINE_BYTES} bytes, skipped unread"
                             + ("" if whole else " (a binary or truncated tail?)"))
                continue
            if not raw.strip():
                continue
            try:
                traj = parse_line(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                if not parsed_json and not raw.lstrip().startswith(b"{"):  # not even a damaged JSON object
                    not_json += 1
                    if not_json >= NOT_JSON_LINES:
                        raise InputError(f"{path}: not a JSON Lines file (lines 1-{number} hold no JSON)") from None
                last = not raw.endswith(b"\n")
                hint = " (truncated last line: interrupted rollout?)" if last else ""
                detail = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                problems.add(f"{where}: not valid JSON{hint}: {detail}")
                continue
            except ValueError as exc:
                parsed_json = True
                problems.add(f"{where}: not a Trajectory: {exc}")
                continue
            parsed_json = True
            yield Record(traj, number, start)


def read_at(path: str | Path, offset: int) -> Trajectory:
    """The trajectory on the line that starts at byte ``offset`` of ``path`` (an offset from a Record)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return parse_line(f.readline())
