"""How a command ends when it cannot go on: a usage error, SIGINT/SIGTERM, a write that fails.

Each is one line on stderr, no traceback: a usage error names the option (exit 2); a stop by signal
says what is written and the command that goes on from there (exit 128 + the signal's number: 130 for
SIGINT, 143 for SIGTERM). SIGTERM takes SIGINT's path, so both stop the same clean way: inside
``asyncio.run`` the running episodes are cancelled and the backend is closed; elsewhere a
KeyboardInterrupt unwinds the command's ``finally`` blocks. A background job started with SIGINT
ignored keeps ignoring it; SIGTERM still stops it (``agent_loop.signals``).

A stop by SIGTERM always ends within seconds: when the clean way has not ended the command after
:data:`STOP_GRACE_S` (an event loop blocked by user code, such as an ``async def`` agent calling a synchronous
client, never gets to cancel anything), a KeyboardInterrupt is raised in the main thread, wherever it waits; after
as long again (a thread that the interpreter waits for at exit), the process stops the processes it started (a vLLM
engine still loading its model, which no clean way could stop in time) and prints its line and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
import threading
import time
import warnings
from typing import Callable

import psutil

from agent_loop.cli.flags import USAGE_EXIT, UsageError
from agent_loop.signals import route_sigterm, sigterm_as_sigint

STOP_GRACE_S = 10.0  # seconds a stop by SIGTERM may take the clean way, before each of its two forced steps
_received: dict[str, int | None] = {"signal": None}  # the signal that stopped the run
_command: dict = {"prog": None, "args": None, "running": False, "said": False, "owns_process": False}


def _on_sigterm(signum, frame) -> None:
    if _received["signal"] is not None:  # a second SIGTERM (or the watchdog's): the clean stop is stuck
        raise KeyboardInterrupt
    _received["signal"] = signum
    if _command["running"]:
        threading.Thread(target=_force_stop, args=(signum,), name="stop-watchdog", daemon=True).start()
    sigterm_as_sigint(signum, frame)


def _stop_line(prog: str, args, number: int) -> str:
    note: Callable[[], str] | None = getattr(args, "stop_note", None)
    try:
        text = note() if note is not None else "nothing was written"
    except Exception as error:  # noqa: BLE001  (the line is printed whatever the note's trouble)
        text = f"(what is written is unknown: {type(error).__name__}: {error})"
    return f"{prog}: stopped by {signal.Signals(number).name}; {text}"


def _force_stop(signum: int) -> None:
    """The watchdog of a stop by ``signum``: a KeyboardInterrupt in the main thread after :data:`STOP_GRACE_S`
    (it interrupts whatever the main thread waits on, even an event loop that user code blocks), then, if the
    process is still there as long again and the command is the process (``owns_process``), its child processes
    stopped (:func:`_stop_children`), its stop line and ``os._exit``, whether the command still runs or returned
    (the interpreter may wait at exit for a thread that never ends, such as an executor's worker stuck in user
    code)."""
    main = threading.main_thread()
    time.sleep(STOP_GRACE_S)
    if _command["running"]:
        signal.pthread_kill(main.ident, signum)
    time.sleep(STOP_GRACE_S)
    if _command["owns_process"]:  # still stopping, or stuck in the interpreter's exit
        _stop_children()  # os._exit runs no finally: an engine's processes would outlive the command
        if not _command["said"]:
            print(_stop_line(_command["prog"], _command["args"], signum), file=sys.stderr, flush=True)
        os._exit(128 + signum)


def _stop_children(grace_s: float = 3.0) -> None:
    """SIGTERM to every process this one started (children's children too), SIGKILL to those left after
    ``grace_s``."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, left = psutil.wait_procs(children, timeout=grace_s)
    for child in left:
        with contextlib.suppress(psutil.Error):
            child.kill()


def warning_line(prog: str, message, category) -> str:
    """A warning as the commands print it: one line, ``PROG: warning: ...`` like an error's, without the
    internal FILE:LINE and source line of Python's format; a category other than UserWarning is named."""
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"{prog}: warning{kind}: {' '.join(str(message).split())}\n"


def run_command(prog: str, args, *, owns_process: bool = False) -> int:
    """``args.run(args)`` with its ending made one line: a UsageError (exit 2) or a stop by signal (128 + N).
    Each warning it raises is one line too (:func:`warning_line`).

    A command says what a stop leaves behind by setting ``args.stop_note`` to a function returning that text.
    ``owns_process``: the command is the whole process (the ``agent-loop`` entry point), so that a stop by SIGTERM
    that cannot get through the interpreter's exit may end the process (:func:`_force_stop`).
    """
    route_sigterm(_on_sigterm)  # SIGTERM (what schedulers send) stops a command the way Ctrl-C does
    _received["signal"] = None
    _command.update(prog=prog, args=args, running=True, said=False, owns_process=owns_process)
    # the format, not showwarning: pytest.warns and other recorders still see every warning
    default = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_, **__: warning_line(prog, message, category)
    try:
        return _ended(prog, args)
    finally:
        _command["running"] = False
        warnings.formatwarning = default


def _ended(prog: str, args) -> int:
    try:
        return args.run(args)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_EXIT
    except (KeyboardInterrupt, asyncio.CancelledError) as stop:
        if isinstance(stop, asyncio.CancelledError) and _received["signal"] is None:
            raise  # not a stop by signal
        number = _received["signal"] or signal.SIGINT
        _command["said"] = True
        print(_stop_line(prog, args, number), file=sys.stderr)
        return 128 + number


def go_on_command(prog: str, argv: list[str], *, drop: dict[str, bool | str], add: list[str]) -> str:
    """The command line that goes on from a stopped run: ``prog ARGV`` without the options in ``drop``
    (name -> whether it takes a value: True, False, or ``"?"``, a value when the next word is no option, as
    ``--resume [FOLDER]``; ``--no-NAME`` forms too), with ``add`` at the end."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        base = "--" + name[5:] if name.startswith("--no-") else name
        if base in drop:
            takes = drop[base] is True or (drop[base] == "?" and i + 1 < len(argv) and not argv[i + 1].startswith("-"))
            skip = takes and "=" not in arg and not name.startswith("--no-")
            continue
        kept.append(arg)
    return " ".join([prog, shlex.join(kept + add)]).strip()
