"""Learning comparisons of ``agent-loop train`` settings over seeds, runs that a stop cuts going on where they stood
(issue 57: ``--filter-groups`` against none at equal rollout tokens, bf16 rollouts against fp32; issue 54: a
context policy's sessions).

    # issue 57's --filter-groups table (started 2026-12-07): a partial warm start (no warm-up: 2 steps are the
    # whole of it), then both settings over 3 seeds; rerun the second command to go on where a stop left it
    agent-loop warmstart --model smollm2-135m --task arithmetic --steps 2 --lr 1e-4 --warmup-steps 0 \\
        --episodes 64 --batch-size 8 --check-episodes 0 --output-dir runs/warm-smollm2-arith
    python examples/learning_comparison.py --out runs/cmp-filter-groups --start --variant none= \\
        --variant filter=--filter-groups --seeds 0 1 2 --eval-episodes 100 -- --model runs/warm-smollm2-arith/model \\
        --task arithmetic --estimator grpo --group-size 4 --prompts-per-step 8 --steps 20 --save-every 2 \\
        --no-tensorboard --threads 2

    # issue 57's bf16 table: the calculator ablation's set-up (12 steps x 8 questions x 2), the sampler in bf16 with
    # the correction it turns on (token-level truncated importance sampling at 2) against fp32
    python examples/learning_comparison.py --out runs/cmp-bf16 --start --variant fp32= \
        --variant "bf16=--rollout-dtype bf16" --seeds 0 1 2 --eval-episodes 100 -- \
        --model runs/warm-smollm2-arith/model --task arithmetic --prompts-per-step 8 --group-size 2 --gamma 0.98 \
        --steps 12 --save-every 2 --no-tensorboard --threads 2

    # issue 54's sessions table (started 2026-12-07): a keydoor warm start (full history), then train under a
    # 600-token context with a 2-turn window, session credit against the row-per-segment ablation
    agent-loop warmstart --model smollm2-135m --task keydoor --steps 8 --lr 1e-4 --warmup-steps 0 --episodes 64 \
        --batch-size 8 --check-episodes 32 --output-dir runs/warm-smollm2-keydoor
    python examples/learning_comparison.py --out runs/cmp-sessions --start --variant session= \
        --variant "segment=--session-credit segment" --seeds 0 1 2 --eval-episodes 64 -- \
        --model runs/warm-smollm2-keydoor/model --task keydoor --estimator grpo --group-size 4 --prompts-per-step 4 \
        --steps 8 --save-every 2 --warmup-steps 1 --no-recompute-old-logprobs --max-turns 8 \
        --max-response-tokens 1024 --max-context-tokens 600 --context window --context-window 2 \
        --no-tensorboard --threads 2

Each cell (variant x seed) is one ``agent-loop train`` run in ``OUT/VARIANT/seed-N``, with the common flags given
after ``--``, then the variant's own, then ``--seed N``. A cell that stopped goes on from its latest checkpoint
(``--resume``); a cell with a result is not run again. Then the cell's last checkpoint plays the held-out questions
(train's evaluation stream: seed N + 1,000,003) sampled at ``--temperature`` in fp32 (``agent-loop rollout``,
``--eval-episodes`` of them); with ``--start`` the model every cell starts from plays them too (the row
``start``). ``OUT/results.json`` holds per cell the held-out success, the steps and the rollout
tokens played (every step's assistant and observation tokens per episode times the episodes it played, those
``--filter-groups`` set aside too), and ``OUT/results.md`` the table (mean and standard deviation over seeds), the
steps and rollout tokens each variant took to reach a training success (``--levels``: the first step whose sampled
success reached it) and the learning curves (training success by step, mean over seeds; ``OUT/curves.png`` draws
them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from agent_loop.episode.loop_config import LoopConfig  # noqa: E402
from agent_loop.recipes.train import EVAL_SEED_OFFSET  # noqa: E402
from agent_loop.runners.local import read_trajectories  # noqa: E402
from agent_loop.tasks.registry import TaskOptions  # noqa: E402
from agent_loop.training.checkpoint import resolve_checkpoint  # noqa: E402

AGENT_LOOP = [sys.executable, "-m", "agent_loop.cli"]
START = "start"  # the row of the untrained starting model (--start)
# the flags of how episodes are played (the loop's and the task's options, as train took them), for the held-out
# rollout; its sampling temperature is the comparison's own
PLAYED_WITH = {f"--{f.name.replace('_', '-')}" for options in (LoopConfig, TaskOptions)
               for f in dataclasses.fields(options)} - {"--temperature"}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the comparison's folder (a cut run goes on from it)")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                        help="a setting: its name and its own train flags (repeatable; NAME= for none)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-episodes", type=int, default=100, help="held-out questions per cell")
    parser.add_argument("--temperature", type=float, default=1.0, help="the held-out questions' sampling")
    parser.add_argument("--levels", type=float, nargs="+", default=[0.5, 0.8, 0.9],
                        help="training-success levels: the steps and rollout tokens each variant took to reach them")
    parser.add_argument("--start", action="store_true",
                        help=f"also play each seed's held-out questions with the --model every cell starts from "
                             f"(the row {START!r}: 0 steps)")
    args = parser.parse_args(argv)
    args.variants = dict(variant.partition("=")[::2] for variant in args.variant)
    if "" in args.variants or START in args.variants or any("/" in name for name in args.variants):
        parser.error(f"each --variant is NAME=FLAGS with a NAME that is a folder name other than {START!r}")
    if args.start and "--model" not in common:
        parser.error("--start plays the --model of the common flags (after --): give one")
    return args, common


def train_cell(folder: Path, flags: list[str]) -> None:
    """``agent-loop train`` of one cell: going on from its latest checkpoint, or from the start (a cell cut before
    its first checkpoint: what it wrote is replaced)."""
    saved = (folder / "checkpoints").is_dir() and any((folder / "checkpoints").glob("step_*"))
    again = ["--resume"] if saved else ["--overwrite"] if folder.exists() else []
    subprocess.run([*AGENT_LOOP, "train", *flags, "--output-dir", str(folder), *again, "--no-progress"], check=True)


def step_metrics(folder: Path) -> list[dict]:
    """A cell's metrics of each step, in order (``metrics.jsonl`` without the evaluations' lines)."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "assistant_tokens" in m]


def step_tokens(folder: Path) -> list[float]:
    """The rollout tokens each of a cell's steps played: assistant and observation tokens per episode times its
    episodes (``--filter-groups``: the groups it examined, each ``group_size`` of them)."""
    config = yaml.safe_load((folder / "config.yaml").read_text())
    return [(step["assistant_tokens"] + step["observation_tokens"]) * step.get("filter_groups/examined",
            config["prompts_per_step"]) * config["group_size"] for step in step_metrics(folder)]


def rollout_tokens(folder: Path) -> float:
    """The tokens a cell's steps played (:func:`step_tokens`), all of them."""
    return sum(step_tokens(folder))


def reached(folder: Path, level: float) -> tuple[int, float] | None:
    """The first step whose training success reaches ``level`` and the rollout tokens played up to it and with
    it, or None when no step did."""
    spent = 0.0
    for step, tokens in zip(step_metrics(folder), step_tokens(folder)):
        spent += tokens
        if step["success"] >= level:
            return step["step"], spent
    return None


def held_out_success(model: Path, folder: Path, seed: int, args, flags: list[str]) -> float:
    """``model`` on seed ``seed``'s held-out questions, sampled (``agent-loop rollout`` with the loop's and the
    task's ``flags``, in fp32 whatever precision the variant sampled in: every cell is measured the same way),
    played into ``folder/held_out.jsonl``."""
    out = folder / "held_out.jsonl"
    out.unlink(missing_ok=True)  # a cut evaluation: played again whole
    folder.mkdir(parents=True, exist_ok=True)
    played_with = [flag for i, flag in enumerate(flags) if flag in PLAYED_WITH or (i and flags[i - 1] in PLAYED_WITH)]
    subprocess.run([*AGENT_LOOP, "rollout", *played_with, "--model", str(model), "--episodes", str(args.eval_episodes),
                    "--seed", str(seed + EVAL_SEED_OFFSET), "--temperature", str(args.temperature),
                    "--rollout-dtype", "fp32", "--out", str(out), "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    return session_success(out)


def session_success(path: Path) -> float:
    """The share of a rollout file's sessions that succeeded: a session whose history was rewritten is several
    records (segments), each carrying the session's success, and counts once."""
    sessions = {t.session_id: t.success for t in read_trajectories(path)}
    return sum(sessions.values()) / len(sessions)


def table(results: dict[str, dict[str, dict]]) -> str:
    """Markdown: per variant, held-out success and rollout tokens, mean and std over seeds."""
    lines = ["| variant | seeds | held-out success | rollout tokens | steps |", "|---|---:|---:|---:|---:|"]
    for name, cells in results.items():
        success = [c["held_out_success"] for c in cells.values()]
        tokens = [c["rollout_tokens"] for c in cells.values()]
        spread = f" +- {statistics.stdev(success):.3f}" if len(success) > 1 else ""
        lines.append(f"| {name} | {len(cells)} | {statistics.mean(success):.3f}{spread} | "
                     f"{statistics.mean(tokens):,.0f} | {max(c['steps'] for c in cells.values())} |")
    return "\n".join(lines) + "\n"


def to_levels(out: Path, results: dict[str, dict[str, dict]], levels: list[float]) -> str:
    """Markdown: per variant and training-success level, how many seeds reached it, and their mean steps and rollout
    tokens to it (:func:`reached`): what reaching a level costs when one variant's steps play more episodes."""
    lines = ["| variant | training success | seeds reaching it | steps to it | rollout tokens to it |",
             "|---|---:|---:|---:|---:|"]
    for name, cells in results.items():
        if name == START:
            continue
        for level in levels:
            hits = [hit for seed in cells if (hit := reached(out / name / f"seed-{seed}", level))]
            steps = f"{statistics.mean(h[0] for h in hits):.1f}" if hits else "-"
            tokens = f"{statistics.mean(h[1] for h in hits):,.0f}" if hits else "-"
            lines.append(f"| {name} | {level:g} | {len(hits)} of {len(cells)} | {steps} | {tokens} |")
    return "Steps and rollout tokens to a training success (sampled, one step's episodes):\n\n" + "\n".join(lines) + "\n"


def training_success(out: Path, results: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict[int, float]]]:
    """Per variant and finished seed, each step's training success (sampled, on the step's own questions)."""
    curves: dict[str, dict[str, dict[int, float]]] = {}
    for name, cells in results.items():
        for seed in cells if name != START else ():  # the starting model has no steps
            steps = step_metrics(out / name / f"seed-{seed}")
            curves.setdefault(name, {})[seed] = {m["step"]: m["success"] for m in steps}
    return curves


def curves(out: Path, results: dict[str, dict[str, dict]]) -> str:
    """The learning curves: markdown of the training success by step, mean over each variant's finished seeds, and
    ``OUT/curves.png`` (each seed thin, the mean thick)."""
    by_seed = training_success(out, results)
    mean = {name: {step: statistics.mean(c[step] for c in seeds.values() if step in c)
                   for step in sorted({s for c in seeds.values() for s in c})} for name, seeds in by_seed.items()}
    steps = sorted({step for series in mean.values() for step in series})
    lines = ["| step | " + " | ".join(mean) + " |", "|---:|" + "---:|" * len(mean)]
    for step in steps:
        row = [f"{mean[name][step]:.3f}" if step in mean[name] else "" for name in mean]
        lines.append(f"| {step} | " + " | ".join(row) + " |")
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for (name, seeds), color in zip(by_seed.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        for curve in seeds.values():
            axes.plot(list(curve), list(curve.values()), color=color, alpha=0.3, linewidth=1)
        axes.plot(list(mean[name]), list(mean[name].values()), color=color, linewidth=2.5,
                  label=f"{name} ({len(seeds)} seeds)")
    axes.set(xlabel="step", ylabel="training success (sampled)", ylim=(-0.02, 1.02))
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "curves.png", dpi=120)
    plt.close(figure)
    return "Training success by step (sampled), mean over seeds (OUT/curves.png):\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args, common = parse_args(argv)
    out = Path(args.out)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    for name, cells in results.items():  # from the held-out files, counted as they are counted now
        for seed, cell in cells.items():
            if (held_out := out / name / f"seed-{seed}" / "held_out.jsonl").is_file():
                cell["held_out_success"] = session_success(held_out)
    out.mkdir(parents=True, exist_ok=True)
    variants = {START: "", **args.variants} if args.start else args.variants
    for seed in args.seeds:  # seed by seed: a comparison cut midway holds whole pairs
        for name, own in variants.items():
            cells = results.setdefault(name, {})
            if str(seed) in cells:
                continue
            folder = out / name / f"seed-{seed}"
            flags = [*common, *shlex.split(own), "--seed", str(seed)]
            if name == START:  # the model every variant starts from, untrained
                model = Path(common[common.index("--model") + 1])
                cells[str(seed)] = {"held_out_success": held_out_success(model, folder, seed, args, flags),
                                    "rollout_tokens": 0.0, "steps": 0}
            else:
                train_cell(folder, flags)
                model = resolve_checkpoint(folder) / "model"  # its last checkpoint
                cells[str(seed)] = {"held_out_success": held_out_success(model, folder, seed, args, flags),
                                    "rollout_tokens": rollout_tokens(folder), "steps": len(step_metrics(folder))}
            path.write_text(json.dumps(results, indent=1))  # after each cell: a stop loses no finished cell
    report = table(results) + "\n" + to_levels(out, results, args.levels) + "\n" + curves(out, results)
    (out / "results.md").write_text(report)
    print(report)
    return results


if __name__ == "__main__":
    main()
