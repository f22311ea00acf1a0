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

The transformers backend before and after continuous batching and kept caches (issue 48 item 4), in one run:

    nice -n 5 .venv/bin/python benchmarks/real_model_rollout.py --backends hf-static hf --threads 2

``hf-static`` is the old static batches (tests/helpers/static_hf.py). With both, they share one loaded model and
play each level in turns (static, then continuous), so that a change of machine load hits both alike; a second
table gives continuous / static tokens/s and the share of prompt tokens taken from kept caches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from backends import measure, print_table, sweep  # noqa: E402  (benchmarks/backends.py)
from train_memory import resolve_model  # noqa: E402

from agent_loop.episode.loop_config import LoopConfig  # noqa: E402
from agent_loop.tasks.registry import get_task  # noqa: E402

BACKENDS = ("hf", "vllm", "http", "hf-static")


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
    if name in ("hf", "hf-static"):
        from agent_loop.backends.hf import TransformersBackend
        from tests.helpers.static_hf import StaticBatchBackend

        backend = (TransformersBackend if name == "hf" else StaticBatchBackend)(model, max_batch_size=max(args.concurrency))
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


def transformers_before_after(model: str, task, tokenizer, args, config) -> dict[str, dict[int, dict]]:
    """``hf-static`` (the old static batches) and ``hf`` (continuous batching, kept caches) over one loaded model,
    each level played by both in turns after one warm-up each. ``hf``'s rows also get ``reused``: the share of
    prompt tokens taken from kept caches."""
    from transformers import AutoModelForCausalLM

    from agent_loop.backends.hf import TransformersBackend
    from tests.helpers.static_hf import StaticBatchBackend

    weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    size = max(args.concurrency)
    backends = {"hf-static": StaticBatchBackend(weights, max_batch_size=size),
                "hf": TransformersBackend(weights, max_batch_size=size)}
    for backend in backends.values():
        asyncio.run(measure(task, backend, tokenizer, 4, 4, config))  # warm-up
    results: dict[str, dict[int, dict]] = {name: {} for name in backends}
    for c in args.concurrency:
        for name, backend in backends.items():
            before = dict(backend.stats)
            r = results[name][c] = asyncio.run(measure(task, backend, tokenizer, max(args.episodes, c), c, config))
            if name == "hf":
                delta = {key: backend.stats[key] - before[key] for key in before}
                r["reused"] = delta["reused_tokens"] / max(1, delta["reused_tokens"] + delta["prefilled_tokens"])
            print(f"  {name} concurrency {c}: {r['tokens_per_s']:.1f} assistant tok/s ({r['seconds']:.1f} s), "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    return results


def print_before_after(results: dict[str, dict[int, dict]], concurrency: list[int]) -> None:
    print("| concurrency | static batches tok/s | continuous + kept caches tok/s | continuous / static | "
          "prompt tokens from kept caches |")
    print("|---|---|---|---|---|")
    for c in concurrency:
        old, new = results["hf-static"][c], results["hf"][c]
        print(f"| {c} | {old['tokens_per_s']:.1f} | {new['tokens_per_s']:.1f} | "
              f"{new['tokens_per_s'] / old['tokens_per_s']:.2f}x | {new['reused']:.0%} |")


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
    pair = {"hf", "hf-static"} <= set(args.backends)
    load_before = os.getloadavg()
    if pair:
        print("hf-static and hf, level by level:", flush=True)
        results.update(transformers_before_after(model, task, tokenizer, args, config))
    for name in args.backends:
        if pair and name in results:
            continue
        print(f"{name}:", flush=True)
        try:
            results[name] = run_backend(name, model, task, tokenizer, args, config)
        except Exception as error:  # one backend that cannot run here must not lose the others' numbers
            failed.append(f"{name}: failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}")
            print(failed[-1], flush=True)
    print(f"\nmodel {label} ({model}), task {args.task}, temperature 1.0, max_tokens {args.max_tokens}, "
          f"{args.threads} thread(s), load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    names = {"hf": "transformers", "hf-static": "transformers (static batches)"}
    print_table({names.get(name, name): r for name, r in results.items()}, args.concurrency)
    if pair:
        print()
        print_before_after(results, args.concurrency)
    print("\n".join(failed))


if __name__ == "__main__":  # vLLM starts worker processes
    main()
