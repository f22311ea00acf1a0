"""``agent-loop inspect ROLLOUTS.jsonl [OTHER.jsonl]``: its options; the views are :mod:`agent_loop.inspect`'s."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent_loop.cli.options import USAGE_EXIT, UsageError, int_at_least
from agent_loop.inspect.choices import INFORMATIVE, LABEL

PROG = "agent-loop inspect"
DESCRIPTION = "see spans, rewards, returns and advantages token by token"


def discount(text: str) -> float:
    """argparse type: a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``agent-loop inspect`` (and of ``python -m agent_loop.inspect``)."""
    parser.add_argument("rollouts", nargs="+", metavar="ROLLOUTS.jsonl",
                        help="JSON Lines file, one Trajectory per line; give two files to compare two runs")
    parser.add_argument("--episode", type=int_at_least(0), action="append", metavar="N",
                        help="show the episode whose info.index is N; repeatable")
    parser.add_argument("--worst", type=int_at_least(1), nargs="?", const=1, metavar="K",
                        help="show the K lowest-reward episodes with their values per token (as --values; default K: 1)")
    parser.add_argument("--failed", action="store_true", help="only failed episodes")
    parser.add_argument("--all", action="store_true",
                        help=f"show every episode (up to --max-episodes), not only the {INFORMATIVE} most informative")
    parser.add_argument("--values", action="store_true",
                        help="terminal: a table per turn with each token's logprob, reward, return and advantage")
    parser.add_argument("--color-by", choices=("span", "version"), default="span",
                        help="terminal: colour tokens by span (default), or assistant tokens by the policy version "
                             "that sampled them (the trainer's step files; an episode that ran across a "
                             "weight update shows both)")
    parser.add_argument("--compare", action="store_true",
                        help="returns under carry-through, reset-at-observation and ignore-mask side by side")
    parser.add_argument("--estimator", choices=list(LABEL), default=None,
                        help="registered estimator whose returns and (whitened) advantages are computed "
                             "(default: info['estimator'] of the file, else reinforce_plus_plus, carry-through); "
                             "episodes of a training step file show the step's own values")
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
    return parser


def check_arguments(args: argparse.Namespace) -> None:
    """Usage errors (exit 2) before any file is read or written."""
    if len(args.rollouts) > 2:
        raise UsageError(f"give one file to inspect or two to compare, got {len(args.rollouts)}")
    for name in ("html", "png"):
        out = getattr(args, name)
        if out is None:
            continue
        path = Path(out)
        if path.is_dir():
            raise UsageError(f"--{name} {out}: is a folder, expected a file name")
        if not path.parent.is_dir():
            raise UsageError(f"--{name} {out}: the folder {path.parent} does not exist")
        if path.resolve() in {Path(r).resolve() for r in args.rollouts}:
            raise UsageError(f"--{name} {out}: is an input file; it would be overwritten")
    if len(args.rollouts) == 2:
        for name in ("png", "worst", "values", "compare"):
            if getattr(args, name):
                raise UsageError(f"--{name} shows one run; with two files give --all, --episode, --failed, --html")
    if sum(x is not None and x is not False for x in (args.episode, args.worst, args.all or None)) > 1:
        raise UsageError("--episode, --worst and --all choose episodes in different ways: give one of them")


def add_parser(commands) -> argparse.ArgumentParser:
    parser = add_arguments(commands.add_parser("inspect", help=f"{DESCRIPTION} (--help)", description=DESCRIPTION))
    parser.set_defaults(run=run, prog=PROG)
    return parser


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from agent_loop.inspect import run as render

    return render(args)


def main(argv: list[str] | None = None) -> int:
    """``agent-loop inspect ARGV`` on its own (``python -m agent_loop.inspect``)."""
    args = add_arguments(argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)).parse_args(argv)
    try:
        return run(args)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_EXIT
