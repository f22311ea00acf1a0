"""How a command ends when it cannot go on: a usage error, SIGINT/SIGTERM, a write that fails.

Each is one line on stderr, no traceback: a usage error names the option (exit 2); a stop by signal
says what is written and the command that goes on from there (exit 128 + the signal's number: 130 for
SIGINT, 143 for SIGTERM). SIGTERM takes SIGINT's path, so both stop the same clean way: inside
``asyncio.run`` the running episodes are cancelled and the backend is closed; elsewhere a
KeyboardInterrupt unwinds the command's ``finally`` blocks. A background job started with SIGINT
ignored keeps ignoring it; SIGTERM still stops it (``agent_loop.signals``).
"""

from __future__ import annotations

import asyncio
import shlex
import signal
import sys
import warnings
from typing import Callable

from agent_loop.cli.options import USAGE_EXIT, UsageError
from agent_loop.signals import route_sigterm, sigterm_as_sigint

_received: dict[str, int | None] = {"signal": None}  # the signal that stopped the run


def _on_sigterm(signum, frame) -> None:
    _received["signal"] = signum
    sigterm_as_sigint(signum, frame)


def warning_line(prog: str, message, category) -> str:
    """A warning as the commands print it: one line, ``PROG: warning: ...`` like an error's, without the
    internal FILE:LINE and source line of Python's format; a category other than UserWarning is named."""
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"{prog}: warning{kind}: {' '.join(str(message).split())}\n"


def run_command(prog: str, args) -> int:
    """``args.run(args)`` with its ending made one line: a UsageError (exit 2) or a stop by signal (128 + N).
    Each warning it raises is one line too (:func:`warning_line`).

    A command says what a stop leaves behind by setting ``args.stop_note`` to a function returning that text.
    """
    route_sigterm(_on_sigterm)  # SIGTERM (what schedulers send) stops a command the way Ctrl-C does
    _received["signal"] = None
    # the format, not showwarning: pytest.warns and other recorders still see every warning
    default = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_, **__: warning_line(prog, message, category)
    try:
        return _ended(prog, args)
    finally:
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
        note: Callable[[], str] | None = getattr(args, "stop_note", None)
        text = note() if note is not None else "nothing was written"
        print(f"{prog}: stopped by {signal.Signals(number).name}; {text}", file=sys.stderr)
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
