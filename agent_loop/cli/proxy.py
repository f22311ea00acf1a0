"""``agent-loop proxy``: serve a model to someone else's agent through an OpenAI-compatible API and record every
call token-in/token-out; each finished session is written to ``--out`` as Trajectories (one whole line per
segment), which ``agent-loop inspect`` opens and ``train`` reads (docs/agents.md).

In front of any backend: the tiny agent or a model folder in process (``--backend hf``), the vLLM engine
(``vllm``), or upstream OpenAI-compatible servers with failover (``http --server URL ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path

import agent_loop.cli.preflight as preflight
from agent_loop.backends.base import BackendSettings
from agent_loop.backends.registry import BACKENDS, make_backend
from agent_loop.backends.server_options import ServerOptions
from agent_loop.builtin_models import model_option_help
from agent_loop.cli.flags import (
    UsageError,
    add_common_options,
    add_options,
    given,
    int_at_least,
    number_in,
    threads_from,
    validate,
)
from agent_loop.model_folders import model_path
from agent_loop.proxy.core import Proxy, ProxySettings
from agent_loop.proxy.server import ProxyServer
from agent_loop.runners.jsonl import JsonlWriter, OutputExistsError
from agent_loop.runners.outputs import fresh_path
from agent_loop.threads import apply_threads

PROG = "agent-loop proxy"
DESCRIPTION = "an OpenAI-compatible server for your own agent that records every call as a Trajectory"
DEFAULT_OUT = "runs/sessions.jsonl"
SERVER_FIELDS = {field.name for field in dataclasses.fields(ServerOptions)}


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("proxy", help=f"{DESCRIPTION} (--help)", description=DESCRIPTION)
    parser.add_argument("--model", default=None, help=model_option_help())
    parser.add_argument("--backend", choices=list(BACKENDS), default="hf", help="who generates (default hf)")
    add_options(parser, ServerOptions, config_file=False)  # --backend http: the upstream servers, declared once
    parser.add_argument("--model-name", default="policy", help="the model name clients ask for (default policy)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int_at_least(0), default=8100, help="port (default 8100; 0: a free one)")
    parser.add_argument("--out", default=None, help=f"JSON Lines file of finished sessions (default {DEFAULT_OUT}, "
                        "or the first free -N name)")
    parser.add_argument("--append", action="store_true", help="add to an existing --out")
    parser.add_argument("--api-key", default=os.environ.get("AGENT_LOOP_PROXY_API_KEY"),
                        help="require Authorization: Bearer KEY (default: $AGENT_LOOP_PROXY_API_KEY; unset: none)")
    parser.add_argument("--one-request-sessions", action="store_true",
                        help="a call without a session id is a session of its own (default: refused)")
    parser.add_argument("--idle-timeout-s", type=number_in(gt=0), default=600.0,
                        help="close (and write) a session idle this long (default 600)")
    parser.add_argument("--max-sessions", type=int_at_least(1), default=1024, help="open sessions at most")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=256, help="per call, when a request gives none")
    parser.add_argument("--temperature", type=float, default=1.0, help="when a request gives none (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    add_common_options(parser)
    parser.set_defaults(run=run, prog=PROG)
    return parser


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The upstream servers' options given (``--server`` ...), validated as every command's (UsageError)."""
    return validate(ServerOptions, {name: value for name, value in given(args).items() if name in SERVER_FIELDS})


def run(args: argparse.Namespace) -> int:
    apply_threads(threads_from(args))
    args.servers = server_options(args)
    if args.backend == "http" and not args.servers.server:
        raise UsageError("--backend http needs at least one --server URL")
    if args.model is not None:
        preflight.check_model_dir(args.model, args.backend)
    out = args.out or (DEFAULT_OUT if args.append else fresh_path(DEFAULT_OUT))
    preflight.check_output_file(out)
    try:
        writer = JsonlWriter(out, "append" if args.append else "new")
    except (OSError, OutputExistsError) as error:
        raise UsageError(f"--out {out}: {error}") from None
    args.stop_note = lambda: f"finished sessions are in {out} (open sessions were written as closed_by shutdown)"
    try:
        return asyncio.run(_serve(args, model_path(args.model), writer))
    finally:
        writer.close()


async def _serve(args: argparse.Namespace, path: str, writer) -> int:
    from transformers import AutoTokenizer  # torch: the rollout path imports this module without it

    tokenizer = AutoTokenizer.from_pretrained(path)
    backend = make_backend(args.backend, path, BackendSettings.from_options(args.servers))
    settings = ProxySettings(model_name=args.model_name, max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed, idle_timeout_s=args.idle_timeout_s, max_sessions=args.max_sessions,
                             one_request_sessions=args.one_request_sessions)
    proxy = Proxy(backend, tokenizer, settings, on_finish=lambda ts: [writer.write_line(t.to_json()) for t in ts])
    server = ProxyServer(proxy, host=args.host, port=args.port, api_key=args.api_key)
    try:
        await server.start()
    except OSError as error:
        backend.close()
        raise UsageError(f"--port {args.port}: cannot listen on {args.host}: {error.strerror or error}") from None
    print(f"serving {args.model_name!r} ({Path(path).name}) at {server.base_url} for agents; finished sessions go to "
          f"{writer.path} (Ctrl-C stops)", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
        await backend.end_run()
        backend.close()
        counts = dict(proxy.counts)
        print(f"{PROG}: {counts.get('opened', 0)} sessions, closed: "
              + ", ".join(f"{k[7:]} {v}" for k, v in sorted(counts.items()) if k.startswith("closed_")), file=sys.stderr)
    return 0
