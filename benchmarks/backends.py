"""Rollout throughput of each backend on the tiny agent: episodes/s and assistant tokens/s at several concurrencies.

One run, backends one after the other (never two engines at once): transformers (the baseline),
vLLM in-process, and a vLLM OpenAI-compatible server on 127.0.0.1 driven over HTTP. Each backend
plays a short warm-up first. Ratios are against transformers at the same concurrency.

    python benchmarks/backends.py [--concurrency 1 16 64] [--episodes 64] [--backends transformers vllm http]

A realistic shape: ``--random-model qwen2.5-0.5b`` builds (once, cached) a random-weight model with
Qwen2.5-0.5B's architecture and the real Qwen2.5 tokenizer (``agent_loop.model_folders.build_random_model``);
its turns rarely sample a stop token, so each episode is one turn of ``--max-tokens`` tokens.

    python benchmarks/backends.py --random-model qwen2.5-0.5b --episodes 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import agent_loop.files as files
from agent_loop.backends.hf import TransformersBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.model_folders import ARCHITECTURES, build_random_model
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.registry import get_task
from agent_loop.tiny import tiny_agent_path
from agent_loop.tiny.build import build_lock
from masking.cache import cache_root

BACKENDS = ("transformers", "vllm", "http")


async def measure(task, backend, tokenizer, episodes: int, concurrency: int, config: LoopConfig) -> dict:
    """Play `episodes` episodes with `concurrency` in flight; wall time, episodes/s, assistant tokens/s."""
    started = time.perf_counter()
    trajectories = await run_rollouts(task, backend, tokenizer, range(episodes), config, seed=0,
                                      concurrency=concurrency, progress=False)
    seconds = time.perf_counter() - started
    failed = [t for t in trajectories if t.finish_reason == "error"]
    if failed:  # a dead engine "finishes" episodes fast: never report that as throughput
        raise RuntimeError(f"{len(failed)} episodes ended in a backend error: {failed[0].metrics['backend_error']}")
    assistant_tokens = sum(t.metrics["assistant_tokens"] for t in trajectories)
    return {
        "seconds": seconds,
        "episodes_per_s": episodes / seconds,
        "tokens_per_s": assistant_tokens / seconds,
        "success": sum(t.reward > 0 for t in trajectories) / episodes,
    }


def prefill_logits_gib(task, tokenizer, concurrency: int) -> float:
    """Memory of the transformers backend's first forward: it keeps logits for every prompt position
    (``concurrency x prompt tokens x vocab`` floats), 15 GiB for Qwen2.5's vocabulary at concurrency 64."""
    from agent_loop.episode.loop import formatter_for as _formatter
    from agent_loop.episode.tools import ToolExecutor

    episode = task.make_episode(0)
    prompt = _formatter(tokenizer, ToolExecutor(episode.tools).schemas).prompt_ids(episode.messages)
    return concurrency * len(prompt) * len(tokenizer) * 4 / 2**30


async def sweep(task, backend, tokenizer, args, config) -> dict[int, dict]:
    await measure(task, backend, tokenizer, 4, 4, config)  # warm-up: first requests allocate and cache
    results = {}
    for c in args.concurrency:
        if isinstance(backend, TransformersBackend) and (gib := prefill_logits_gib(task, tokenizer, c)) > args.max_logits_gib:
            print(f"  concurrency {c}: skipped, its prefill would hold {gib:.1f} GiB of logits "
                  f"(> --max-logits-gib {args.max_logits_gib:g})", flush=True)
            continue
        results[c] = await measure(task, backend, tokenizer, max(args.episodes, c), c, config)
        print(f"  concurrency {c}: {results[c]['episodes_per_s']:.2f} episodes/s, {results[c]['tokens_per_s']:.0f} "
              f"assistant tok/s ({results[c]['seconds']:.1f} s)", flush=True)  # partial results survive a timeout
    return results


def run_backend(name: str, model_path: Path, task, tokenizer, args, config) -> dict[int, dict]:
    if name == "transformers":
        return asyncio.run(sweep(task, TransformersBackend(str(model_path), max_batch_size=max(args.concurrency)),
                                 tokenizer, args, config))
    if name == "vllm":
        from agent_loop.backends.vllm_engine import VLLMEngineBackend

        with VLLMEngineBackend(str(model_path), seed=0) as engine:
            return asyncio.run(sweep(task, engine, tokenizer, args, config))
    from agent_loop.backends.openai_http import OpenAIHTTPBackend
    from agent_loop.backends.vllm_server import local_vllm_server

    async def over_http(url):
        async with OpenAIHTTPBackend([url], "tiny-agent") as backend:
            return await sweep(task, backend, tokenizer, args, config)

    with local_vllm_server(model_path, "tiny-agent", log_path=Path(tempfile.gettempdir()) / "bench-vllm-server.log") as url:
        return asyncio.run(over_http(url))


def random_model(arch: str) -> Path:
    """A random-weight ``arch`` model with the real Qwen2.5 tokenizer (tests/data), built once into the cache
    (under the build lock, written whole: ``agent_loop.files``)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers
    from tests.helpers.testdata import qwen_tokenizer_dir

    target = cache_root() / f"bench-random-{arch}"
    if not (target / "config.json").is_file():
        tokenizer = qwen_tokenizer_dir()
        with build_lock(target):
            if not (target / "config.json").is_file():  # another process may have built it meanwhile
                files.write_folder(target, lambda scratch: build_random_model(scratch, arch, tokenizer))
    return target


def print_table(results: dict[str, dict[int, dict]], concurrency: list[int]) -> None:
    print("| backend | concurrency | episodes/s | assistant tok/s | vs transformers | success |")
    print("|---|---|---|---|---|---|")
    baseline = results.get("transformers", {})
    for name, by_level in results.items():
        for c in concurrency:
            r = by_level.get(c)
            if r is None:
                print(f"| {name} | {c} | skipped (memory) | | | |")
                continue
            ratio = f"{r['episodes_per_s'] / baseline[c]['episodes_per_s']:.2f}x" if baseline.get(c) else "-"
            print(f"| {name} | {c} | {r['episodes_per_s']:.2f} | {r['tokens_per_s']:.0f} | {ratio} | {r['success']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the tiny agent)")
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--episodes", type=int, default=64, help="episodes per level (at least the concurrency)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the transformers backend")
    parser.add_argument("--random-model", default=None, choices=sorted(ARCHITECTURES),
                        help="benchmark a random-weight model of this shape (agent_loop.model_folders.ARCHITECTURES)")
    parser.add_argument("--max-logits-gib", type=float, default=4.0,
                        help="skip transformers levels whose prefill logits would need more memory")
    parser.add_argument("--max-tokens", type=int, default=LoopConfig.max_tokens, help="per assistant turn")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model_path = args.model or (random_model(args.random_model) if args.random_model else tiny_agent_path())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    task = get_task(args.task)
    config = LoopConfig(temperature=1.0, max_tokens=args.max_tokens)
    results = {}
    for name in args.backends:
        print(f"{name}:", flush=True)
        results[name] = run_backend(name, model_path, task, tokenizer, args, config)
        print(f"{name}: done", flush=True)
    print(f"\nmodel {model_path}, task {args.task}, temperature 1.0, max_tokens {args.max_tokens}, "
          f"{torch.get_num_threads()} torch threads\n")
    print_table(results, args.concurrency)


if __name__ == "__main__":  # vLLM starts worker processes
    main()
