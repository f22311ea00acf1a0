"""Agents for tests/proxy/test_sync_agents.py: one whose file imports a module beside it, one that never returns."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from beside_helper import MARK, final_answer  # a module beside this file, not on the Python path


def beside(row: dict):
    """Returns what the module beside it made: proof that it imported."""
    return final_answer(row), MARK


def never_returns(base_url: str, model: str, session_id: str, row: dict):
    """Makes one real call through the proxy (a synchronous openai client), says so in $STUCK_AGENT_STARTED, then
    blocks for good, as an agent waiting on something that never answers."""
    from openai import OpenAI

    OpenAI(base_url=base_url, api_key=session_id, max_retries=0).chat.completions.create(
        model=model, messages=row["messages"], tools=row["tools"])
    started = os.environ.get("STUCK_AGENT_STARTED")
    if started:
        Path(started).write_text(session_id)
    threading.Event().wait()
