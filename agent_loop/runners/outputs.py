"""One output per run: a lock held for the life of a run, fresh default paths, and the settings a resume keeps.

A run holds :class:`RunLock` on its output (``X.jsonl.lock`` beside a rollout file, ``.agent-loop.lock``
inside a training folder) from before it reads the output until it ends. The lock is an ``flock`` on
that file, which the kernel drops when the holder dies however it dies, so a second run into the same
output is refused in one line naming the holder (pid, host, start time), and the file left by a killed
run (its holder gone) is taken over with a warning. :func:`changed_settings` is the one comparison of a
resumed run's settings with the saved ones and :func:`refuse_changed` the one refusal (``rollout --resume`` and
``train --resume``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

LOCK_SUFFIX = ".lock"  # a file output's lock: X.jsonl -> X.jsonl.lock
FOLDER_LOCK = ".agent-loop.lock"  # a folder output's lock, inside it
HELD_ENV = "AGENT_LOOP_HELD_LOCK"  # set by a launcher that holds the lock for its worker processes
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})  # a full disk, a file size limit, a quota


class OutputLockedError(RuntimeError):
    """Another live run holds the output (the message names it)."""


def lock_path_of(target: str | Path, *, folder: bool = False) -> Path:
    """Where the lock of output ``target`` lives: beside a file, inside a folder."""
    target = Path(target)
    return target / FOLDER_LOCK if folder else target.with_name(target.name + LOCK_SUFFIX)


def fresh_path(path: str) -> str:
    """``path`` if nothing (nor a lock) is there, else the first free ``stem-N.suffix`` beside it (N = 2, 3, ...)."""
    target, number = Path(path), 2
    while target.exists() or lock_path_of(target).exists():
        target = Path(path).with_name(f"{Path(path).stem}-{number}{Path(path).suffix}")
        number += 1
    return str(target)


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "a run that left no details"


def _alive(text: str) -> bool:
    try:
        info = json.loads(text)
        if info["host"] != socket.gethostname():
            return True  # cannot tell from here
        os.kill(int(info["pid"]), 0)
        return True
    except ProcessLookupError:
        return False
    except (ValueError, KeyError, TypeError, PermissionError):
        return True


class RunLock:
    """An exclusive lock on one run's output, held from :meth:`acquire` to :meth:`release` (or the holder's death)."""

    def __init__(self, target: str | Path, *, folder: bool = False):
        self.target, self.path, self.fd = Path(target), lock_path_of(target, folder=folder), None

    def acquire(self) -> "RunLock":
        """Take the lock, or raise :class:`OutputLockedError` naming the live holder; warn on taking over a stale one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._in_use(fd) from None
            try:  # the holder may have released (unlinked) the file between our open and flock: lock the new one
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        if previous.strip():
            warnings.warn(f"{self.target}: took over the lock left by {_holder(previous)}, which ended without "
                          "releasing it (killed?)", stacklevel=2)
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode(), 0)
        self.fd = fd
        return self

    def _in_use(self, fd: int) -> OutputLockedError:
        """The error naming the live holder of the lock file open at ``fd`` (closed here)."""
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        os.close(fd)
        note = "" if _alive(text) else " (that pid is gone, but a process it started still holds the lock)"
        return OutputLockedError(f"{self.target} is in use by another run: {_holder(text)}{note}; wait for it "
                                 "to end, stop it, or give another output")

    def check_free(self) -> None:
        """Raise :class:`OutputLockedError` if a live run holds the lock; creates and keeps nothing.

        For the checks a command makes before it takes the lock, so that a folder in use is reported first
        (not, say, "no checkpoint yet" for a run that is still going)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._in_use(fd) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no one else can be holding it) and let go."""
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def changed_settings(saved: dict, now: dict, names: Iterable[str]) -> list[str]:
    """``"name: saved -> now"`` for each of ``names`` that both hold and that differs (sorted by name)."""
    return [f"{name}: {saved[name]!r} -> {now[name]!r}" for name in sorted(names)
            if name in saved and name in now and saved[name] != now[name]]


def refuse_changed(changes: list[str], *, allowed: bool, refusal: Callable[[str], Exception], warning: str) -> None:
    """The one rule for a resume with changed settings (:func:`changed_settings`'s lines): none, nothing to say;
    else raise ``refusal(listing)`` unless ``allowed`` (``--allow-config-change``), then warn ``warning: listing``."""
    if not changes:
        return
    listing = "; ".join(changes)
    if not allowed:
        raise refusal(listing)
    warnings.warn(f"{warning}: {listing}", stacklevel=3)


def is_write_failure(error: BaseException) -> bool:
    """Whether ``error`` is a write refused for lack of room: a full disk, a file size limit or a quota."""
    return isinstance(error, OSError) and error.errno in WRITE_ERRNOS
