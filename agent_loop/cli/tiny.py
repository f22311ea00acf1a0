"""``agent-loop tiny [--force]``: unpack the shipped tiny agent (or reuse the cached one; ``--force``: rebuild it
from its recipe here) and print its evaluation."""

from __future__ import annotations

import argparse
import sys

from rich import box
from rich.console import Console
from rich.table import Table

from agent_loop.cli.flags import add_common_options, threads_from
from agent_loop.options import rate
from agent_loop.threads import apply_threads

PROG = "agent-loop tiny"
DESCRIPTION = "unpack (or reuse) the shipped tiny agent, or rebuild it with --force, and print its evaluation"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--force", action="store_true", help="rebuild from the recipe here (minutes), replacing the cached or shipped build")
    return add_common_options(parser)  # this process's; a --force rebuild pins its own (AGENT_LOOP_TINY_THREADS)


def add_parser(commands) -> argparse.ArgumentParser:
    parser = add_arguments(commands.add_parser("tiny", help=f"{DESCRIPTION} (--help)", description=DESCRIPTION))
    parser.set_defaults(run=run, prog=PROG)
    return parser


def run(args: argparse.Namespace) -> int:
    apply_threads(threads_from(args))
    # torch: the rollout path imports this module without it
    from agent_loop.tiny.build import build, build_dir, build_lock, build_record

    target = build_dir()
    if args.force:
        with build_lock(target):
            build(target, progress=getattr(args, "progress", True))
    record = build_record()
    steps = ", ".join(f"{stage} = step {info['step']}" for stage, info in record["stages"].items())
    # 60 columns hold it whole (issue 56): no vertical rules, names never wrapped, headers wrap at words
    table = Table(title=f"tiny agent {record['recipe']}: {steps} (n: episodes)", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    for column in ("stage", "task", "decoding"):
        table.add_column(column, no_wrap=True)
    for column in ("n", "well formed", "right args", "success"):
        table.add_column(column, justify="right")
    for stage, info in record["stages"].items():
        for row in info["eval"]:
            table.add_row(stage, row["task"], "greedy" if row["greedy"] else "T=1.0", str(row["episodes"]),
                          rate(row["well_formed"]), rate(row["right_arguments"]), rate(row["success"]))
    console = Console()
    console.print(table)
    console.print(f"at {target}", highlight=False, soft_wrap=True)
    shipped = target / "shipped.txt"
    origin = f"shipped ({shipped.read_text().strip()}); built in" if shipped.exists() else "built here in"
    console.print(f"{origin} {record['build_seconds']:.0f} s (evaluation {record['eval_seconds']:.0f} s), "
                  f"{record['parameters']:,} parameters, vocabulary {record['vocab_size']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m agent_loop.tiny [--force]``."""
    return run(add_arguments(argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)).parse_args(
        sys.argv[1:] if argv is None else argv))
