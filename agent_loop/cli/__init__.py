"""``agent-loop COMMAND ...``: the application over the library (``rollout``, ``train``, ``warmstart``, ``inspect``, ``serve``, ``tiny``, ``models``, ``verl-check``).

One module per command, each with ``add_parser(commands)`` and ``run(args)``. Only this package parses
argv, reads config files, runs preflight checks or prints tables; a usage error is one line on stderr
naming the option, exit status 2; SIGINT and SIGTERM stop a command cleanly with one line saying what is
written and how to go on (``agent_loop.cli.stops``, docs/errors.md).
"""

from __future__ import annotations

import argparse
import sys

import agent_loop.cli.inspect as inspect_command
import agent_loop.cli.models as models_command
import agent_loop.cli.proxy as proxy_command
import agent_loop.cli.rollout as rollout_command
import agent_loop.cli.serve as serve_command
import agent_loop.cli.tiny as tiny_command
import agent_loop.cli.train as train_command
import agent_loop.cli.verl_check as verl_check_command
import agent_loop.cli.warmstart as warmstart_command
from agent_loop.cli.stops import run_command

COMMANDS = (rollout_command, inspect_command, train_command, warmstart_command, serve_command, tiny_command, proxy_command,
            models_command, verl_check_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent-loop", description="Multi-turn, tool-calling RL rollouts for "
                                     "language models, with the returns done right.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``agent-loop COMMAND ...``; returns the exit status (2: a usage error, 130/143: stopped by SIGINT/SIGTERM,
    each reported in one line)."""
    owns_process = argv is None  # the agent-loop entry point, not a call from Python
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # the command's own arguments (train --nproc relaunches itself with them)
    return run_command(args.prog, args, owns_process=owns_process)
