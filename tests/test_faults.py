"""Nothing lost under faults (issue 14): hostile tools, torn files, killed processes, dead servers and actors.

Every test runs the real part (a real subprocess killed with SIGKILL, real aiohttp servers on
127.0.0.1 that die or stall, a real local Ray cluster whose actor is SIGKILLed, a real vLLM server
killed mid-run) and is bounded in time.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_loop.jsonl import JsonlWriter, OutputExistsError, repair_tail, written_episodes
from agent_loop.runner import read_trajectories

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


# -- tools ------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_every_tool_fault_ends_as_a_tool_error_and_the_process_exits(qwen_dir, tmp_path):
    """sys.exit, KeyboardInterrupt and SystemExit in a coroutine, a lone surrogate, 5 MB, and 10 threads
    blocked forever: every episode is written, each fault as its tool error, and the process exits."""
    out = tmp_path / "faulty.jsonl"
    episodes = 60
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "faulty_tools_run.py"), str(qwen_dir), str(out),
                           str(episodes)], env=ENV, capture_output=True, text=True, timeout=100)
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["episodes"] == episodes
    trajectories = {t.info["index"]: t for t in read_trajectories(out)}
    assert sorted(trajectories) == list(range(episodes))
    assert all(t.finish_reason == "stop" and t.reward == 1.0 for t in trajectories.values())
    tools = ["leave", "interrupt", "leave_async", "surrogate", "huge", "fine"]
    for index, t in trajectories.items():
        (record,) = t.tool_calls
        name = "block" if index < 10 else tools[index % 6]
        assert record.name == name
        if name == "block":
            assert record.error_kind == "timeout"
        elif name in ("leave", "leave_async"):
            assert record.error_kind == "exception" and "SystemExit" in record.error
        elif name == "interrupt":
            assert record.error_kind == "exception" and "KeyboardInterrupt" in record.error
        elif name == "surrogate":
            assert record.error is None and "\ufffd" in record.result and "\ud800" not in record.result
        elif name == "huge":  # capped before tokenizing: 64 tokens x 16 chars, plus the mark; original size kept
            assert record.result_chars == 5_000_000 and len(record.result) <= 64 * 16 + 20
            assert t.metrics["observation_tokens"] <= 64 + 8 and t.metrics["observation_truncations"] == 1
        else:
            assert record.result == "ok 3"
    # 10 hung calls did not starve the others: those finished within one tool timeout of the run
    fine = [t.tool_calls[0].latency_s for i, t in trajectories.items() if i >= 10 and tools[i % 6] == "fine"]
    assert max(fine) < 0.9
    lines = out.read_bytes().splitlines()
    assert max(map(len, lines)) < 200_000  # the 5 MB result is not in the record
    assert wall < 90


# -- files ------------------------------------------------------------------------------------------


def test_torn_tail_is_cut_before_appending_and_new_refuses_existing(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"info": {"index": 0, "seed": 1}}\n{"info": {"index": 1, "se')
    with pytest.raises(OutputExistsError, match="--resume"):
        JsonlWriter(path, "new")
    assert path.read_bytes().endswith(b'"se')  # refused: untouched
    assert written_episodes(path, seed=1) == {0}  # the torn line does not count
    with pytest.warns(UserWarning, match="torn last line"):
        writer = JsonlWriter(path, "append")
    writer.write_line(json.dumps({"info": {"index": 1, "seed": 1}}))
    writer.close()
    assert [json.loads(line)["info"]["index"] for line in path.read_text().splitlines()] == [0, 1]
    assert repair_tail(path) == 0
    path.write_bytes(b'{"info": {"index": 0, "seed": 1}}\nnot json\n{"info": {"index": 2, "seed": 1}}\n')
    with pytest.raises(ValueError, match="line 2"):
        written_episodes(path, seed=1)


@pytest.mark.timeout(300)
def test_sigkilled_rollout_resumes_with_every_episode_exactly_once(tiny_agent_dir, tmp_path):
    """The real CLI on the tiny agent: SIGKILL it mid-run, tear its last line, then --resume."""
    out = tmp_path / "run.jsonl"
    command = [sys.executable, "-m", "agent_loop.cli", "rollout", "--model", str(tiny_agent_dir), "--backend", "hf",
               "--episodes", "48", "--concurrency", "4", "--seed", "5", "--out", str(out)]
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 8:
            break
        time.sleep(0.05)
    assert process.poll() is None, f"finished before it could be killed: {process.stderr.read()[-2000:]}"
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    first = read_trajectories(out)
    assert 8 <= len(first) < 48
    with open(out, "ab") as f:
        f.write(b'{"prompt_ids": [1, 2')  # as if killed inside a write

    refused = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--resume" in refused.stderr
    assert out.read_bytes().endswith(b'[1, 2')  # an existing --out is never touched without --resume/--append

    resumed = subprocess.run(command + ["--resume"], env=ENV, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "torn last line" in resumed.stderr
    final = read_trajectories(out)
    indices = [t.info["index"] for t in final]
    assert sorted(indices) == list(range(48))  # every episode exactly once
    assert [t.to_json() for t in final[: len(first)]] == [t.to_json() for t in first]  # the first run's kept as written
    again = subprocess.run(command + ["--resume"], env=ENV, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "nothing to play" in again.stdout


# -- trainer checkpoints ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_trainer_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    from agent_loop.tiny import tiny_agent_path
    from trainer.checkpoint import CheckpointError, resolve_checkpoint
    from trainer.config import TrainConfig
    from trainer.trainer import Trainer

    run = tmp_path / "run"
    settings = dict(model=str(tiny_agent_path(stage="mid")), steps=3, prompts_per_step=2, group_size=2, concurrency=4,
                    mini_batches=1, micro_batch_size=4, save_every=1, output_dir=str(run), threads=1)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()] + ["--no-progress"]
    process = subprocess.Popen([sys.executable, "-m", "trainer", *argv], env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    saving = run / "checkpoints" / ".tmp-step_000002"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and not saving.exists():
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    assert process.returncode == -signal.SIGKILL, process.stderr.read()[-2000:]
    assert saving.exists(), "the kill missed the save of step 2"
    assert not (run / "checkpoints" / "step_000002").exists()
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2]  # step 2 was logged before its save

    # a half-written checkpoint is refused by name; the run folder resolves to the last complete one
    (run / "checkpoints" / "step_000001" / "trainer_state.pt").rename(run / "state.bak")
    with pytest.raises(CheckpointError, match="missing trainer_state.pt"):
        resolve_checkpoint(run / "checkpoints" / "step_000001")
    (run / "state.bak").rename(run / "checkpoints" / "step_000001" / "trainer_state.pt")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_000001"

    config = TrainConfig(**settings, progress=False, resume=str(run))
    with pytest.raises(CheckpointError, match=r"lr: 0.0002 -> 0.001"):
        Trainer(TrainConfig(**{**settings, "lr": 1e-3}, progress=False, resume=str(run)))
    trainer = Trainer(config)
    assert trainer.step == 1
    trainer.train()
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]  # step 2 once, from the resumed run
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_000003"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert not (run / "checkpoints" / ".tmp-step_000002").exists()
