"""Does carry-through matter? The same training, same seeds, with three REINFORCE++ return variants.

    python examples/ablation_returns.py                         # 3 runs of the default training
    python examples/ablation_returns.py --steps 150 --gamma 0.95 --parallel 2 --threads 1

- ``carry_through``: the running return passes unchanged through OBSERVATION tokens (ours, verl
  after PR #7300);
- ``reset_at_observation``: the return restarts at every masked token (verl before PR #7300), so the
  outcome never reaches the tool call of the first turn;
- ``ignore_mask``: one discounted scan over every position, observation tokens included (they cost
  discount steps; with ``gamma = 1`` this equals carry-through on ASSISTANT tokens).

In the arithmetic task the outcome depends on the first turn: the calculator returns the value of the
expression the model wrote, and the answer is right only if that expression was. Writes
``<output-dir>/results.md`` (a table) and ``<output-dir>/learning_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from trainer import RETURN_VARIANTS, TrainConfig, Trainer  # noqa: E402


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    config = TrainConfig(
        model=args.model, prompts_per_step=args.prompts_per_step, lr=args.lr, returns_variant=variant, gamma=args.gamma, steps=args.steps, seed=args.seed, threads=args.threads,
        eval_every=args.eval_every, eval_episodes=args.eval_episodes,
        output_dir=str(Path(args.output_dir) / variant), save_every=args.steps, progress=False,
    )
    print(f"\n=== {variant} (gamma {args.gamma}, seed {args.seed}) ===", flush=True)
    started = time.perf_counter()
    trainer = Trainer(config)
    history = trainer.train()
    return {"variant": variant, "history": history, "evals": trainer.eval_history,
            "seconds": time.perf_counter() - started}


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]


def results_table(results: list[dict], window: int) -> str:
    header = ("| returns | sampled success, first {w} steps | sampled success, last {w} steps | "
              "greedy held-out success: start -> end | calculator returned the answer, first {w} -> last {w} steps | time |"
              ).format(w=window)
    lines = [header, "|---|---|---|---|---|---|"]
    for r in results:
        success = [m["success"] for m in r["history"]]
        first = sum(success[:window]) / len(success[:window])
        last = sum(success[-window:]) / len(success[-window:])
        evals = r["evals"]
        held_out = f"{evals[0][1]:.3f} -> {evals[-1][1]:.3f}" if evals else "n/a"
        # the first turn's action (the expression) is what only carry-through credits with the outcome
        right_call = [m["tool_returned_answer"] for m in r["history"]]
        lines.append(f"| {r['variant']} | {first:.3f} | {last:.3f} | {held_out} | "
                     f"{sum(right_call[:window]) / len(right_call[:window]):.3f} -> "
                     f"{sum(right_call[-window:]) / len(right_call[-window:]):.3f} | {r['seconds'] / 60:.1f} min |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, window: int, title: str) -> None:
    fig, (sampled, greedy) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = range(1, len(r["history"]) + 1)
        success = [m["success"] for m in r["history"]]
        line, = sampled.plot(steps, moving_average(success, window), label=r["variant"])
        sampled.plot(steps, success, color=line.get_color(), alpha=0.2)
        if r["evals"]:
            greedy.plot(*zip(*r["evals"]), marker="o", color=line.get_color(), label=r["variant"])
    sampled.set(title=f"sampled success (moving average over {window} steps)", xlabel="step", ylabel="success rate")
    greedy.set(title="greedy success on held-out questions", xlabel="step", ylabel="success rate")
    for ax in (sampled, greedy):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--model", default=None, help="model dir (default: the tiny agent's middling warm start)")
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--gamma", type=float, default=defaults.gamma)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-episodes", type=int, default=defaults.eval_episodes)
    parser.add_argument("--variants", nargs="+", default=list(RETURN_VARIANTS), choices=list(RETURN_VARIANTS))
    parser.add_argument("--window", type=int, default=5, help="steps averaged in the table and the curves")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (processes; give each --threads)")
    parser.add_argument("--output-dir", default="runs/ablation_returns")
    args = parser.parse_args()

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=args.parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(run_variant, args.variants, [args] * len(args.variants)))
    with open(out / "histories.json", "w") as f:
        json.dump(results, f)
    config = TrainConfig(prompts_per_step=args.prompts_per_step)
    title = (f"REINFORCE++ return variants: {args.model or 'tiny agent'}, {config.task}, {args.steps} steps x "
             f"{config.episodes_per_step} episodes, gamma {args.gamma}, lr {args.lr}, seed {args.seed}")
    table = results_table(results, args.window)
    command = " ".join(["python", "examples/ablation_returns.py", *sys.argv[1:]])
    (out / "results.md").write_text(f"# {title}\n\n{table}\n\nCommand: `{command}`\n")
    plot(results, out / "learning_curves.png", args.window, title)
    print("\n" + table)
    print(f"\nwrote {out / 'results.md'} and {out / 'learning_curves.png'}")


if __name__ == "__main__":
    main()
