"""Real agent frameworks, unchanged but for base URL and model, trained through the proxy on the tiny agent: the
OpenAI Agents SDK (in its side environment: it pins openai<3) and LangGraph's prebuilt ReAct agent, each played
by ``agent-loop rollout --agent`` or the in-process runner, with assertions on the recorded tokens."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from proxy_helpers import ROOT, assert_recorded

from agent_loop.backends.hf import TransformersBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.proxy.agents import load_agent, stream_agent_rollouts
from agent_loop.runners.local import read_trajectories
from agent_loop.runners.spec import RunSpec
from agent_loop.tasks.registry import get_task

pytestmark = pytest.mark.integration
SDK_PYTHON = ROOT / ".side-envs" / "openai-agents" / "bin" / "python"


def _rollout(python, agent: str, out, episodes: int = 16) -> subprocess.CompletedProcess:
    command = [str(python), "-m", "agent_loop.cli", "rollout", "--agent", agent, "--task", "arithmetic",
               "--episodes", str(episodes), "--concurrency", "8", "--out", str(out)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(ROOT.parent)})


def _inspect(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent_loop.cli", "inspect", str(path), "--all"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_openai_agents_sdk_agent_plays_16_episodes_through_rollout_agent(tmp_path, tiny_tokenizer, tiny_agent_dir):
    if not SDK_PYTHON.exists():
        pytest.fail(f"no Agents SDK side environment at {SDK_PYTHON}: build it with "
                    "`bash scripts/side_env.sh openai-agents`")
    out = tmp_path / "sdk.jsonl"
    done = _rollout(SDK_PYTHON, "examples/agents/agents_sdk_agent.py:agent", out)
    assert done.returncode == 0, done.stderr[-2000:]
    episodes = read_trajectories(out)
    assert sorted(t.info["index"] for t in episodes) == list(range(16))
    called = [assert_recorded(t, tiny_tokenizer) for t in episodes]
    assert sum(called) >= 8  # the SDK ran its function tool and sent the results back
    assert all(t.info["session_id"] == f"arithmetic:0:{t.info['index']}" for t in episodes)
    shown = _inspect(out)
    assert shown.returncode == 0 and "16 episodes" in " ".join(shown.stdout.split())


def test_openai_client_agent_plays_16_episodes_through_rollout_agent(tmp_path, tiny_tokenizer, tiny_agent_dir):
    out = tmp_path / "openai.jsonl"
    done = _rollout(sys.executable, "examples/agents/openai_tools_agent.py:agent", out)
    assert done.returncode == 0, done.stderr[-2000:]
    episodes = read_trajectories(out)
    assert sorted(t.info["index"] for t in episodes) == list(range(16))
    assert sum(assert_recorded(t, tiny_tokenizer) for t in episodes) >= 12
    assert sum(t.reward for t in episodes) >= 8  # the task scored the agents' final answers
    shown = _inspect(out)
    assert shown.returncode == 0 and "16 episodes" in " ".join(shown.stdout.split())


def test_a_bad_agent_option_is_one_line(tmp_path):
    for agent, words in (("nocolon", "expected package.module:function"),
                         ("examples/agents/openai_tools_agent.py:nothing", "has no function 'nothing'")):
        done = subprocess.run([sys.executable, "-m", "agent_loop.cli", "rollout", "--agent", agent, "--out",
                               str(tmp_path / "x.jsonl")], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_langgraph_react_agent_is_recorded(tiny_tokenizer, tiny_agent_dir):
    task, config = get_task("arithmetic"), LoopConfig(temperature=0.0)
    agent = load_agent("examples/agents/langgraph_agent.py:agent")

    async def play():
        with TransformersBackend(str(tiny_agent_dir)) as backend:
            spec = RunSpec(task, tiny_tokenizer, range(4), config, 0, None, progress=False)
            return (await stream_agent_rollouts(spec, backend, agent, concurrency=4, keep=True))[1]

    episodes = asyncio.run(play())
    assert sorted(t.info["index"] for t in episodes) == list(range(4))
    assert sum(assert_recorded(t, tiny_tokenizer) for t in episodes) >= 2  # the ReAct loop ran the tool
    assert all(t.metrics["proxy"]["rewrites"] == 0 for t in episodes)  # LangGraph resends its whole history
