"""A whole training step (rollout + update + weight push) with the old default rollout backend (transformers in
process) against the new one (``--backend auto``: the vLLM engine in process for a real model), in one run
(issue 48 item 3).

    .venv/bin/python benchmarks/train_step_backend.py --model smollm2-135m
    .venv/bin/python benchmarks/train_step_backend.py --model smollm2-135m --steps 3 --prompts-per-step 8
    .venv/bin/python benchmarks/train_step_backend.py --model tiny --backends hf vllm --lora-rank 8

``--lora-rank R``: LoRA runs (issue 57 item 3): transformers gets the merged weights, the vLLM engine the adapter
alone (agent_loop/training/transports/engine_lora.py).

Each backend runs ``agent-loop train`` as a user would (a fresh process, its own output folder), one after the other;
the table gives the median over the steps after the first (the first pays for warm-up) of ``time/rollout_s``,
``time/train_s``, ``time/weight_sync_s`` and ``time/step_s`` from metrics.jsonl, the process's wall time (with
model load and engine start), and the ratio of step times against transformers. Synchronous runs push the weights
between runs (agent_loop/training/transports: at the next rollout's start), so ``time/rollout_s`` holds the push (for vLLM: the
weights saved as safetensors, ``reload_weights``, a prefix-cache reset) and ``time/weight_sync_s`` is ~0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("time/rollout_s", "time/train_s", "time/weight_sync_s", "time/step_s")


def run(backend: str, args, folder: Path) -> dict:
    command = [sys.executable, "-m", "agent_loop.cli", "train", "--model", args.model, "--task", args.task,
               "--backend", backend, "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
               "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens), "--max-turns",
               str(args.max_turns), "--threads", str(args.threads), "--mini-batches", "1", "--no-progress",
               "--no-tensorboard", "--output-dir", str(folder / backend)]
    if args.lora_rank:
        command += ["--lora-rank", str(args.lora_rank)]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"train --backend {backend} failed:\n{done.stderr[-3000:]}")
    steps = [json.loads(line) for line in (folder / backend / "metrics.jsonl").read_text().splitlines()]
    measured = steps[1:] or steps
    row = {field: statistics.median(step.get(field, 0.0) for step in measured) for field in FIELDS}
    notes = [line for line in done.stderr.splitlines() if line.startswith("agent-loop train: backend")]
    print(f"  {backend}: step {row['time/step_s']:.1f} s (rollout {row['time/rollout_s']:.1f}, train "
          f"{row['time/train_s']:.1f}, weight push {row['time/weight_sync_s']:.2f}); process {wall:.0f} s; load "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}; {' '.join(notes)}", flush=True)
    return {**row, "wall": wall, "load": (load, os.getloadavg()[0]), "notes": notes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--backends", nargs="+", default=["hf", "auto"], help="hf: the old default; auto: the new")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA runs of this rank (0: whole weights)")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="train-step-backend-") as folder:
        for backend in args.backends:
            rows[backend] = run(backend, args, Path(folder))
    base = rows.get("hf")
    print(f"\nmodel {args.model}, task {args.task}, {args.prompts_per_step} x {args.group_size} episodes per step, "
          f"max_tokens {args.max_tokens}, max_turns {args.max_turns}, {args.threads} threads, LoRA rank "
          f"{args.lora_rank or '-'}; medians of steps "
          f"2-{args.steps}\n")
    print("| backend | rollout s | train s | weight push s | step s | step vs hf | process s | load start/end |")
    print("|---|---|---|---|---|---|---|---|")
    for backend, r in rows.items():
        ratio = f"{base['time/step_s'] / r['time/step_s']:.2f}x faster" if base else "-"
        print(f"| {backend} | {r['time/rollout_s']:.1f} | {r['time/train_s']:.1f} | {r['time/weight_sync_s']:.2f} | "
              f"{r['time/step_s']:.1f} | {ratio} | {r['wall']:.0f} | {r['load'][0]:.1f} / {r['load'][1]:.1f} |")


if __name__ == "__main__":
    main()
