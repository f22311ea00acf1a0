"""Files and folders that survive a kill: the one atomic write (stdlib only; issue 37 item 7).

- :func:`write_file`: ``write(tmp)`` fills a temporary sibling; the file and its folder are fsynced and it is
  renamed over the target only once complete. The target is never opened, so an existing output is never
  truncated: a writer that raises (or a kill) leaves the old file as it was and no temporary file behind.
  ``exist_ok=False`` publishes with a hard link, which refuses an existing target atomically.
- :func:`write_folder` / :func:`publish_folder`: a folder filled beside its target (``.tmp-NAME``), every file
  and folder in it fsynced, renamed into place; an existing target is swapped out (``.old-NAME``), never
  removed first, so a kill leaves the old folder or the new one. The caller is the target's only writer
  (it holds the run's or the build's lock): a ``.tmp-NAME`` left by a killed writer is removed first.
- :func:`build_lock`: the exclusive file lock a folder's one writer holds while it builds it (the tiny agent,
  the built-in models' conversions): two processes build once.
- :func:`move_aside`: rename a file to the first free ``NAME.SUFFIX[-K]`` (kept, never overwritten).
- :func:`guard_writes` / :func:`before_write`: checks run before every publish here and before every appended
  line (``JsonlWriter``, the metrics log): a training worker whose launcher died stops itself there
  (``agent_loop.training.distributed.die_with_launcher``), so nothing it writes lands after the launcher's death.

``masking/native.py`` keeps its own three lines (a compiled cache library renamed into place): ``masking``
imports only torch, never ``agent_loop``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


_WRITE_GUARDS: list[Callable[[], None]] = []


def guard_writes(check: Callable[[], None]) -> None:
    """Run ``check`` (no arguments; it raises or ends the process to stop the write) before every write this
    process publishes (:func:`before_write`)."""
    _WRITE_GUARDS.append(check)


def before_write() -> None:
    """Run the :func:`guard_writes` checks: called before a file or folder is staged, again right before it is
    renamed into place, and before a line is appended, so a check that fails leaves the output as it was."""
    for check in _WRITE_GUARDS:
        check()


def fsync_path(path: str | Path) -> None:
    """Flush a file or folder (its entries: a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(source: str | Path, target: str | Path, *, exist_ok: bool = True) -> Path:
    """Move complete file ``source`` onto ``target`` (same file system) atomically: ``source`` fsynced, renamed
    (``exist_ok=False``: hard-linked, FileExistsError if ``target`` exists, then ``source`` unlinked), the
    folder fsynced."""
    target = Path(target)
    fsync_path(source)
    before_write()
    if exist_ok:
        os.replace(source, target)
    else:
        os.link(source, target)
        os.unlink(source)
    fsync_path(target.parent)
    return target


def write_file(path: str | Path, write: Callable[[str], object], *, exist_ok: bool = True) -> Path:
    """Write ``path`` through a temporary sibling: ``write(tmp)`` fills the file at ``tmp`` (a str path), which
    replaces ``path`` only once complete (:func:`replace_file`). If ``write`` raises, ``path`` is as it was and
    the temporary file is gone. The file gets the mode a plain ``open()`` would give it."""
    target = Path(path)
    before_write()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's is 0600
    try:
        write(tmp)
        return replace_file(tmp, target, exist_ok=exist_ok)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str, *, exist_ok: bool = True) -> Path:
    """:func:`write_file` of ``text`` (UTF-8)."""
    return write_file(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), exist_ok=exist_ok)


def staging_path(target: str | Path) -> Path:
    """Where :func:`write_folder` fills ``target`` before it is renamed into place: ``.tmp-NAME`` beside it."""
    target = Path(target)
    return target.with_name(f".tmp-{target.name}")


def publish_folder(source: str | Path, target: str | Path) -> Path:
    """Rename complete folder ``source`` to ``target`` (same file system): every file and folder under ``source``
    fsynced first; an existing ``target`` renamed to ``.old-NAME`` beside it, then removed once the new one is
    in place (never removed first); the parent folder fsynced."""
    source, target = Path(source), Path(target)
    for folder, _, names in os.walk(source):
        for name in names:
            fsync_path(Path(folder) / name)
        fsync_path(folder)
    before_write()
    if target.exists():
        old = target.with_name(f".old-{target.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(source, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(source, target)
    fsync_path(target.parent)
    return target


@contextlib.contextmanager
def staging_folder(target: str | Path) -> Iterator[Path]:
    """A fresh, empty :func:`staging_path` of ``target`` (one left by a killed writer is removed first), removed
    on leaving if it is still there (a failure, or nothing published)."""
    scratch = staging_path(target)
    before_write()
    scratch.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_folder(target: str | Path, fill: Callable[[Path], T]) -> T:
    """Write folder ``target`` atomically: ``fill(scratch)`` fills :func:`staging_path`, which is then
    :func:`publish_folder`-ed. Returns what ``fill`` returns. If ``fill`` raises, ``target`` is as it was and the
    scratch folder is gone."""
    with staging_folder(target) as scratch:
        result = fill(scratch)
        publish_folder(scratch, target)
    return result


@contextlib.contextmanager
def build_lock(target: str | Path) -> Iterator[None]:
    """Hold an exclusive file lock (``.NAME.lock`` beside ``target``) for building ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def move_aside(path: str | Path, suffix: str) -> Path:
    """Rename ``path`` to ``NAME.SUFFIX``, or ``NAME.SUFFIX-2``, ``-3``, ... (the first free one); nothing is
    overwritten. Returns the new path."""
    path = Path(path)
    target, k = path.with_name(f"{path.name}.{suffix}"), 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}.{suffix}-{k}")
    path.rename(target)
    return target


__all__ = ["before_write", "build_lock", "fsync_path", "guard_writes", "move_aside", "publish_folder", "replace_file",
           "staging_folder", "staging_path", "write_file", "write_folder", "write_text"]
