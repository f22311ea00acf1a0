"""Dynamic sampling (``train --filter-groups``) on the tiny agent: what it filters and what it costs, in one run.

    python benchmarks/filter_groups.py                      # 10 steps of each setting (about 3 min on 2 cores)
    python benchmarks/filter_groups.py --steps 20 --group-size 4 --prompts-per-step 8

The tiny agent's mid checkpoint on the arithmetic task, GRPO, ``--prompts-per-step`` questions x
``--group-size`` samples per step, three settings one after another in this process: no filtering,
``--filter-groups`` (synchronous rounds) and ``--filter-groups --max-staleness 1`` (the asynchronous producer).
Per setting, means over the steps: the share of groups filtered, extra rounds, groups kept (trained on), episodes
and ASSISTANT tokens played per step (the rollout cost), the steps whose bound was hit, the training success
(over every episode played) and the wall time per step. Not a learning comparison: a few steps, one seed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = {"off": {}, "filter (sync)": {"filter_groups": True},
            "filter (async K=1)": {"filter_groups": True, "max_staleness": 1}}


def run(setting: dict, args, out: Path) -> dict[str, float]:
    from agent_loop import TrainConfig, Trainer
    from agent_loop.tiny import tiny_agent_path

    config = TrainConfig.from_flat(model=str(tiny_agent_path(stage="mid")), steps=args.steps, estimator="grpo",
                                   group_size=args.group_size, prompts_per_step=args.prompts_per_step, mini_batches=1,
                                   concurrency=32, threads=1, output_dir=str(out), progress=False, tensorboard=False,
                                   save_every=1000, save_rollouts_every=0, seed=args.seed, **setting)
    started = time.perf_counter()
    history = Trainer(config).train()
    wall = time.perf_counter() - started
    played = [h["filter_groups/examined"] * args.group_size if "filter_groups/examined" in h
              else args.prompts_per_step * args.group_size for h in history]

    def mean(name: str, default: float = 0.0) -> float:
        return statistics.mean(h.get(name, default) for h in history)

    return {"share_filtered": mean("filter_groups/share_filtered"), "extra_rounds": mean("filter_groups/extra_rounds"),
            "kept": mean("filter_groups/kept", args.prompts_per_step), "episodes": statistics.mean(played),
            "tokens": statistics.mean(h["assistant_tokens"] * n for h, n in zip(history, played)),
            "bound_hit": sum(h.get("filter_groups/bound_hit", 0.0) for h in history),
            "success": mean("success"), "step_s": wall / len(history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"tiny agent (mid), arithmetic, grpo, {args.prompts_per_step} questions x {args.group_size} samples, "
          f"{args.steps} steps, seed {args.seed}\n")
    print("| setting | share filtered | extra rounds | groups kept | episodes played | ASSISTANT tokens played "
          "| bound hit (steps) | success (played) | s/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name, setting in SETTINGS.items():
            r = run(setting, args, Path(folder) / name.replace(" ", "_"))
            print(f"| {name} | {r['share_filtered']:.2f} | {r['extra_rounds']:.2f} | {r['kept']:.1f} | "
                  f"{r['episodes']:.1f} | {r['tokens']:.0f} | {r['bound_hit']:.0f} | {r['success']:.3f} | "
                  f"{r['step_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
