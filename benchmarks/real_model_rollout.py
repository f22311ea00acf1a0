"""Rollout speed of the real 135M model (SmolLM2-135M-Instruct, ``--model smollm2-135m``) per backend, in one run:
transformers in process (hf), vLLM in process, and vLLM over HTTP through ``agent-loop serve``, each at
concurrency 1, 8 and 32, on the built-in calculator task (arithmetic) with the model's tool template.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model_rollout.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model_rollout.py --model PATH --episodes 32 --backends hf vllm http

Backends run one after the other (never two engines at once); each plays a short warm-up first
(benchmarks/backends.py's ``sweep``, whose episodes/s and assistant tokens/s this reports; a level whose episodes
end in backend errors raises rather than report a dead engine's speed). The server is the command a user runs,
``agent-loop serve --model M --port P --threads N``, started here on 127.0.0.1 and stopped at the end.
Ratios are against hf at the same concurrency. Training cost is benchmarks/train_memory.py's (``--lora``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from backends import print_table, sweep  # noqa: E402  (benchmarks/backends.py)
from train_memory import resolve_model  # noqa: E402

from agent_loop.episode.config import LoopConfig  # noqa: E402
from agent_loop.tasks.registry import get_task  # noqa: E402

BACKENDS = ("hf", "vllm", "http")


@contextlib.contextmanager
def agent_loop_serve(model: str, threads: int, log_path: Path, startup_timeout_s: float = 600.0):
    """``agent-loop serve`` on 127.0.0.1 and a free port, in its own process group; yields its URL, stops it after."""
    from agent_loop.backends.vllm_server import free_port, stop_process_group, wait_healthy

    port = free_port()
    command = [sys.executable, "-m", "agent_loop.cli", "serve", "--model", model, "--port", str(port),
               "--threads", str(threads), "--", "--disable-log-stats", "--disable-uvicorn-access-log"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout_s=startup_timeout_s, name="agent-loop serve", log_path=log_path)
        yield url
    finally:
        stop_process_group(process)


def run_backend(name: str, model: str, task, tokenizer, args, config) -> dict[int, dict]:
    """One backend's sweep over ``args.concurrency``."""
    if name == "hf":
        from agent_loop.backends.hf import TransformersBackend

        backend = TransformersBackend(model, max_batch_size=max(args.concurrency))
        return asyncio.run(sweep(task, backend, tokenizer, args, config))
    if name == "vllm":
        from agent_loop.backends.vllm_engine import VLLMEngineBackend

        with VLLMEngineBackend(model, seed=0) as engine:
            return asyncio.run(sweep(task, engine, tokenizer, args, config))
    from agent_loop.backends.openai_http import OpenAIHTTPBackend

    async def over_http(url):
        async with OpenAIHTTPBackend([url], "policy") as backend:
            return await sweep(task, backend, tokenizer, args, config)

    with agent_loop_serve(model, args.threads, Path(tempfile.gettempdir()) / "real-model-serve.log") as url:
        return asyncio.run(over_http(url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a model folder or a built-in model name")
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--episodes", type=int, default=32, help="episodes per level (at least the concurrency)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (hf) and vLLM's CPU threads (serve)")
    parser.add_argument("--max-tokens", type=int, default=LoopConfig.max_tokens, help="per assistant turn")
    parser.add_argument("--max-logits-gib", type=float, default=4.0,
                        help="skip hf levels whose prefill logits would need more memory (benchmarks/backends.py)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    model, label = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    task = get_task(args.task)
    config = LoopConfig(temperature=1.0, max_tokens=args.max_tokens)
    results, failed = {}, []
    for name in args.backends:
        print(f"{name}:", flush=True)
        try:
            results[name] = run_backend(name, model, task, tokenizer, args, config)
        except Exception as error:  # one backend that cannot run here must not lose the others' numbers
            failed.append(f"{name}: failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}")
            print(failed[-1], flush=True)
    print(f"\nmodel {label} ({model}), task {args.task}, temperature 1.0, max_tokens {args.max_tokens}, "
          f"{args.threads} thread(s)\n")
    print_table({("transformers" if name == "hf" else name): r for name, r in results.items()}, args.concurrency)
    print("\n".join(failed))


if __name__ == "__main__":  # vLLM starts worker processes
    main()
