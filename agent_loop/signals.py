"""SIGTERM stops a run the way Ctrl-C does: schedulers stop jobs with SIGTERM, and only the SIGINT path
(``asyncio.run`` cancelling its tasks, or a KeyboardInterrupt) unwinds the ``finally`` and ``with`` blocks
that close engines and release output files. Used by the CLI (``agent_loop.cli.stops``) and by the vLLM
engine backend for library users. Also how the engine backend stops the processes of an engine whose start
was interrupted: at once and without a word (:func:`freeze`, :func:`kill`)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import signal
import threading
from collections.abc import Iterable
from typing import Callable

import psutil


def cancel_running_tasks() -> bool:
    """What ``asyncio.run`` does on Ctrl-C, for when it could not take SIGINT over (a background job ignores
    SIGINT): cancel the tasks of the event loop running in this thread, so that they stop at an await (never
    inside a write). False when no loop runs here."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    for task in asyncio.all_tasks(loop):
        task.cancel()
    return True


def sigterm_as_sigint(signum, frame) -> None:
    """A SIGTERM handler: SIGINT's path. Where SIGINT is ignored (a background job, which stays deaf to it)
    the running tasks are cancelled, or, with no event loop running, a KeyboardInterrupt is raised."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.raise_signal(signal.SIGINT)  # asyncio.run cancels its main task on SIGINT; elsewhere: KeyboardInterrupt
    elif not cancel_running_tasks():
        raise KeyboardInterrupt


def route_sigterm(handler: Callable = sigterm_as_sigint) -> None:
    """Install ``handler`` for SIGTERM where nobody has claimed it yet, from the main thread (else nothing)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, handler)


def spawned_processes() -> set[int]:
    """The process ids of this process's running ``multiprocessing`` children (a vLLM engine core is one)."""
    return {child.pid for child in multiprocessing.active_children()}


def freeze(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes ``pids`` and every process they started, frozen (SIGSTOP), each before its children are
    listed, so that none can start another meanwhile; those frozen, parents first. Processes already gone are
    left out."""
    frozen: list[psutil.Process] = []
    pending = list(pids)
    while pending:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pending.pop(0))
            process.suspend()
            frozen.append(process)
            pending.extend(child.pid for child in process.children())
    return frozen


def resume(processes: Iterable[psutil.Process]) -> None:
    """Undo :func:`freeze` (SIGCONT)."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.resume()


def kill(processes: Iterable[psutil.Process]) -> None:
    """SIGKILL to each of ``processes``. Frozen first (:func:`freeze`), none of them sees another die, so none
    prints about it: stopped one by one, the survivors would (a vLLM engine core whose worker is gone logs
    "WorkerProc initialization failed" with a traceback). Their shared memory is released at exit by this
    process's resource tracker."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
