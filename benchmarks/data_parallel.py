"""1 vs 2 data-parallel processes (agent_loop/training/distributed.py) on the tiny agent: step time, episodes/s, learning curve.

    python benchmarks/data_parallel.py                    # 10 steps of 32 episodes per configuration
    python benchmarks/data_parallel.py --steps 30 --out dp.md

Runs ``agent-loop train`` four times on the same seeds: one process with 1 thread, one process with
2 threads (the same cores as two processes), and ``--nproc 2`` with 1 thread each (gloo), wrapped in
``DistributedDataParallel`` and in FSDP2 (``--parallel ddp`` / ``fsdp``). Prints the
median step time (steps after the first), episodes/s and the ratio to the 1-process/1-thread run,
then the success rate of every step of each run side by side (the runs play the same episodes while
their weights agree; see tests/training/test_distributed.py for the exact check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--out", type=Path, help="also write the tables as markdown here")
    return parser.parse_args()


def run(name: str, nproc: int, threads: int, parallel: str, args, scratch: Path) -> list[dict]:
    out = scratch / name
    command = [sys.executable, "-m", "agent_loop.cli", "train", "--steps", str(args.steps), "--prompts-per-step",
               str(args.prompts_per_step), "--concurrency", str(args.prompts_per_step), "--threads", str(threads),
               "--nproc", str(nproc), "--parallel", parallel, "--device", "cpu", "--save-every", str(10**6), "--no-progress",
               "--output-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    subprocess.run(command, env=env, cwd=ROOT, check=True, capture_output=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    args = parse_args()
    console = Console(record=True, width=120)
    configs = (("1 process, 1 thread", 1, 1, "ddp"), ("1 process, 2 threads", 1, 2, "ddp"),
               ("2 processes DDP, 1 thread each", 2, 1, "ddp"), ("2 processes FSDP2, 1 thread each", 2, 1, "fsdp"))
    with tempfile.TemporaryDirectory(prefix="dp-bench-") as scratch:
        runs = {name: run(f"run{i}", nproc, threads, parallel, args, Path(scratch))
                for i, (name, nproc, threads, parallel) in enumerate(configs)}

    speed = Table(title=f"data-parallel training, tiny agent, {args.prompts_per_step} episodes/step, "
                        f"median of steps 2-{args.steps}")
    for column in ("configuration", "step s", "rollout s", "train s", "episodes/s", "vs 1 process, 1 thread"):
        speed.add_column(column, justify="right")
    baseline = None
    for name, history in runs.items():
        steady = history[1:] or history
        step = statistics.median(m["time/step_s"] for m in steady)
        baseline = baseline or step
        speed.add_row(name, f"{step:.2f}", f"{statistics.median(m['time/rollout_s'] for m in steady):.2f}",
                      f"{statistics.median(m['time/train_s'] for m in steady):.2f}",
                      f"{args.prompts_per_step / step:.1f}", f"{baseline / step:.2f}x")
    console.print(speed)

    curve = Table(title="success rate per step (same seeds)")
    curve.add_column("step", justify="right")
    for name in runs:
        curve.add_column(name, justify="right")
    for index in range(args.steps):
        curve.add_row(str(index + 1), *(f"{history[index]['success']:.3f}" for history in runs.values()))
    console.print(curve)
    if args.out:
        args.out.write_text(console.export_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
