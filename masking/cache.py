"""The one cache folder of agent-loop, with the standard library only: ``agent_loop`` reads it without loading
torch (``agent-loop models --fetch``), and :mod:`masking.native` compiles its loops into it."""

import os
from pathlib import Path


def cache_root() -> Path:
    """``$AGENT_LOOP_CACHE``, else ``~/.cache/agent_loop`` (compiled loops here, the tiny agent, the built-in
    models' wheels and test data beside them)."""
    return Path(os.environ.get("AGENT_LOOP_CACHE") or Path.home() / ".cache" / "agent_loop")
