"""torch threads per process, measured: the same rollout (hf backend) and training-size forward/backward at
1 and 2 intra-op threads, with P copies of it running at once on the machine's cores (P = 1: the machine as
found; P = 2: two processes sharing it, as two commands or two helpers do). docs/platform.md's rule
(agent_loop.threads) is chosen from this table.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/threads.py [--model PATH] [--episodes 16] [--processes 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORK = r"""
import json, sys, time
import torch
threads, model, episodes = int(sys.argv[1]), sys.argv[2] or None, int(sys.argv[3])
torch.set_num_threads(threads)
torch.set_num_interop_threads(1)
import agent_loop
from agent_loop.model_folders import model_path
from transformers import AutoModelForCausalLM
started = time.perf_counter()
agent_loop.rollout("arithmetic", model=model, episodes=episodes, concurrency=8, progress=False)
rollout_s = time.perf_counter() - started
policy = AutoModelForCausalLM.from_pretrained(model_path(model))
ids = torch.randint(0, policy.config.vocab_size, (8, 256))
started = time.perf_counter()
for _ in range(3):
    policy(ids, labels=ids).loss.backward()
print(json.dumps({"rollout_s": rollout_s, "train_s": (time.perf_counter() - started) / 3}))
"""


def measure(threads: int, processes: int, model: str, episodes: int) -> dict:
    """The slowest of ``processes`` copies run at once (each at ``threads`` threads)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    runs = [subprocess.Popen([sys.executable, "-c", WORK, str(threads), model, str(episodes)], env=env,
                             stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    results = [json.loads(run.communicate()[0].strip().splitlines()[-1]) for run in runs]
    return {key: max(r[key] for r in results) for key in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model folder (default: the built-in tiny agent)")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at start, model {args.model or 'tiny agent'}")
    print("| processes | threads each | rollout s (slowest) | train fwd+bwd s (slowest) |")
    print("|---|---|---|---|")
    for processes in args.processes:
        for threads in (1, 2):
            started = time.perf_counter()
            row = measure(threads, processes, args.model, args.episodes)
            print(f"| {processes} | {threads} | {row['rollout_s']:.1f} | {row['train_s']:.2f} |  "
                  f"(load {os.getloadavg()[0]:.1f}, {time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
