"""Claiming a command's ``--output-dir`` for one run: the one way ``warmstart`` and ``train`` do it.

The folder is locked for the life of the run (``agent_loop.runners.outputs.RunLock``, released by the caller),
and a folder holding an earlier run's files is refused in one line unless the run goes on with them (a resume)
or ``--overwrite`` deletes them first. Nothing is deleted before the lock is held.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from agent_loop.cli.flags import UsageError
from agent_loop.runners.outputs import FOLDER_LOCK, OutputLockedError, RunLock


def claim_output_dir(folder: str | Path, *, keep: bool, overwrite: bool, refusal: str,
                     remove: Iterable[str] | None = None) -> RunLock:
    """Lock ``folder`` and check it holds no earlier run; returns the held lock.

    Files in it (the lock aside) are refused (UsageError ``--output-dir FOLDER: `` + ``refusal``, whose
    ``{held}`` names the first five and ``{folder}`` the folder) unless ``keep`` (the run goes on with them) or
    ``overwrite``, which deletes ``remove`` (names in the folder; None: everything it holds) first."""
    folder = Path(folder)
    try:
        lock = RunLock(folder, folder=True).acquire()
    except (OutputLockedError, OSError) as error:
        raise UsageError(f"--output-dir {folder}: {error}") from None
    held = sorted(p.name for p in folder.iterdir() if p.name != FOLDER_LOCK)
    if held and not keep and not overwrite:
        lock.release()
        listing = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise UsageError(f"--output-dir {folder}: {refusal.format(held=listing, folder=folder)}")
    if overwrite:
        for name in held if remove is None else remove:
            target = folder / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    return lock
