"""Agents for tests/proxy/test_sync_agents.py, synchronous as most agents are: ``both`` plays the examples' plain
``openai.OpenAI`` tool loop on even episodes and LangGraph's ``.invoke`` on odd ones; ``never_returns`` blocks for
good; ``beside`` uses a module beside this file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from beside_helper import MARK, final_answer  # a module beside this file, not on the Python path

from agent_loop.proxy.agents import load_agent

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "agents"
KINDS = ("openai_sync_agent.py:play", "langgraph_agent.py:invoke_agent")
PLAYERS = {kind: load_agent(str(EXAMPLES / kind)) for kind in KINDS}  # loaded once, as --agent loads a file


def both(base_url: str, model: str, session_id: str, row: dict):
    """examples/agents/openai_sync_agent.py:play (even episodes) or langgraph_agent.py:invoke_agent (odd ones),
    each appending ``index kind`` to $SYNC_AGENTS_LOG when set."""
    kind = KINDS[row["index"] % 2]
    reward = PLAYERS[kind](base_url=base_url, model=model, session_id=session_id, row=row)
    if os.environ.get("SYNC_AGENTS_LOG"):
        with open(os.environ["SYNC_AGENTS_LOG"], "a") as log:
            log.write(f"{row['index']} {kind}\n")
    return reward


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


async def blocks_the_loop(base_url: str, model: str, session_id: str, row: dict):
    """The mistake a stop must survive: an ``async def`` calling a synchronous client blocks the event loop that
    serves the proxy it waits for (nothing on the loop runs again), after leaving a default-executor thread that
    never ends (the interpreter waits for it at exit)."""
    import asyncio

    from openai import OpenAI

    asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)
    started = os.environ.get("STUCK_AGENT_STARTED")
    if started:
        Path(started).write_text(session_id)
    OpenAI(base_url=base_url, api_key=session_id, max_retries=0).chat.completions.create(
        model=model, messages=row["messages"], tools=row["tools"])
