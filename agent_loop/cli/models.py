"""``agent-loop models``: the built-in models (``--model NAME`` in every command), with their download's size and
sha256 and whether each is ready (converted / wheel present / missing: run scripts/setup.sh)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from agent_loop.cli.options import add_threads_option, threads_from

PROG = "agent-loop models"
DESCRIPTION = ("list the built-in models (--model NAME): size, sha256 and status (converted, wheel present: "
               "converted on first use, missing: run scripts/setup.sh)")


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("models", help=f"{DESCRIPTION} (--help)", description=DESCRIPTION)
    add_threads_option(parser)  # every command takes --threads (one rule)
    parser.set_defaults(run=run, prog=PROG)
    return parser


def run(args: argparse.Namespace) -> int:
    from agent_loop.model_registry import listing

    threads_from(args)  # checked: --threads 0 is a usage error; listing computes nothing

    table = Table(title="built-in models (--model NAME)")
    for column in ("name", "model", "parameters", "size", "sha256", "status"):
        table.add_column(column, overflow="fold")
    rows = listing()
    for row in rows:
        parameters = f"{row['parameters'] / 1e6:.1f}M" if row["parameters"] else "-"
        table.add_row(row["name"], row["model"], parameters, row["size"], row["sha256"], row["status"])
    console = Console()
    console.print(table)
    for row in rows:
        console.print(f"{row['name']}: {row['folder']}", highlight=False, soft_wrap=True)
    return 0
