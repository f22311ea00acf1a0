"""A Trajectory's ``info``: how its episode was made, in one layout for every record written (the agent loop's,
a failed episode's, each segment of a proxy session)."""

from __future__ import annotations

import os
from pathlib import Path


def recorded_model_path(name_or_path: str) -> str:
    """What ``info["model_path"]`` records: a local folder as an absolute path (so the record's tokenizer loads
    from any working directory: ``agent-loop inspect``), anything else (a served or hub model name) as given."""
    path = Path(name_or_path).expanduser()
    return os.path.abspath(path) if path.is_dir() else name_or_path


def episode_info(task: str, index: int, seed: int, *, success: bool, tokenizer=None, identity: dict | None = None,
                 extra: dict | None = None) -> dict:
    """``task``, ``index`` and ``seed``; then ``identity`` (what else names the episode: its ``answer``, a proxy
    session's ``session_id`` and ``segment``); ``success``; then ``extra`` (the episode's own ``info``, which may
    replace any key above, and the environment's ``steps``); last ``model_path``, the tokenizer's
    (:func:`recorded_model_path`), when it names one. A new dict: the arguments are not changed."""
    info = {"task": task, "index": index, "seed": seed, **(identity or {}), "success": success, **(extra or {})}
    name_or_path = getattr(tokenizer, "name_or_path", None)
    if name_or_path:
        info["model_path"] = recorded_model_path(str(name_or_path))
    return info
