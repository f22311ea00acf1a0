"""``agent-loop inspect ROLLOUTS.jsonl``: see spans, rewards, returns and advantages token by token.

Views: the terminal (rich), ``--html OUT.html`` (one self-contained page), ``--png OUT.png``
(matplotlib), and ``--compare`` (carry-through vs. reset-at-observation vs. ignoring the mask).

Bad lines of the input (not JSON, truncated, not a Trajectory) are reported on stderr with the
file and line, and the good lines still render. Exit status: 0 when at least one episode was
loaded and rendered (warnings or not), 1 when nothing could be rendered (missing or empty file,
no good line, an out-of-range ``--episode``, no episode matching the selection), 2 on a usage error.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from agent_loop.inspect.load import load_trajectories
from agent_loop.options import int_at_least
from agent_loop.inspect.view import build_view, select

__all__ = ["add_arguments", "main"]


def discount(text: str) -> float:
    """argparse type: a float in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"gamma must be in [0, 1], got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``agent-loop inspect`` (also used by ``python -m agent_loop.inspect``)."""
    parser.add_argument("rollouts", help="JSON Lines file, one Trajectory per line")
    parser.add_argument("--episode", type=int_at_least(0), action="append", metavar="N",
                        help="show episode N (0-based index among the file's trajectories); repeatable")
    parser.add_argument("--worst", type=int_at_least(1), nargs="?", const=1, metavar="K",
                        help="show the K lowest-reward episodes (default 1)")
    parser.add_argument("--failed", action="store_true", help="show only failed episodes")
    parser.add_argument("--values", action="store_true",
                        help="terminal: a table per turn with each token's logprob, reward, return and advantage")
    parser.add_argument("--compare", action="store_true",
                        help="returns under carry-through, reset-at-observation and ignore-mask side by side")
    parser.add_argument("--gamma", type=discount, default=1.0, help="discount of the returns, in [0, 1] (default 1.0)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="local tokenizer folder (default: each trajectory's info['model_path'])")
    parser.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML page")
    parser.add_argument("--png", metavar="OUT.png", help="write matplotlib figures to a PNG")
    parser.add_argument("--max-episodes", type=int_at_least(1), default=100, metavar="N",
                        help="render at most N of the selected episodes (default 100; the batch overview covers all)")
    parser.add_argument("--width", type=int_at_least(20), help="terminal width, at least 20 (default: detected)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no terminal view (with --html/--png)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-loop inspect", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Render ``args`` (parsed by a parser set up with :func:`add_arguments`); returns the exit status."""
    console = console or Console(width=args.width)
    err = Console(stderr=True, width=args.width)
    loaded = load_trajectories(args.rollouts)
    if not loaded.trajectories:
        for problem in loaded.problems:
            err.print(f"[red]error:[/red] {problem}", markup=True, highlight=False, soft_wrap=True)
        err.print(f"[red]error:[/red] {args.rollouts}: nothing to render", highlight=False, soft_wrap=True)
        return 1
    try:
        rows = select(loaded.trajectories, args.episode, args.worst, args.failed)
    except ValueError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 1
    if len(rows) > args.max_episodes:
        err.print(f"[yellow]warning:[/yellow] showing {args.max_episodes} of {len(rows)} selected episodes "
                  "(--max-episodes, --episode, --worst, --failed)", highlight=False, soft_wrap=True)
        rows = rows[: args.max_episodes]
    view = build_view(loaded, gamma=args.gamma, tokenizer_dir=args.tokenizer, selected=rows)
    for problem in view.problems:
        err.print(f"[yellow]warning:[/yellow] {problem}", highlight=False, soft_wrap=True)
    if not args.quiet:
        from agent_loop.inspect import terminal

        terminal.render(view, console, values=args.values, compare=args.compare)
    if args.html:
        from agent_loop.inspect import html

        with open(args.html, "w", encoding="utf-8") as f:
            f.write(html.render(view, compare=args.compare))
        err.print(f"wrote {args.html}", highlight=False)
    if args.png:
        from agent_loop.inspect import plots

        plots.render(view, args.png, compare=args.compare)
        err.print(f"wrote {args.png}", highlight=False)
    if not rows:
        err.print("[red]error:[/red] no episode matches the selection", highlight=False)
        return 1
    return 0
