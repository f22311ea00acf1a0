"""``agent-loop verl-check``: compare our ``advantages`` with the verl installed in this environment, function by
function (``agent_loop.integrations.verl_comparison`` runs the checks), print one table row per check and exit 1 on
any ``FAIL`` (docs/verl.md, "How it was checked")."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from agent_loop.cli.flags import add_common_options, threads_from

PROG = "agent-loop verl-check"
DESCRIPTION = ("compare agent-loop's estimators, losses and verl plugin with the installed verl's on random "
               "multi-turn batches; exit 1 on any difference docs/verl.md does not list")
SEEDS = 5


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("verl-check", help=f"{DESCRIPTION} (--help)", description=DESCRIPTION)
    add_common_options(parser)  # every command takes --threads and --progress (one rule)
    parser.set_defaults(run=run, prog=PROG)
    return parser


def run(args: argparse.Namespace) -> int:
    threads = threads_from(args)
    try:
        import verl  # verl: optional; its absence is the command's answer
    except ImportError as error:
        print(f"{PROG}: needs verl in this environment: {error} (docs/verl.md)", file=sys.stderr)
        return 1
    # torch: the rollout path imports this module without it
    import torch

    from agent_loop.integrations.verl_comparison import run_checks  # torch, as above

    torch.set_num_threads(threads or 1)  # small batches: one thread is fastest and deterministic
    rows = run_checks(range(SEEDS))
    failed = sum(row.status == "FAIL" for row in rows)
    expected = sum(row.status == "expected" for row in rows)
    print_table(rows, f"agent-loop advantages vs verl {verl.__version__}: max |ours - verl| over {SEEDS} random "
                      f"multi-turn batches (int64 rows: relative to max |verl|)")
    print(f"{len(rows) - failed - expected} ok, {expected} expected (documented in docs/verl.md), {failed} failed")
    return 1 if failed else 0


def print_table(rows, title: str) -> None:
    """The rows of ``run_checks`` as a rich table: status, max difference, tolerance, check, note."""
    table = Table(title=title)
    for column in ("status", "max diff", "tolerance", "check", "note"):  # names whole; the note wraps at words
        table.add_column(column, no_wrap=column != "note")
    styles = {"ok": "green", "expected": "yellow", "FAIL": "bold red"}
    for row in rows:
        table.add_row(f"[{styles[row.status]}]{row.status}[/]", f"{row.worst:.2e}", f"{row.tolerance:.0e}",
                      f"{row.section}: {row.name}", row.note)
    Console(width=200).print(table)
