"""Seconds to push new policy weights into each rollout backend (the trainer's push after every step).

    python benchmarks/weight_sync.py                 # the tiny agent (1.1 M parameters)
    python benchmarks/weight_sync.py --reps 3 --out weight_sync.md
    python benchmarks/weight_sync.py --backends server,lora   # LoRA: merged weights vs the adapter alone

Backends: the in-process transformers backend (``load_state_dict``); the in-process vLLM engine in
place (``VLLMEngineBackend.update_weights``:
``collective_rpc("reload_weights")``; it restarted the engine before, about 54 s here); a vLLM OpenAI server on 127.0.0.1 in place
(``VLLMServerWeightSync``: ``/collective_rpc`` reload, prefix-cache reset, weight version check).
For a LoRA policy (rank ``--lora-rank`` on every linear layer): its merged weights pushed in place
(merge + the server push above), against its adapter alone (``VLLMServerLoRASync``:
``save_pretrained`` + ``/v1/load_lora_adapter`` under a new name + unloading the previous one) on a
server started with ``--enable-lora``. Each in-place push is checked: after it, the backend's greedy tokens for a fixed prompt equal the
transformers model's with the pushed weights. Median of ``--reps`` pushes of perturbed weights.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_loop.backends.base import SamplingParams  # noqa: E402
from agent_loop.backends.hf import TransformersBackend  # noqa: E402


def perturbed(model, seed: int):
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=generator) * p.std() * 0.1)
    return other


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=())


def greedy(backend, prompt) -> list[int]:
    async def go():
        return (await backend.generate(prompt, GREEDY)).token_ids
    return asyncio.run(go())


def lora_policy(model_dir: str, rank: int, seed: int):
    """The model with a rank-``rank`` LoRA adapter on every linear layer, B in seeded noise (not a no-op)."""
    from transformers import AutoModelForCausalLM

    from agent_loop.training.lora import wrap_with_lora

    policy = wrap_with_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), rank, 2.0 * rank,
                            "all-linear")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return policy.eval()


async def http_greedy(url, prompt, model: str = "policy") -> list[int]:
    from agent_loop.backends.openai_http import OpenAIHTTPBackend

    async with OpenAIHTTPBackend([url], model) as backend:
        return (await backend.generate(prompt, GREEDY)).token_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--backends", default="hf,engine,server,lora",
                        help="comma-separated: hf, engine, server (with the LoRA merged push), lora")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    backends = set(args.backends.split(","))
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from agent_loop.tiny import tiny_agent_path

    model_dir = str(tiny_agent_path(stage="final"))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    versions = [perturbed(base, seed) for seed in range(args.reps)]
    prompt = list(range(100, 140))
    rows = []

    def record(name, seconds, agree):
        rows.append((name, statistics.median(seconds), min(seconds), agree))

    if "hf" in backends:
        hf = TransformersBackend(copy.deepcopy(base))
        seconds = []
        for model in versions:
            started = time.perf_counter()
            hf.update_weights(model.state_dict())
            seconds.append(time.perf_counter() - started)
        record("transformers (in process)", seconds, "exact (same weights)")

    from agent_loop.training.transports.vllm_servers import VLLMServerLoRASync, VLLMServerWeightSync

    if "engine" in backends:
        from agent_loop.backends.vllm_engine import VLLMEngineBackend

        with VLLMEngineBackend(model_dir, seed=0) as engine:
            seconds, agree = [], True
            for model in versions:
                started = time.perf_counter()
                engine.update_weights(model.state_dict())
                seconds.append(time.perf_counter() - started)
                agree &= greedy(engine, prompt) == greedy(TransformersBackend(model), prompt)
            record("vLLM engine, in place (reload_weights)", seconds, "yes" if agree else "NO")

    from agent_loop.backends.vllm_server import local_vllm_server
    from agent_loop.training.lora import merged_state_dict, plain_copy

    policies = [lora_policy(model_dir, args.lora_rank, seed) for seed in range(args.reps)]
    if "server" in backends:
        with local_vllm_server(model_dir, "policy", weight_pushes=True) as url:
            sync = VLLMServerWeightSync(url)
            seconds, agree = [], True
            for model in versions:
                seconds.append(sync.update_weights(model.state_dict()))
                agree &= asyncio.run(http_greedy(url, prompt)) == greedy(TransformersBackend(model), prompt)
            record("vLLM server over HTTP, in place", seconds, "yes" if agree else "NO")
            seconds, agree = [], True
            for policy in policies:
                started = time.perf_counter()
                sync.update_weights(merged_state_dict(policy))
                seconds.append(time.perf_counter() - started)
                agree &= asyncio.run(http_greedy(url, prompt)) == greedy(TransformersBackend(plain_copy(policy)), prompt)
            record(f"vLLM server, LoRA r={args.lora_rank} merged weights in place (merge + push)", seconds,
                   "yes" if agree else "NO")
            sync.close()

    if "lora" in backends:
        with local_vllm_server(model_dir, "policy", lora_rank=max(args.lora_rank, 8)) as url:
            seconds, agree = [], True
            for policy in policies:
                sync = VLLMServerLoRASync(url, policy, name="policy-lora")
                seconds.append(sync.update_weights())
                agree &= asyncio.run(http_greedy(url, prompt, sync.served_model)) == greedy(
                    TransformersBackend(plain_copy(policy)), prompt)
                sync.close()
            record(f"vLLM server, LoRA r={args.lora_rank} adapter alone (load_lora_adapter)", seconds,
                   "yes" if agree else "NO")

    console = Console(record=True, width=140)
    parameters = sum(p.numel() for p in base.parameters())
    table = Table(title=f"weight push per step, tiny agent ({parameters / 1e6:.1f} M parameters, fp32), "
                        f"median of {args.reps}")
    for column in ("backend", "median s", "min s", "greedy tokens = transformers after push"):
        table.add_column(column)
    for name, median, fastest, agree in rows:
        table.add_row(name, f"{median:.3f}", f"{fastest:.3f}", agree)
    console.print(table)
    if args.out:
        args.out.write_text(console.export_text())
    return 0 if all(r[3] != "NO" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
