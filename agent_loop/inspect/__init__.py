"""``agent-loop inspect ROLLOUTS.jsonl [OTHER.jsonl]``: see spans, rewards, returns and advantages token by token.

Views: the terminal (rich: a summary and the few most informative episodes; ``--all`` for every
one), ``--html OUT.html`` (one self-contained page with in-page filters), ``--png OUT.png``
(matplotlib), and ``--compare`` (carry-through vs. reset-at-observation vs. ignoring the mask).
With two files, the runs are compared episode by episode (matched by ``info.index`` and seed).

The file is read one line at a time: memory grows with the episodes shown, not with the file.
Bad lines are reported on stderr with FILE:LINE, and the good lines still render.
Exit status: 0 when episodes were rendered; 1 when nothing could be (no good line, no episode
matching the selection); 2 on a usage error or an input that is not a JSON Lines file.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rich.console import Console

from agent_loop.inspect.load import InputError
from agent_loop.inspect.values import LABEL
from agent_loop.inspect.view import INFORMATIVE, Selection, build_view, scan
from agent_loop.options import int_at_least

__all__ = ["add_arguments", "main"]


def discount(text: str) -> float:
    """argparse type: a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``agent-loop inspect`` (also used by ``python -m agent_loop.inspect``)."""
    parser.add_argument("rollouts", nargs="+", metavar="ROLLOUTS.jsonl",
                        help="JSON Lines file, one Trajectory per line; give two files to compare two runs")
    parser.add_argument("--episode", type=int_at_least(0), action="append", metavar="N",
                        help="show the episode whose info.index is N; repeatable")
    parser.add_argument("--worst", type=int_at_least(1), nargs="?", const=1, metavar="K",
                        help="show the K lowest-reward episodes (default K: 1)")
    parser.add_argument("--failed", action="store_true", help="only failed episodes")
    parser.add_argument("--all", action="store_true",
                        help=f"show every episode (up to --max-episodes), not only the {INFORMATIVE} most informative")
    parser.add_argument("--values", action="store_true",
                        help="terminal: a table per turn with each token's logprob, reward, return and advantage")
    parser.add_argument("--compare", action="store_true",
                        help="returns under carry-through, reset-at-observation and ignore-mask side by side")
    parser.add_argument("--estimator", choices=list(LABEL), default="reinforce_plus_plus",
                        help="registered estimator whose returns and (whitened) advantages are shown "
                             "(default: reinforce_plus_plus, carry-through)")
    parser.add_argument("--gamma", type=discount, default=None,
                        help="discount of the returns, in [0, 1] (default: info['gamma'] of the file, else 1.0)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="local tokenizer folder (default: each trajectory's info['model_path'])")
    parser.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML page")
    parser.add_argument("--png", metavar="OUT.png", help="write matplotlib figures to a PNG")
    parser.add_argument("--max-episodes", type=int_at_least(1), default=100, metavar="N",
                        help="the most episodes kept for --all and the HTML page (default 100; the summary covers all)")
    parser.add_argument("--width", type=int_at_least(20), help="terminal width, at least 20 (default: detected)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no terminal view (with --html/--png)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) before any file is read or written."""
    if len(args.rollouts) > 2:
        parser.error(f"give one file to inspect or two to compare, got {len(args.rollouts)}")
    for name in ("html", "png"):
        out = getattr(args, name)
        if out is None:
            continue
        path = Path(out)
        if path.is_dir():
            parser.error(f"--{name} {out}: is a folder, expected a file name")
        if not path.parent.is_dir():
            parser.error(f"--{name} {out}: the folder {path.parent} does not exist")
        if path.resolve() in {Path(r).resolve() for r in args.rollouts}:
            parser.error(f"--{name} {out}: is an input file; it would be overwritten")
    if len(args.rollouts) == 2:
        for name in ("png", "worst", "values", "compare"):
            if getattr(args, name):
                parser.error(f"--{name} shows one run; with two files give --all, --episode, --failed, --html")
    if sum(x is not None and x is not False for x in (args.episode, args.worst, args.all or None)) > 1:
        parser.error("--episode, --worst and --all choose episodes in different ways: give one of them")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-loop inspect", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    return run(args)


def write_atomically(path: str, write) -> None:
    """Write through a temporary file in the same folder, renamed over ``path`` only once complete."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would have made it
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def selection_of(args: argparse.Namespace) -> Selection:
    if args.episode:
        ids = list(dict.fromkeys(args.episode))
        return Selection("ids", len(ids), ids, args.failed)
    if args.worst:
        return Selection("worst", args.worst, failed=args.failed)
    if args.all:
        return Selection("all", args.max_episodes, failed=args.failed)
    return Selection("informative", INFORMATIVE, failed=args.failed, keep_first=args.max_episodes if args.html else 0)


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Render ``args`` (parsed by a parser set up with :func:`add_arguments`); returns the exit status."""
    console = console or Console(width=args.width)
    err = Console(stderr=True, width=args.width, soft_wrap=True, highlight=False)
    if len(args.rollouts) == 2:
        from agent_loop.inspect import runs

        return runs.run(args, console, err)
    path = args.rollouts[0]
    try:
        scanned = scan(path, selection_of(args), args.gamma, args.compare, estimator=LABEL[args.estimator])
    except InputError as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    for problem in scanned.problems.lines():
        err.print(f"[yellow]warning:[/yellow] {problem}")
    if scanned.summary.episodes == 0:
        err.print(f"[red]error:[/red] {path}: nothing to render (no good line)")
        return 1
    if scanned.wanted_ids_missing:
        s = scanned.summary
        err.print(f"[red]error:[/red] {path}: no episode with info.index {', '.join(map(str, scanned.wanted_ids_missing))} "
                  f"(--episode; the file's episodes run from {s.first_id} to {s.last_id})")
        return 1
    view = build_view(scanned, tokenizer_dir=args.tokenizer)
    for problem in view.problems[len(scanned.problems.lines()):]:
        err.print(f"[yellow]warning:[/yellow] {problem}")
    if not args.quiet:
        from agent_loop.inspect import terminal

        terminal.render(view, console, values=args.values, compare=args.compare, all_mode=bool(args.all))
    if args.html:
        from agent_loop.inspect import html

        page = html.render(view, compare=args.compare)
        write_atomically(args.html, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
        err.print(f"wrote {args.html}")
    if args.png:
        from agent_loop.inspect import plots

        write_atomically(args.png, lambda tmp: plots.render(view, tmp, compare=args.compare))
        err.print(f"wrote {args.png}")
    if not view.trajectories:
        err.print("[red]error:[/red] no episode matches the selection")
        return 1
    return 0
