"""Helpers and fixtures of the toolsets tests (imported by name; not a conftest, whose module name is taken): the test MCP server (stdio command line, or served over HTTP on
127.0.0.1), a task with no tools of its own, and a scripted player on the tiny agent's real tokenizer."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.types import Episode

HERE = Path(__file__).resolve().parent
SERVER = HERE / "mcp_test_server.py"


def stdio_server(*flags: str) -> str:
    """The test server's ``--mcp-server`` command line."""
    return " ".join([sys.executable, str(SERVER), *flags])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_server():
    """The test server over streamable HTTP: its URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port), "--prefix", "web_"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "the test MCP server did not start"
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(30)


class NoToolsTask:
    """One question and no tools of its own: the tools come from a tool set. Reward 1 if the answer says done."""

    name = "no_tools"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": f"Episode {index}: use the tools."}], tools=[])

    def reward(self, episode, messages, tool_calls):
        return float("done" in messages[-1]["content"])


def call(tool: str, /, **arguments) -> str:
    """A tool call as the tiny agent's template writes it."""
    return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': arguments})}\n</tool_call>"


def play(task, tokenizer, replies, index=0, **config):
    """Episode ``index`` of ``task`` where assistant turn k replies ``replies[k]``."""
    def script(prompt_ids):
        turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return tokenizer.encode(replies[min(turn, len(replies) - 1)])

    config = LoopConfig(**{"max_turns": len(replies), "temperature": 0.0, **config})
    return asyncio.run(run_episode(task, index, ScriptedBackend(script), tokenizer, config))


def observations(traj, tokenizer) -> list[str]:
    """The decoded OBSERVATION span of each turn that has one."""
    turns = sorted({t for t, s in zip(traj.turn_ids, traj.spans) if s == 2})
    return [tokenizer.decode([i for i, s, t in zip(traj.response_ids, traj.spans, traj.turn_ids) if s == 2 and t == turn])
            for turn in turns]
