"""How a command stops on SIGTERM when it runs as a background job (SIGINT ignored from the start): in
process, with the real signals raised at chosen points (agent_loop/cli/stops.py, agent_loop/signals.py)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from types import SimpleNamespace

import pytest

from agent_loop.cli.stops import run_command


@pytest.fixture
def background_job():
    """SIGINT ignored and SIGTERM unclaimed, as a job started with ``&`` from a script; restored after."""
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])


def command(run) -> SimpleNamespace:
    return SimpleNamespace(run=run, stop_note=lambda: "it wrote what it wrote")


def test_sigterm_inside_a_running_task_cancels_at_an_await_never_mid_code(background_job, capsys, caplog):
    """It raised a KeyboardInterrupt at the next bytecode of whichever task ran (possibly mid-write), and
    asyncio then logged that task's traceback ("Task exception was never retrieved")."""
    steps = []

    async def episode(number: int):
        await asyncio.sleep(0)
        if number == 0:
            signal.raise_signal(signal.SIGTERM)  # the handler runs here, inside this task's step
            steps.append("written")  # the code after it still runs: the stop comes at the next await
        await asyncio.sleep(10)
        steps.append(f"episode {number} finished")

    async def main():
        await asyncio.gather(*(episode(n) for n in range(3)))

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert run_command("agent-loop rollout", command(lambda args: asyncio.run(main()))) == 128 + signal.SIGTERM
        gc.collect()  # an unretrieved task exception is logged when the task is collected
    assert steps == ["written"]
    assert capsys.readouterr().err == "agent-loop rollout: stopped by SIGTERM; it wrote what it wrote\n"
    assert caplog.records == []


def test_sigterm_outside_an_event_loop_is_a_keyboard_interrupt_and_sigint_stays_ignored(background_job, capsys):
    reached = []

    def run(args):
        signal.raise_signal(signal.SIGINT)  # ignored: a background job is deaf to Ctrl-C
        reached.append("after SIGINT")
        signal.raise_signal(signal.SIGTERM)
        reached.append("after SIGTERM")  # never: the KeyboardInterrupt unwinds the command

    assert run_command("agent-loop train", command(run)) == 128 + signal.SIGTERM
    assert reached == ["after SIGINT"]
    assert capsys.readouterr().err == "agent-loop train: stopped by SIGTERM; it wrote what it wrote\n"


def test_a_cancellation_that_no_signal_caused_is_not_called_a_stop(background_job):
    async def cancelled():
        asyncio.current_task().cancel()
        await asyncio.sleep(1)

    with pytest.raises(asyncio.CancelledError):
        run_command("agent-loop rollout", command(lambda args: asyncio.run(cancelled())))


@pytest.mark.parametrize("job", ["background", "terminal"])
def test_sigterm_stops_a_command_whose_event_loop_user_code_blocks(request, monkeypatch, capsys, job):
    """Issue 49: an agent that blocks the event loop (an ``async def`` calling a synchronous client) never lets the
    loop cancel anything, so SIGTERM's clean way never ended the run. After STOP_GRACE_S (0.5 s here) a
    KeyboardInterrupt is raised in the main thread, wherever it waits."""
    import threading
    import time

    import agent_loop.cli.stops as stops

    if job == "background":
        request.getfixturevalue("background_job")
    else:  # SIGINT as a terminal leaves it: asyncio.run takes it over, SIGTERM takes its path
        saved = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        request.addfinalizer(lambda: signal.signal(signal.SIGTERM, saved))
    monkeypatch.setattr(stops, "STOP_GRACE_S", 0.5)
    main = threading.main_thread().ident

    async def blocked():
        threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGTERM)).start()
        time.sleep(60)  # user code on the event loop: nothing awaits, nothing can be cancelled

    started = time.monotonic()
    assert run_command("agent-loop rollout", command(lambda args: asyncio.run(blocked()))) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 10
    assert capsys.readouterr().err == "agent-loop rollout: stopped by SIGTERM; it wrote what it wrote\n"


def test_a_stuck_stop_ends_the_processes_the_command_started(tmp_path):
    """The watchdog's last step is ``os._exit``, which runs no ``finally``: a vLLM engine still loading its model
    (it cannot be stopped from outside before it has started) would outlive the command. The watchdog stops
    the command's child processes first, one that ignores SIGTERM too. Stuck here: the clean stop returns, then
    the interpreter's exit waits for a thread that never ends."""
    import subprocess
    import sys
    import textwrap

    import psutil

    script = textwrap.dedent("""
        import subprocess, sys, threading, time
        from types import SimpleNamespace
        import agent_loop.cli.stops as stops
        stops.STOP_GRACE_S = 0.5

        def run(args):
            stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"
            child = subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE)
            child.stdout.readline()  # it ignores SIGTERM from now on
            threading.Thread(target=time.sleep, args=(600,)).start()  # the interpreter's exit would wait for it
            print(child.pid, flush=True)
            time.sleep(600)  # SIGTERM ends this wait (the clean stop); the exit then waits on the thread

        sys.exit(stops.run_command("agent-loop rollout", SimpleNamespace(run=run), owns_process=True))
    """)

    def default_signals():  # not the test worker's: a signal ignored there would be ignored in the command too
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    popen = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=tmp_path, preexec_fn=default_signals)
    child = psutil.Process(int(popen.stdout.readline()))
    popen.send_signal(signal.SIGTERM)
    try:
        _, err = popen.communicate(timeout=60)
        assert popen.returncode == 128 + signal.SIGTERM, err
        assert err.splitlines()[-1] == "agent-loop rollout: stopped by SIGTERM; nothing was written", err
        child.wait(timeout=10)  # gone, not only orphaned
        assert not child.is_running()
    finally:
        if child.is_running():
            child.kill()
