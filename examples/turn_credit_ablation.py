"""Does credit per turn help? Outcome-level estimators against turn-level ones on the ``keydoor`` task (issue 47 item 5).

    python examples/turn_credit_ablation.py                       # the tiny agent, the defaults below
    nice -n 10 .venv/bin/python examples/turn_credit_ablation.py --model smollm2-135m --warm-start-steps 4 \\
        --warm-start-lr 1e-4 --seeds 0 1 2 --steps 8 --prompts-per-step 4 --group-size 4 --eval-episodes 24 \\
        --save-every 2 --parallel 1 --threads 2 --output-dir runs/turn_credit_ablation_ws4   # docs/results' 12 runs

The task (``agent_loop/tasks/keydoor.py``): a 4x4 grid of rooms, ``move``/``look`` tools, 3 to 5 moves via the
key to the door, then "Done."; each call earns +0.1 (a move closer to done) or -0.1 (a failed call or a move that is
not), on its turn's last ASSISTANT token, and the outcome 1.0 (door opened, final answer) on the last one. The
same rewards reach every variant; only the advantage estimator differs:

- ``reinforce_plus_plus``: token-level discounted returns (carry-through), whitened over the batch;
- ``grpo``: one score per episode (its rewards summed), normalised within the group, on every token;
- ``turn_rloo``: each turn's return minus the mean of the other group members' returns at the same turn index;
- ``gigpo``: GRPO's episode-level advantage plus a step-level one over anchor-state groups (the task's
  ``turn_states``: the room, the key, the door), leave-one-out.

A real model (``--model smollm2-135m``) first gets a deliberately partial warm start (``--warm-start-steps`` steps
on the task's demonstrations, made once into ``<output-dir>/warmstart/model``): every run starts there. Each
(variant, seed) is one run. Held-out maps (the task's held-out split: train's evaluation stream) are played
greedy and sampled (the rollouts' temperature) before (once per seed: ``start-seed<S>.json``) and after training.
"Steps to threshold": the first step at which the moving average (``--window`` steps) of the training episodes'
sampled success reaches ``--threshold``.

A run whose ``result.json`` exists is not run again (with a larger ``--steps`` it trains on from its last
checkpoint); an interrupted one goes on from its latest checkpoint (every ``--save-every`` steps; only the latest is
kept), its history read from ``metrics.jsonl``; a finished warm start is reused: the same command fills the table
over several sessions. SIGTERM (``kill``, a scheduler's stop) stops the runs' processes too, each at once or, on
vLLM, after closing its engine. ``--collect`` tabulates the finished runs only. Writes ``<output-dir>/results.md``
(the table and one line per run), ``learning_curves.png`` and ``histories.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import psutil  # noqa: E402

from agent_loop import TrainConfig, Trainer  # noqa: E402
from agent_loop.files import write_text  # noqa: E402
from agent_loop.options import flatten  # noqa: E402
from agent_loop.tasks.keydoor import MAX_TURNS  # noqa: E402

TASK = "keydoor"
VARIANTS = ("reinforce_plus_plus", "grpo", "turn_rloo", "gigpo")  # registered estimator names (advantages)
CURVES = (("success", "sampled success of the training episodes"),
          ("good_moves", "share of calls that brought the agent closer (keydoor's good_moves)"))


def stop_runs_on_sigterm() -> None:
    """On SIGTERM, pass it to this process's children (the runs; multiprocessing's resource tracker ignores it),
    wait for them (the process pool's exit) and exit 143. Without it a run's process, whose parent is gone, would
    go on training (and computing on the cores) until it finished."""
    def stop(signum, frame):
        for child in psutil.Process().children():
            child.send_signal(signal.SIGTERM)
        print("stopped by SIGTERM; the same command goes on from each run's latest checkpoint", file=sys.stderr)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def check_variants(variants: list[str]) -> None:
    """SystemExit naming the variants the advantage registry does not know (yet)."""
    from advantages import ESTIMATORS

    missing = [v for v in variants if v not in ESTIMATORS]
    if missing:
        raise SystemExit(f"estimators not registered: {', '.join(missing)} (known: {', '.join(ESTIMATORS)}); "
                         "choose --variants among the known ones")


def warm_started(args: argparse.Namespace) -> str:
    """The folder of ``--warm-start-steps`` steps of warm start of ``args.model`` on keydoor (made once, then reused)."""
    from agent_loop.recipes.warmstart import MODEL_DIR, warm_start
    from agent_loop.recipes.warmstart_options import WarmstartConfig

    folder = Path(args.output_dir) / "warmstart"
    if not (folder / MODEL_DIR / "config.json").is_file():
        print(f"warm start: {args.warm_start_steps} steps on {TASK}'s demonstrations", flush=True)
        # no warm-up of the learning rate: a few steps are the whole warm start
        config = WarmstartConfig(model=args.model, task=TASK, steps=args.warm_start_steps, lr=args.warm_start_lr,
                                 warmup_steps=0, episodes=args.warm_start_episodes, batch_size=args.warm_start_batch,
                                 threads=args.threads, output_dir=str(folder), progress=False, overwrite=True,
                                 check_episodes=0)
        result = warm_start(config)
        print(f"warm start: loss {result.history[0]['loss']:.3f} -> {result.history[-1]['loss']:.3f} in "
              f"{result.seconds:.0f} s", flush=True)
    return str(folder / MODEL_DIR)


def held_out(trainer: Trainer, greedy: bool) -> dict[str, float]:
    """Sampled (and with ``greedy`` greedy) success on the held-out maps (train's evaluation stream: the same maps
    and sampling seeds every time)."""
    rates = {"sampled": trainer.evaluate(sampled=True)["eval/sampled_success"]}
    if greedy:
        rates["greedy"] = trainer.evaluate()["eval/success"]
    return rates


def start_of(trainer: Trainer, args: argparse.Namespace) -> dict[str, float]:
    """The held-out rates of the starting model under this seed (the same for every variant), measured once per
    seed into ``<output-dir>/start-seed<S>.json``."""
    path = Path(args.output_dir) / f"start-seed{trainer.config.run.seed}.json"
    if path.is_file() and (not args.greedy or "greedy" in json.loads(path.read_text())):
        return json.loads(path.read_text())
    start = held_out(trainer, args.greedy)
    write_text(path, json.dumps(start))  # whole or not at all (two runs of a seed may both measure it)
    return start


def config_for(variant: str, seed: int, args: argparse.Namespace, resume: str | None) -> TrainConfig:
    return TrainConfig.from_flat(
        model=args.model, task=TASK, estimator=variant, seed=seed, steps=args.steps, gamma=args.gamma,
        prompts_per_step=args.prompts_per_step, group_size=args.group_size, mini_batches=args.mini_batches,
        lr=args.lr, threads=args.threads, backend=args.backend, max_turns=MAX_TURNS, max_tokens=args.max_tokens,
        max_response_tokens=args.max_response_tokens, eval_every=0, eval_episodes=args.eval_episodes,
        # only the latest checkpoint kept: SmolLM2's is 1.6 GB with its AdamW state, 12 runs would fill the disk
        output_dir=str(Path(args.output_dir) / f"{variant}-seed{seed}"), save_every=args.save_every, keep_checkpoints=1,
        save_rollouts_every=args.save_every, progress=False, resume=resume, overwrite=resume is None,
    )


def run(variant: str, seed: int, args: argparse.Namespace) -> dict:
    output_dir = Path(args.output_dir) / f"{variant}-seed{seed}"
    if (output_dir / "result.json").is_file():  # finished in an earlier session: reused, or trained on to --steps
        done = json.loads((output_dir / "result.json").read_text())
        if len(done["history"]) >= args.steps:
            return done
    # an interrupted run goes on from its latest checkpoint; one with none starts over
    resume = str(output_dir) if any((output_dir / "checkpoints").glob("step_*")) else None
    print(f"\n=== {variant} (seed {seed}){' resumed' if resume else ''} ===", flush=True)
    started = time.perf_counter()
    trainer = Trainer(config_for(variant, seed, args, resume))
    try:
        start = start_of(trainer, args)
        trainer.train()
        end = held_out(trainer, args.greedy)
    finally:
        # A pool worker's exit joins its child processes without running atexit, so an engine left open (vLLM's
        # engine-core process) would hold the worker, and every run after it, forever.
        trainer.backend.close()
    # every step's metrics, those of earlier sessions included (train() returns only the steps it ran)
    history = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    result = {"variant": variant, "seed": seed, "history": history, "held_out": {"start": start, "end": end},
              "seconds": time.perf_counter() - started, "resumed": resume is not None}
    write_text(output_dir / "result.json", json.dumps(result))
    return result


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def steps_to(history: list[dict], threshold: float, window: int) -> int | None:
    """The first step whose moving average of training success reaches ``threshold``; None if none does."""
    averaged = moving_average([m["success"] for m in history], window)
    return next((m["step"] for m, value in zip(history, averaged) if value >= threshold), None)


def spread(values: list[float]) -> str:
    """Mean and, over several seeds, the range: "0.412 [0.375, 0.469]"."""
    mean = sum(values) / len(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} [{min(values):.3f}, {max(values):.3f}]"


def by_variant(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["variant"], []).append(r)
    return groups


def window_mean(history: list[dict], name: str, window: int, last: bool) -> float:
    values = [m.get(name, 0.0) for m in history]
    part = values[-window:] if last else values[:window]
    return sum(part) / len(part)


def reached(runs: list[dict], threshold: float, window: int) -> str:
    """Steps to threshold per seed ("-" where not reached), and how many seeds reached it."""
    steps = [steps_to(r["history"], threshold, window) for r in runs]
    return f"{' / '.join('-' if s is None else str(s) for s in steps)} ({sum(s is not None for s in steps)} of {len(steps)})"


def results_table(results: list[dict], window: int, threshold: float) -> str:
    lines = [f"| estimator | seeds | held-out sampled: start -> end | held-out greedy: start -> end | training success, "
             f"first {window} -> last {window} steps | good moves, first {window} -> last {window} | steps to "
             f"{threshold:g} (per seed) | time per run |", "|---|---|---|---|---|---|---|---|"]
    for variant, runs in by_variant(results).items():
        def held(decoding: str) -> str:
            if not all(decoding in r["held_out"]["start"] and decoding in r["held_out"]["end"] for r in runs):
                return "not measured"
            return (f"{spread([r['held_out']['start'][decoding] for r in runs])} -> "
                    f"{spread([r['held_out']['end'][decoding] for r in runs])}")

        def cell(name: str) -> str:
            return (f"{spread([window_mean(r['history'], name, window, False) for r in runs])} -> "
                    f"{spread([window_mean(r['history'], name, window, True) for r in runs])}")

        minutes = sum(r["seconds"] for r in runs) / len(runs) / 60
        lines.append(f"| {variant} | {len(runs)} | {held('sampled')} | {held('greedy')} | {cell('success')} | "
                     f"{cell('good_moves')} | {reached(runs, threshold, window)} | {minutes:.1f} min |")
    return "\n".join(lines)


def per_run_table(results: list[dict]) -> str:
    lines = ["| estimator | seed | held-out sampled: start -> end | greedy: start -> end | steps | minutes |",
             "|---|---|---|---|---|---|"]
    for r in results:
        start, end = r["held_out"]["start"], r["held_out"]["end"]
        greedy = f"{start['greedy']:.3f} -> {end['greedy']:.3f}" if "greedy" in start and "greedy" in end else "-"
        lines.append(f"| {r['variant']} | {r['seed']} | {start['sampled']:.3f} -> {end['sampled']:.3f} | "
                     f"{greedy} | {len(r['history'])} | "
                     f"{r['seconds'] / 60:.1f}{' (last session)' if r.get('resumed') else ''} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, window: int, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, runs in by_variant(results).items():
        for ax, (name, _) in zip(axes, CURVES):
            curves = [moving_average([m.get(name, 0.0) for m in r["history"]], window) for r in runs]
            steps = range(1, min(len(c) for c in curves) + 1)
            per_step = list(zip(*curves))
            line, = ax.plot(steps, [sum(v) / len(v) for v in per_step], label=f"{variant} (mean of {len(runs)})")
            if len(runs) > 1:
                ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step],
                                color=line.get_color(), alpha=0.2)
    for ax, (_, label) in zip(axes, CURVES):
        ax.set(title=f"{label}\n(moving average over {window} steps; band: min-max over seeds)", xlabel="step",
               ylabel="rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.title.set_fontsize(9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = argparse.Namespace(**flatten(TrainConfig()))  # the options' defaults, by their flat names
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir or registered name (default: the tiny agent's "
                        "middling warm start)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="registered advantage estimators")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4, help="samples per map (group estimators need >= 2)")
    parser.add_argument("--mini-batches", type=int, default=defaults.mini_batches,
                        help="optimizer steps per training step; must divide prompts x group size")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per assistant turn")
    parser.add_argument("--max-response-tokens", type=int, default=768, help="assistant + observation tokens per episode")
    parser.add_argument("--warm-start-steps", type=int, default=0,
                        help="first warm-start --model on keydoor's demonstrations for this many steps (0: none)")
    parser.add_argument("--warm-start-episodes", type=int, default=64, help="demonstrations of the warm start")
    parser.add_argument("--warm-start-batch", type=int, default=8, help="demonstrations per warm-start step")
    parser.add_argument("--warm-start-lr", type=float, default=None, help="the warm start's learning rate")
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--backend", default=defaults.backend, help="rollout backend, as train's --backend (auto: "
                        "vLLM in process for a real model, transformers for a small one)")
    parser.add_argument("--save-every", type=int, default=2, help="steps between checkpoints (an interrupted run "
                        "resumes from its latest)")
    parser.add_argument("--eval-episodes", type=int, default=32, help="held-out maps per check")
    parser.add_argument("--greedy", action="store_true", help="also check the held-out maps greedy (sampled only "
                        "by default: each check costs as much as a training step's rollouts)")
    parser.add_argument("--window", type=int, default=3, help="steps averaged in the table, curves and threshold")
    parser.add_argument("--threshold", type=float, default=0.5, help="training success the steps-to column waits for")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (processes; give each --threads)")
    parser.add_argument("--output-dir", default="runs/turn_credit_ablation")
    parser.add_argument("--collect", action="store_true",
                        help="train nothing: tabulate the finished runs (their result.json) of these variants and seeds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_model = args.model
    jobs = [(variant, seed) for seed in args.seeds for variant in args.variants]  # all variants of a seed together
    failed: list[str] = []
    if args.collect:
        files = [out / f"{variant}-seed{seed}" / "result.json" for variant, seed in jobs]
        results = [json.loads(f.read_text()) for f in files if f.exists()]
    else:
        check_variants(args.variants)
        stop_runs_on_sigterm()
        spawn = multiprocessing.get_context("spawn")
        # the warm start and each run in a process of its own: its memory goes back when it ends
        if args.warm_start_steps:
            with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                args.model = pool.submit(warm_started, args).result()
        with ProcessPoolExecutor(max_workers=args.parallel, mp_context=spawn, max_tasks_per_child=1) as pool:
            futures = {pool.submit(run, variant, seed, args): (variant, seed) for variant, seed in jobs}
        results = []
        for future, (variant, seed) in futures.items():  # a run that fails leaves the others' results
            try:
                results.append(future.result())
            except Exception as error:
                failed.append(f"{variant}-seed{seed}: {type(error).__name__}: {error}")
        for line in failed:
            print(f"run failed (the same command goes on from its latest checkpoint): {line}", file=sys.stderr)
    if not results:
        raise SystemExit(f"no finished runs under {out}")
    write_text(out / "histories.json", json.dumps(results))
    config = TrainConfig.from_flat(prompts_per_step=args.prompts_per_step, group_size=args.group_size, lr=args.lr)
    start = f" after {args.warm_start_steps} warm-start steps" if args.warm_start_steps else ""
    title = (f"Turn credit on keydoor: {base_model or 'tiny agent'}{start}, {args.steps} steps x "
             f"{config.episodes_per_step} episodes ({args.prompts_per_step} maps x {args.group_size}), gamma "
             f"{args.gamma}, lr {config.learning_rate:g}, seeds {' '.join(map(str, args.seeds))}")
    table = results_table(results, args.window, args.threshold)
    command = " ".join(["python", "examples/turn_credit_ablation.py", *(sys.argv[1:] if argv is None else argv)])
    write_text(out / "results.md", f"# {title}\n\n{table}\n\nPer run:\n\n{per_run_table(results)}\n\n"
                                   f"Command: `{command}`\n")
    plot(results, out / "learning_curves.png", args.window, title)
    print("\n" + table)
    print(f"\nwrote {out / 'results.md'} and {out / 'learning_curves.png'}")
    if failed:
        raise SystemExit(f"{len(failed)} of {len(jobs)} runs failed")
    return results


if __name__ == "__main__":
    main()
