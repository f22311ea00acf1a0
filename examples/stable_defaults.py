"""Do the defaults hold a policy up at every batch size? `agent-loop train`'s defaults, 3 seeds x {16, 64} prompts per step.

    python examples/stable_defaults.py                       # the table in docs/results/stable_defaults.md
    python examples/stable_defaults.py --steps 10 --seeds 0  # a quick look

Each run starts from the tiny agent's middling warm start with every setting at its default (the
learning rate scaled to the episodes per AdamW step, 10 warm-up steps) except the batch size, the seed
and the number of steps. Held-out success is measured before and after, on the same questions and
the same sampling seeds (so start and end are paired), sampled at the rollout temperature and greedy.
Writes ``<output-dir>/stable_defaults.md`` (a table) and ``<output-dir>/stable_defaults.json``; the runs
themselves (metrics, checkpoints) go to ``--runs-dir``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from agent_loop import TrainConfig, Trainer


def run(prompts: int, seed: int, args: argparse.Namespace) -> dict:
    config = TrainConfig.from_flat(prompts_per_step=prompts, seed=seed, steps=args.steps, threads=args.threads, lr=args.lr,
                                   warmup_steps=args.warmup_steps,
                                   eval_episodes=args.eval_episodes, save_every=args.steps, progress=False,
                                   output_dir=str(Path(args.runs_dir) / f"prompts{prompts}_seed{seed}"))
    started = time.perf_counter()
    trainer = Trainer(config)
    start = {**trainer.evaluate(sampled=True), **trainer.evaluate()}
    history = trainer.train()
    end = {**trainer.evaluate(sampled=True), **trainer.evaluate()}
    print(f"prompts {prompts} seed {seed}: sampled {start['eval/sampled_success']:.3f} -> "
          f"{end['eval/sampled_success']:.3f}, greedy {start['eval/success']:.3f} -> {end['eval/success']:.3f}", flush=True)
    return {"prompts_per_step": prompts, "seed": seed, "lr": config.learning_rate, "start": start, "end": end,
            "step_success": [m["success"] for m in history], "seconds": time.perf_counter() - started}


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


parser_defaults = {"lr": None, "warmup_steps": TrainConfig.warmup_steps, "name": "stable_defaults"}


def table(runs: list[dict], args: argparse.Namespace) -> str:
    settings = "defaults" if args.lr is None and args.warmup_steps == TrainConfig.warmup_steps else \
        f"lr {args.lr or 'default'}, warm-up {args.warmup_steps} steps"
    lines = [f"# `agent-loop train` {settings} across seeds: {args.steps} steps, {args.eval_episodes} held-out questions",
             "",
             "| prompts per step | lr (default) | seed | held-out sampled: start -> end | held-out greedy: start -> end "
             "| training success, first 5 -> last 5 steps | time |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        s, e, steps = r["start"], r["end"], r["step_success"]
        lines.append(f"| {r['prompts_per_step']} | {r['lr']:.2g} | {r['seed']} | {s['eval/sampled_success']:.3f} -> "
                     f"{e['eval/sampled_success']:.3f} | {s['eval/success']:.3f} -> {e['eval/success']:.3f} | "
                     f"{statistics.fmean(steps[:5]):.3f} -> {statistics.fmean(steps[-5:]):.3f} | {r['seconds'] / 60:.1f} min |")
    lines += ["", "Mean (min-max) over seeds:", "",
              "| prompts per step | held-out sampled, start | end | change | runs that end below their start |",
              "|---|---|---|---|---|"]
    for prompts in args.prompts_per_step:
        rs = [r for r in runs if r["prompts_per_step"] == prompts]
        start = [r["start"]["eval/sampled_success"] for r in rs]
        end = [r["end"]["eval/sampled_success"] for r in rs]
        below = sum(e < s for s, e in zip(start, end))
        lines.append(f"| {prompts} | {spread(start)} | {spread(end)} | {spread([e - s for s, e in zip(start, end)])} "
                     f"| {below} of {len(rs)} |")
    extra = "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k in ("lr", "warmup_steps", "name")
                    if getattr(args, k) != parser_defaults[k])
    lines += ["", f"Command: `python examples/stable_defaults.py{extra} --steps {args.steps} --seeds "
              f"{' '.join(map(str, args.seeds))} --prompts-per-step {' '.join(map(str, args.prompts_per_step))} "
              f"--eval-episodes {args.eval_episodes} --threads {args.threads} --parallel {args.parallel}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prompts-per-step", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--eval-episodes", type=int, default=128)
    parser.add_argument("--lr", type=float, default=parser_defaults["lr"], help="default: scaled to the batch")
    parser.add_argument("--warmup-steps", type=int, default=parser_defaults["warmup_steps"])
    parser.add_argument("--name", default=parser_defaults["name"], help="file name of the table (.md) and runs (.json)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (processes)")
    parser.add_argument("--output-dir", default="docs/results", help="where the table goes")
    parser.add_argument("--runs-dir", default="runs/stable_defaults", help="the runs' metrics and checkpoints (new)")
    args = parser.parse_args()
    out = Path(args.output_dir)
    if Path(args.runs_dir).exists() and any(Path(args.runs_dir).iterdir()):
        raise SystemExit(f"--runs-dir {args.runs_dir} is not empty; choose a new folder")
    grid = list(itertools.product(args.prompts_per_step, args.seeds))
    context = multiprocessing.get_context("spawn")  # torch threads and tokenizers do not survive fork
    with ProcessPoolExecutor(args.parallel, mp_context=context) as pool:
        runs = list(pool.map(run, *zip(*grid), itertools.repeat(args)))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(runs, indent=1))
    text = table(runs, args)
    (out / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
