"""A warm start on your own tools, then RL: docs/bring_your_own.md's three steps on examples/custom_task.py, over seeds (issue 29).

    python examples/warmstart_custom_task.py                    # 3 seeds: the table in BENCHMARKS.md
    python examples/warmstart_custom_task.py --seeds 0          # one

For each seed S, exactly docs/bring_your_own.md's commands (run in this process, each in its own output folder):

1. ``agent-loop warmstart --task examples/custom_task.py:Reverse --seed S`` (the built-in tiny agent, 600 steps on 256
   demonstrations);
2. ``agent-loop rollout --task ... --model WARM/model --seed 100+S --episodes 256``: sampled success (T = 1.0) on
   the first 64 episodes (issue 29's measure) and on all 256 (a paired check of the noise of 64);
3. ``agent-loop train --task ... --model WARM/model --seed S --steps 20 --lr 5e-5``, then the same episodes (same
   questions, same sampling seeds: paired) with its last checkpoint (``--rl-lr`` sets the learning rate; ``default``:
   train's own, 2e-4 at 64 prompts per step).

The tiny agent itself on the same episodes is the baseline. Prints a Markdown table (and writes it to
``OUT/warmstart_custom_task.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from agent_loop.cli import main
from agent_loop.runners.local import read_trajectories
from agent_loop.tiny import RECIPE_VERSION

TASK = "examples/custom_task.py:Reverse"
EPISODES, CHECK_EPISODES, TRAIN_STEPS, RL_LR = 64, 256, 20, "5e-5"  # episode i is the same in both: the first 64 of the 256


def command(*argv: str) -> float:
    """``agent-loop ARGV`` in this process; its seconds (a non-zero exit stops the benchmark)."""
    started = time.perf_counter()
    code = main(list(argv))
    if code not in (0, None):
        raise SystemExit(f"agent-loop {' '.join(argv)} exited with {code}")
    return time.perf_counter() - started


def success(*argv: str, out: Path) -> tuple[float, float]:
    """Sampled success of ``agent-loop rollout ARGV`` (written to ``out``) on its first EPISODES and on all
    CHECK_EPISODES episodes."""
    command("rollout", "--task", TASK, "--episodes", str(CHECK_EPISODES), "--out", str(out), *argv)
    episodes = sorted(read_trajectories(out), key=lambda t: t.info["index"])
    return (sum(t.success for t in episodes[:EPISODES]) / EPISODES,
            sum(t.success for t in episodes) / len(episodes))


def one_seed(seed: int, root: Path, rl_lr: str) -> dict:
    warm, train, evaluation = root / f"seed{seed}" / "warm", root / f"seed{seed}" / "train", ("--seed", str(100 + seed))
    baseline, _ = success(*evaluation, out=root / f"seed{seed}" / "tiny.jsonl")
    warm_s = command("warmstart", "--task", TASK, "--seed", str(seed), "--output-dir", str(warm), "--no-progress")
    losses = [json.loads(line)["loss"] for line in (warm / "metrics.jsonl").read_text().splitlines()]
    warmed, warm_check = success(*evaluation, "--model", str(warm / "model"), out=root / f"seed{seed}" / "warm.jsonl")
    lr = [] if rl_lr == "default" else ["--lr", rl_lr]
    train_s = command("train", "--task", TASK, "--model", str(warm / "model"), "--seed", str(seed), "--steps",
                      str(TRAIN_STEPS), *lr, "--output-dir", str(train), "--no-progress", "--no-tensorboard")
    steps = [json.loads(line)["success"] for line in (train / "metrics.jsonl").read_text().splitlines()]
    trained, trained_check = success(*evaluation, "--model", str(train / "checkpoints" / f"step_{TRAIN_STEPS:06d}" / "model"),
                                     out=root / f"seed{seed}" / "trained.jsonl")
    row = {"seed": seed, "baseline": baseline, "warm": warmed, "trained": trained, "warm_check": warm_check,
           "trained_check": trained_check, "loss_first": losses[0],
           "loss_last": statistics.fmean(losses[-10:]), "warm_s": warm_s, "train_s": train_s,
           "train_first": statistics.fmean(steps[:5]), "train_last": statistics.fmean(steps[-5:])}
    print(f"seed {seed}: tiny agent {baseline:.3f}, warm start {warmed:.3f}, after {TRAIN_STEPS} RL steps {trained:.3f}",
          flush=True)
    return row


def table(rows: list[dict], rl_lr: str) -> str:
    lines = [f"Sampled success (T = 1.0) on {EPISODES} episodes of `{TASK}` (the same episodes before and after RL), tiny "
             f"agent recipe {RECIPE_VERSION}, RL learning rate {rl_lr}:", "",
             "| seed | tiny agent | after warm start | after 20 RL steps | the same on 256 episodes: warm start -> RL "
             "| warm-start loss (first -> mean of last 10 steps) | RL training success (first 5 -> last 5 steps) "
             "| warm start | RL |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['baseline']:.3f} | {r['warm']:.3f} | {r['trained']:.3f} | "
                     f"{r['warm_check']:.3f} -> {r['trained_check']:.3f} | "
                     f"{r['loss_first']:.2f} -> {r['loss_last']:.3f} | {r['train_first']:.3f} -> {r['train_last']:.3f} "
                     f"| {r['warm_s']:.0f} s | {r['train_s']:.0f} s |")
    mean = {k: statistics.fmean(r[k] for r in rows) for k in ("baseline", "warm", "trained", "warm_check", "trained_check")}
    lines.append(f"| mean | {mean['baseline']:.3f} | {mean['warm']:.3f} | {mean['trained']:.3f} | "
                 f"{mean['warm_check']:.3f} -> {mean['trained_check']:.3f} | | | | |")
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/warmstart-bench", help="output folder (one subfolder per seed)")
    parser.add_argument("--rl-lr", default=RL_LR, help="agent-loop train's --lr, or 'default' for its own")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse()
    root = Path(args.out)
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} holds an earlier run; give another --out")
    started = time.perf_counter()
    result = table([one_seed(seed, root, args.rl_lr) for seed in args.seeds], args.rl_lr)
    print(f"\n{result}\n\n{len(args.seeds)} seeds in {time.perf_counter() - started:.0f} s")
    (root / "warmstart_custom_task.md").write_text(result + "\n")
