"""Files the views write: through a temporary file, renamed into place only once complete."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str, write) -> None:
    """Write through a temporary file in the same folder, renamed over ``path`` only once complete."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would have made it
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
