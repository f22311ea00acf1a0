"""Does carry-through matter? The same training, same seeds, with three REINFORCE++ return variants.

    python examples/ablation_returns.py                         # 3 runs of the default training
    python examples/ablation_returns.py --steps 150 --gamma 0.95 --parallel 2 --threads 1
    python examples/ablation_returns.py --task chain --seeds 0 1 2 --steps 20 --prompts-per-step 32 \\
        --max-response-tokens 512 --gamma 0.98 --eval-episodes 32 --parallel 2 --threads 1   # issue 17: 9 runs
    python examples/ablation_returns.py --model smollm2-135m --task arithmetic --warm-start-steps 2 \\
        --warm-start-lr 1e-4 --seeds 0 1 2 --steps 12 --prompts-per-step 8 --group-size 2 --gamma 0.98 \\
        --eval-episodes 40 --parallel 2 --threads 1 --output-dir runs/ablation_smollm2   # issue 36: 9 runs

- ``carry_through``: the running return passes unchanged through OBSERVATION tokens (ours, verl
  after PR #7300);
- ``reset_at_observation``: the return restarts at every masked token (verl before PR #7300), so the
  outcome never reaches the tool call of the first turn;
- ``ignore_mask``: one discounted scan over every position, observation tokens included (they cost
  discount steps; with ``gamma = 1`` this equals carry-through on ASSISTANT tokens).

In the arithmetic task the outcome depends on the first turn: the calculator returns the value of the
expression the model wrote, and the answer is right only if that expression was. In the chain task
(``--task chain``; its model defaults to the chain-trained tiny agent, ``agent_loop.tiny.chain``) the
first action is the calculator call, whose value the model then looks up: two observations, one of
them a ~130-token record, lie between it and the reward.

A real model (``--model smollm2-135m``, or any folder) does not call the task's tools on its own:
``--warm-start-steps N`` first fine-tunes it on the task's demonstrations (``agent_loop.recipes.warmstart``, the
calculator call then the answer), once, into ``<output-dir>/warmstart/model``, the starting point of every
run; keep N small so the start is partial (about 20-40% sampled success), with room for RL to show.

Each (variant, seed) is one run; held-out questions are checked greedy and sampled (T=1) before and
after training. A run whose ``result.json`` exists is not run again, an interrupted one goes on from its latest
checkpoint (every ``--save-every`` steps), and a finished warm start is reused, so the table can be filled over
several sessions with the same command (a resumed run's time is that of its last session). Writes
``<output-dir>/results.md`` (the table: mean and min-max over seeds), ``<output-dir>/learning_curves.png`` (mean
and min-max band) and ``histories.json``.
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

from agent_loop import TrainConfig, Trainer  # noqa: E402
from agent_loop.inspect.choices import REGISTERED  # noqa: E402
from agent_loop.options import flatten  # noqa: E402
from agent_loop.recipes.train import EVAL_SEED_OFFSET  # noqa: E402

# the return variants (as inspect --compare names them, with underscores), by the registered estimator of each
VARIANTS = {name.replace("-", "_"): estimator for name, estimator in REGISTERED.items()}

# the first action's own metric: did the tool call of the first turn do the right thing
FIRST_ACTION = {"chain": ("first_call_right", "first call (calculator) returned the record's number"),
                "arithmetic": ("tool_returned_answer", "calculator returned the answer"),
                "lookup": ("tool_returned_answer", "lookup returned the answer")}


def default_model(task: str) -> str | None:
    """The chain task's model is the chain-trained tiny agent (built on first use); the others: the trainer's default."""
    if task != "chain":
        return None
    from agent_loop.tiny.chain import chain_agent_path

    return str(chain_agent_path("mid"))


def held_out(trainer: Trainer, episodes: int) -> dict[str, float]:
    """Greedy and sampled (T=1) success of the trainer's policy on held-out questions (the trainer's eval stream)."""
    from agent_loop.tiny.evaluate import evaluate

    seed = trainer.config.run.seed + EVAL_SEED_OFFSET
    return {("greedy" if greedy else "sampled"): evaluate(trainer.policy, trainer.tokenizer, trainer.config.rollout.task,
                                                           episodes, seed, greedy)["success"]
            for greedy in (True, False)}


def warm_started(args: argparse.Namespace) -> str:
    """The folder of ``--warm-start-steps`` steps of warm start of ``args.model`` on the task (made once, then reused)."""
    from agent_loop.recipes.warmstart import MODEL_DIR, warm_start
    from agent_loop.recipes.warmstart_options import WarmstartConfig

    folder = Path(args.output_dir) / "warmstart"
    if not (folder / MODEL_DIR / "config.json").is_file():
        print(f"warm start: {args.warm_start_steps} steps on {args.task}'s demonstrations", flush=True)
        # no warm-up of the learning rate: a few steps are the whole warm start (its default 10 would make them ~0)
        config = WarmstartConfig(model=args.model, task=args.task, steps=args.warm_start_steps, lr=args.warm_start_lr,
                                 warmup_steps=0, episodes=args.warm_start_episodes, batch_size=args.warm_start_batch,
                                 threads=args.threads, output_dir=str(folder), progress=False,
                                 check_episodes=0)  # its own held-out evaluation follows
        result = warm_start(config)
        print(f"warm start: loss {result.history[0]['loss']:.3f} -> {result.history[-1]['loss']:.3f} in "
              f"{result.seconds:.0f} s", flush=True)
    return str(folder / MODEL_DIR)


def start_of(trainer: Trainer, args: argparse.Namespace) -> dict[str, float]:
    """The held-out rates of the starting model under this seed: the same for every variant (same model, same
    questions, same sampling seeds), so measured once per seed and kept in ``<output-dir>/start-seed<S>.json``."""
    from agent_loop.files import write_text

    path = Path(args.output_dir) / f"start-seed{trainer.config.run.seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    start = held_out(trainer, args.eval_episodes)
    write_text(path, json.dumps(start))  # whole or not at all (two runs of a seed may both measure it)
    return start


def run(variant: str, seed: int, args: argparse.Namespace) -> dict:
    output_dir = Path(args.output_dir) / f"{variant}-seed{seed}"
    if (output_dir / "result.json").is_file():  # finished in an earlier session
        return json.loads((output_dir / "result.json").read_text())
    # an interrupted run goes on from its latest checkpoint; one with none starts over
    resume = str(output_dir) if any((output_dir / "checkpoints").glob("step_*")) else None
    config = TrainConfig.from_flat(
        model=args.model, task=args.task, prompts_per_step=args.prompts_per_step, lr=args.lr, estimator=VARIANTS[variant],
        gamma=args.gamma, steps=args.steps, seed=seed, threads=args.threads, max_response_tokens=args.max_response_tokens,
        group_size=args.group_size, mini_batches=args.mini_batches, eval_every=args.eval_every,
        eval_episodes=args.eval_episodes, output_dir=str(output_dir), save_every=args.save_every, progress=False,
        resume=resume, overwrite=resume is None,
    )
    print(f"\n=== {variant} (gamma {args.gamma}, seed {seed}){' resumed' if resume else ''} ===", flush=True)
    started = time.perf_counter()
    trainer = Trainer(config)
    start = start_of(trainer, args)
    trainer.train()
    end = held_out(trainer, args.eval_episodes)
    # every step's metrics, those of earlier sessions included (train() returns only the steps it ran)
    history = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(m["step"], m["eval/success"]) for m in history if "eval/success" in m]
    result = {"variant": variant, "seed": seed, "history": history, "evals": evals,
              "held_out": {"start": start, "end": end}, "seconds": time.perf_counter() - started}
    (Path(config.output.output_dir) / "result.json").write_text(json.dumps(result))  # for --collect
    return result


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]


def spread(values: list[float]) -> str:
    """Mean and, over several seeds, the range: "0.412 [0.375, 0.469]"."""
    mean = sum(values) / len(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} [{min(values):.3f}, {max(values):.3f}]"


def window_mean(history: list[dict], name: str, window: int, last: bool) -> float:
    values = [m[name] for m in history]
    part = values[-window:] if last else values[:window]
    return sum(part) / len(part)


def by_variant(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["variant"], []).append(r)
    return groups


def results_table(results: list[dict], window: int, task: str) -> str:
    metric, label = FIRST_ACTION[task]
    header = (f"| returns | seeds | sampled success, first {window} steps | last {window} steps | "
              "held-out greedy: start -> end | held-out sampled: start -> end | "
              f"{label}, first {window} -> last {window} steps | time per run |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for variant, runs in by_variant(results).items():
        def cell(name: str, last: bool) -> str:
            return spread([window_mean(r["history"], name, window, last) for r in runs])

        def held(decoding: str) -> str:
            return (f"{spread([r['held_out']['start'][decoding] for r in runs])} -> "
                    f"{spread([r['held_out']['end'][decoding] for r in runs])}")

        minutes = sum(r["seconds"] for r in runs) / len(runs) / 60
        lines.append(f"| {variant} | {len(runs)} | {cell('success', False)} | {cell('success', True)} | "
                     f"{held('greedy')} | {held('sampled')} | {cell(metric, False)} -> {cell(metric, True)} | "
                     f"{minutes:.1f} min |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, window: int, task: str, title: str) -> None:
    metric, label = FIRST_ACTION[task]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, runs in by_variant(results).items():
        for ax, name in zip(axes, ("success", metric)):
            curves = [moving_average([m[name] for m in r["history"]], window) for r in runs]
            steps = range(1, min(len(c) for c in curves) + 1)
            per_step = list(zip(*curves))
            mean = [sum(v) / len(v) for v in per_step]
            line, = ax.plot(steps, mean, label=f"{variant} (mean of {len(runs)})")
            if len(runs) > 1:
                ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step],
                                color=line.get_color(), alpha=0.2)
    axes[0].set(title=f"sampled success (moving average over {window} steps; band: min-max over seeds)",
                xlabel="step", ylabel="rate")
    axes[1].set(title=f"{label} (same averaging)", xlabel="step", ylabel="rate")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.title.set_fontsize(9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    defaults = argparse.Namespace(**flatten(TrainConfig()))  # the options' defaults, by their flat names
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default=defaults.task, choices=sorted(FIRST_ACTION))
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--model", default=None, help="model dir (default: the tiny agent's middling warm start; "
                        "for --task chain the chain-trained tiny agent's)")
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--mini-batches", type=int, default=defaults.mini_batches,
                        help="optimizer steps per training step; must divide prompts x group size")
    parser.add_argument("--warm-start-steps", type=int, default=0,
                        help="first warm-start --model on the task's demonstrations for this many steps (0: no warm start)")
    parser.add_argument("--warm-start-episodes", type=int, default=64, help="demonstrations of the warm start")
    parser.add_argument("--warm-start-batch", type=int, default=8, help="demonstrations per warm-start step")
    parser.add_argument("--warm-start-lr", type=float, default=None,
                        help="the warm start's learning rate (default: warmstart's own for a --model)")
    parser.add_argument("--max-response-tokens", type=int, default=defaults.max_response_tokens,
                        help="assistant + observation tokens per episode (chain: 512 fits its records)")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--gamma", type=float, default=defaults.gamma)
    parser.add_argument("--seeds", type=int, nargs="+", default=[defaults.seed])
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--save-every", type=int, default=4, help="steps between checkpoints (an interrupted run "
                        "resumes from its latest)")
    parser.add_argument("--eval-every", type=int, default=0, help="steps between greedy held-out checks (0: never)")
    parser.add_argument("--eval-episodes", type=int, default=64, help="held-out questions per check")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--window", type=int, default=5, help="steps averaged in the table and the curves")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (processes; give each --threads)")
    parser.add_argument("--output-dir", default="runs/ablation_returns")
    parser.add_argument("--collect", action="store_true",
                        help="train nothing: tabulate the finished runs (their result.json) of these variants and seeds")
    args = parser.parse_args()
    args.model = args.model or default_model(args.task)  # built here, once, before the runs start

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_model = args.model
    if args.warm_start_steps and not args.collect:
        args.model = warm_started(args)
    jobs = [(variant, seed) for seed in args.seeds for variant in args.variants]  # all variants of a seed together
    if args.collect:
        files = [out / f"{variant}-seed{seed}" / "result.json" for variant, seed in jobs]
        results = [json.loads(f.read_text()) for f in files if f.exists()]
        results.sort(key=lambda r: args.variants.index(r["variant"]))
    else:
        with ProcessPoolExecutor(max_workers=args.parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(run, *zip(*jobs), [args] * len(jobs)))
    with open(out / "histories.json", "w") as f:
        json.dump(results, f)
    config = TrainConfig.from_flat(prompts_per_step=args.prompts_per_step, group_size=args.group_size, lr=args.lr)
    start = f" after {args.warm_start_steps} warm-start steps" if args.warm_start_steps else ""
    title = (f"REINFORCE++ return variants: {base_model or 'tiny agent'}{start}, {args.task}, {args.steps} steps x "
             f"{config.episodes_per_step} episodes, gamma {args.gamma}, lr {config.learning_rate:g}, "
             f"seeds {' '.join(map(str, args.seeds))}")
    table = results_table(results, args.window, args.task)
    command = " ".join(["python", "examples/ablation_returns.py", *sys.argv[1:]])
    (out / "results.md").write_text(f"# {title}\n\n{table}\n\nCommand: `{command}`\n")
    plot(results, out / "learning_curves.png", args.window, args.task, title)
    print("\n" + table)
    print(f"\nwrote {out / 'results.md'} and {out / 'learning_curves.png'}")


if __name__ == "__main__":
    main()
