"""Agents as most are written, synchronous (issue 49 items 1 and 3): a plain ``openai.OpenAI`` tool loop and
LangGraph's ``.invoke`` played by ``rollout --agent`` and ``train --agent`` through the real in-process proxy on
127.0.0.1 with the tiny agent; an agent that never returns, bounded by ``--agent-timeout-s`` and stopped by
SIGTERM within seconds with the resume hint; an agent file that imports a module beside it.

Before: ``call_agent`` called a plain function on the event loop that serves the proxy, so its first HTTP call
waited for good on a server that could not answer, and SIGTERM did not stop the process."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from proxy_helpers import ROOT, assert_recorded

from agent_loop.proxy.agents import AgentTimeout, call_agent, load_agent
from agent_loop.runners.local import read_trajectories
from agent_loop.runners.outputs import FOLDER_LOCK

AGENTS = ROOT / "tests" / "proxy" / "agent_files" / "user_agents.py"
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(ROOT.parent)}
STOP_WITHIN_S = 30  # "within seconds", on a loaded 2-core machine (the tiny agent stops in about 2 s)


def _command(command: str, agent: str, *argv: str) -> list[str]:
    return [sys.executable, "-m", "agent_loop.cli", command, "--agent", f"{AGENTS}:{agent}", "--task", "arithmetic",
            *argv]


# -- in process: where each kind of agent runs, the bound, the loader -----------------------------------------


@pytest.mark.timeout(120)  # before the fix: a hang
def test_a_plain_function_runs_on_a_thread_of_its_own_and_an_async_one_on_the_loop():
    """The loop must stay free while a plain function blocks: here it blocks until the loop itself answers."""
    async def main():
        loop, answered = asyncio.get_running_loop(), threading.Event()

        def blocking(row):  # as a synchronous client waiting on the in-process proxy
            loop.call_soon_threadsafe(answered.set)
            assert answered.wait(10), "the event loop never ran while the agent blocked"
            return threading.current_thread() is not threading.main_thread(), row

        async def awaiting(row):
            return threading.current_thread() is threading.main_thread(), row

        return (await call_agent(blocking, timeout_s=30, row=1, unused=2),
                await call_agent(awaiting, timeout_s=30, row=3))

    assert asyncio.run(main()) == ((True, 1), (True, 3))


@pytest.mark.timeout(120)  # before the fix: a hang
@pytest.mark.parametrize("kind", ["plain", "async"])
def test_an_agent_that_never_returns_is_bounded_by_its_timeout(kind):
    def plain():
        threading.Event().wait()

    async def awaiting():
        await asyncio.Event().wait()

    async def main():
        started = time.monotonic()
        with pytest.raises(AgentTimeout, match=r"longer than 0.5 s \(--agent-timeout-s\)"):
            await call_agent(plain if kind == "plain" else awaiting, timeout_s=0.5)
        return time.monotonic() - started

    assert 0.5 <= asyncio.run(main()) < 0.5 + 5


def test_an_agents_own_timeout_error_is_its_own():
    async def impatient():
        raise TimeoutError("my HTTP call timed out")

    with pytest.raises(TimeoutError, match="my HTTP call"):
        asyncio.run(call_agent(impatient, timeout_s=30))


def test_an_agent_file_imports_a_module_beside_it():
    """Issue 49 item 3: ``ModuleNotFoundError`` where task, tools and reward files import their neighbours."""
    message, mark = load_agent(f"{AGENTS}:beside")(row={"answer": 7})
    assert mark == "imported from beside the agent file" and message["content"] == "The answer is 7."


class HangingReward:
    """The arithmetic task whose reward never returns for episode 1."""

    name = "hanging"

    def __init__(self):
        from agent_loop.tasks.registry import get_task

        self.inner, self.release = get_task("arithmetic"), threading.Event()

    def make_episode(self, index, seed=0):
        episode = self.inner.make_episode(index, seed)
        episode.info["i"] = index
        return episode

    def reward(self, episode, messages, tool_calls):
        if episode.info["i"] == 1:
            self.release.wait()
        return self.inner.reward(episode, messages, tool_calls)

    def success(self, episode, reward):
        return reward > 0


@pytest.mark.timeout(120)  # before the fix: a hang
def test_the_reward_of_an_agents_episode_is_bounded_and_announced(tiny_tokenizer, tiny_agent_dir, monkeypatch):
    """Issue 49 item 8 through ``--agent``: the task's reward ran on the event loop, unbounded (a reward that never
    returned stopped the run for good). "A few seconds" is made 0.3 s here."""
    from proxy_helpers import openai_tools_agent

    import agent_loop.episode.loop as loop
    from agent_loop.backends.hf import TransformersBackend
    from agent_loop.episode.contracts import as_task
    from agent_loop.episode.loop_config import LoopConfig
    from agent_loop.proxy.agents import stream_agent_rollouts
    from agent_loop.runners.spec import RunSpec

    monkeypatch.setattr(loop, "SLOW_NOTICE_S", 0.3)
    task = HangingReward()

    async def play():
        with TransformersBackend(str(tiny_agent_dir)) as backend:
            spec = RunSpec(as_task(task), tiny_tokenizer, range(3), LoopConfig(temperature=0.0, reward_timeout_s=1.5),
                           0, None, progress=False)
            return (await stream_agent_rollouts(spec, backend, openai_tools_agent.agent, concurrency=3, keep=True))[1]

    try:
        with pytest.warns(UserWarning) as caught:
            episodes = {t.info["index"]: t for t in asyncio.run(play())}
    finally:
        task.release.set()
    assert [str(w.message) for w in caught if "reward has not returned" in str(w.message)] == [
        "episode 1 of hanging (seed 0): its reward has not returned after 0.3 s; at 1.5 s (--reward-timeout-s), "
        "1.2 s from now, the episode ends with an error and reward 0"]
    assert episodes[1].finish_reason == "error" and episodes[1].metrics["error"] == (
        "RewardTimeout: scoring episode 1 of hanging (seed 0) took longer than 1.5 s (--reward-timeout-s); reward 0")
    assert all(episodes[i].finish_reason != "error" for i in (0, 2))


# -- the real commands in a subprocess -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_rollout_agent_plays_a_synchronous_openai_agent_and_a_langgraph_invoke_agent(tmp_path, tiny_tokenizer,
                                                                                     tiny_agent_dir):
    out, log = tmp_path / "sync.jsonl", tmp_path / "agents.log"
    done = subprocess.run(_command("rollout", "both", "--episodes", "4", "--concurrency", "2", "--out", str(out)),
                          cwd=ROOT, capture_output=True, text=True, timeout=300,  # before: it hung for good
                          env={**ENV, "SYNC_AGENTS_LOG": str(log)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(log.read_text().splitlines()) == ["0 openai_sync_agent.py:play", "1 langgraph_agent.py:invoke_agent",
                                                    "2 openai_sync_agent.py:play", "3 langgraph_agent.py:invoke_agent"]
    episodes = read_trajectories(out)
    assert sorted(t.info["index"] for t in episodes) == [0, 1, 2, 3]
    assert all(t.finish_reason != "error" for t in episodes)
    called = {t.info["index"]: assert_recorded(t, tiny_tokenizer) for t in episodes}
    assert any(called[i] for i in (0, 2)) and any(called[i] for i in (1, 3))  # each agent ran the tool through us


def _wait_for(path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists(), process.stderr.read()[-3000:] if process.poll() is not None else "the agent never started"


def _stop_by_sigterm(command: list[str], started, prog: str, within_s: float = STOP_WITHIN_S) -> str:
    """Run ``command`` until its agent is stuck (it wrote ``started``), SIGTERM it; it must be gone within
    ``within_s``, exit 143, and say on one line what is kept and how to go on. Returns that line."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**ENV, "STUCK_AGENT_STARTED": str(started)})
    try:
        _wait_for(started, process)
        time.sleep(0.5)  # stuck for good now
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        stderr = process.communicate(timeout=within_s)[1]  # before: alive at 600 s, SIGKILL needed
        waited = time.monotonic() - sent
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 128 + signal.SIGTERM and waited < within_s, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith(prog)]
    assert len(ours) == 1 and ours[0].startswith(f"{prog}: stopped by SIGTERM; "), stderr[-3000:]
    return ours[0]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_rollout_agent_that_never_returns_times_out_per_episode_and_sigterm_stops_it(tmp_path, tiny_agent_dir):
    out = tmp_path / "timed.jsonl"
    done = subprocess.run(_command("rollout", "never_returns", "--episodes", "2", "--agent-timeout-s", "3",
                                   "--out", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 1, done.stderr[-3000:]  # every episode an error: the run's status says so
    episodes = read_trajectories(out)
    assert sorted(t.info["index"] for t in episodes) == [0, 1]  # the run went on past the first
    assert all(t.finish_reason == "error" and t.metrics["error"] == "AgentTimeout: the agent played the episode for "
               "longer than 3 s (--agent-timeout-s)" for t in episodes)

    out = tmp_path / "stopped.jsonl"
    line = _stop_by_sigterm(_command("rollout", "never_returns", "--episodes", "2", "--out", str(out)),
                            tmp_path / "started", "agent-loop rollout")
    assert f"{out} holds 0 whole episodes" in line and line.endswith(f"--out {out} --resume"), line
    assert not out.with_name("stopped.jsonl.lock").exists()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_sigterm_stops_a_rollout_whose_async_agent_blocks_the_event_loop(tmp_path, tiny_agent_dir):
    """An ``async def`` calling a synchronous client blocks the loop that serves the proxy, and leaves an executor
    thread that never ends: the clean stop never starts. The stop's watchdog ends it (2 x STOP_GRACE_S)."""
    from agent_loop.cli.stops import STOP_GRACE_S

    out = tmp_path / "blocked.jsonl"
    line = _stop_by_sigterm(_command("rollout", "blocks_the_loop", "--episodes", "2", "--out", str(out)),
                            tmp_path / "started", "agent-loop rollout", within_s=2 * STOP_GRACE_S + STOP_WITHIN_S)
    assert f"{out} holds 0 whole episodes" in line and line.endswith(f"--out {out} --resume"), line


TRAIN_ONE_STEP = ("--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--mini-batches", "1",
                  "--no-tensorboard", "--no-progress", "--threads", "1")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_train_agent_trains_a_step_on_synchronous_agents(tmp_path, tiny_agent_dir):
    run, log = tmp_path / "run", tmp_path / "agents.log"
    done = subprocess.run(_command("train", "both", *TRAIN_ONE_STEP, "--output-dir", str(run)), cwd=ROOT,
                          capture_output=True, text=True, timeout=500, env={**ENV, "SYNC_AGENTS_LOG": str(log)})
    assert done.returncode == 0, done.stderr[-3000:]
    kinds = {line.split()[1] for line in log.read_text().splitlines()}
    assert kinds == {"openai_sync_agent.py:play", "langgraph_agent.py:invoke_agent"}
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1] and steps[0]["tool_calls"] > 0


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_train_agent_that_never_returns_is_stopped_by_sigterm_within_seconds(tmp_path, tiny_agent_dir):
    run = tmp_path / "run"
    line = _stop_by_sigterm(_command("train", "never_returns", *TRAIN_ONE_STEP, "--output-dir", str(run)),
                            tmp_path / "started", "agent-loop train")
    assert "no checkpoint was saved yet" in line and f"--output-dir {run}" in line, line
    assert not (run / FOLDER_LOCK).exists()
