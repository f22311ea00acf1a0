"""The folders pushes are written to: a fresh subfolder per push (``v000001``, ...), the previous one deleted
once the destination took the new one; under a given folder, or a temporary one removed on ``close``.
Used by every transport that hands its destination files (vLLM servers, the in-process engine's adapters)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


class PushFolders:
    """``next()``: the next push's fresh, empty subfolder; ``took(folder)``: the destination took it (the
    previous one is deleted; ``count`` pushes taken, ``current`` the folder in use); ``close()``."""

    def __init__(self, folder: str | Path | None, *, temporary_prefix: str):
        self._temporary = None
        if folder is None:
            self._temporary = tempfile.TemporaryDirectory(prefix=temporary_prefix)
            folder = self._temporary.name
        self.root = Path(folder)
        self.count = 0
        self.current: Path | None = None

    def next(self) -> Path:
        """The next push's subfolder (a leftover of an interrupted push is removed)."""
        folder = self.root / f"v{self.count + 1:06d}"
        if folder.exists():
            shutil.rmtree(folder)
        return folder

    def took(self, folder: Path) -> None:
        previous, self.current = self.current, folder
        self.count += 1
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)

    def close(self) -> None:
        if self._temporary is not None:
            self._temporary.cleanup()
            self._temporary = None
