"""Asynchronous training (``--max-staleness K``) against synchronous steps, in one run on this machine.

    python benchmarks/async_training.py --out docs/results/async_training   # both parts (about 45 min on 2 cores)
    python benchmarks/async_training.py --part throughput --steps 10
    python benchmarks/async_training.py --part curves --steps 80 --seeds 0 1 2

Part 1, throughput: the tiny agent's mid checkpoint trained for ``--steps`` steps at K = 0, 1, 2, once with an
emulated tool latency (every tool call sleeps 0.2-2 s, heavy-tailed: ``min(2, 0.2 x Pareto(1.2))`` seconds,
seeded per episode) and once with the built-in tools as they are (a calculator: microseconds). Per run:
wall time per step (the mean of ``time/step_s``: waiting for episodes plus training plus the weight push),
the trainer's idle time per step (``time/idle_s``: waiting for episodes), trained episodes per second, the
producer's throughput, the episodes dropped as stale and the mean staleness; each K against K = 0 with the
same tools.

Part 2, learning curves: the same latency tool, ``--seeds`` x {K = 0, K = 1, K = 1 with truncated
importance sampling (``--rollout-is token``, cap 2: the sampler/trainer correction)}, ``--steps`` steps each
of twice ``--prompts-per-step`` episodes in one AdamW step (the default learning rate then is the measured
stable 2e-4, BENCHMARKS.md issue 17).
Per run: the training success of every step against wall time, and the held-out sampled success at the
end (``--eval-episodes`` arithmetic questions without latency, the same questions and sampling seeds for
every run: paired). The table gives, per setting, the mean [min, max] over seeds of the success of the
first and last ``WINDOW`` steps, the held-out success, the wall time and its time per step, and the wall
time (and step) at which the mean success of its last ``WINDOW`` steps first reaches the target, the K = 0
runs' final success (the mean over seeds of their last ``WINDOW`` steps), counted once a whole window is in,
against K = 0's own. ``--out PREFIX`` writes PREFIX.md (the tables), PREFIX.json (every step of every run)
and PREFIX.png (the curves).

Each run is one ``Trainer`` in this process, one at a time, 1 torch thread per thread (the producer's decode
and the trainer's update share the 2 cores). The machine's 1-minute load average is sampled every 10 s and
reported with the tables (other jobs share the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_loop.episode.contracts import Task  # noqa: E402
from agent_loop.tasks.registry import get_task  # noqa: E402

WINDOW = 10  # steps per mean of the learning curves (first, last, running)
SETTINGS = {"K=0": {"max_staleness": 0}, "K=1": {"max_staleness": 1}, "K=2": {"max_staleness": 2},
            "K=1 + IS": {"max_staleness": 1, "rollout_is": "token"}}


class HeavyTailedTools(Task):
    """The arithmetic task with every tool call taking ``min(cap, low x Pareto(alpha))`` seconds more, drawn
    from a generator seeded by the episode (the same latencies for the same episode in every run)."""

    name = "arithmetic"

    def __init__(self, low: float = 0.2, cap: float = 2.0, alpha: float = 1.2):
        self.task, self.low, self.cap, self.alpha = get_task("arithmetic"), low, cap, alpha

    def latency(self, rng: random.Random) -> float:
        return min(self.cap, self.low * rng.paretovariate(self.alpha))

    def make_episode(self, index, seed=0):
        episode = self.task.make_episode(index, seed)
        rng = random.Random(f"latency:{seed}:{index}")
        episode.tools = [self.slowed(tool, rng) for tool in episode.tools]
        return episode

    def slowed(self, tool, rng: random.Random):
        @functools.wraps(tool)  # the same name, signature and docstring: the same tool schema
        def slow(*args, **kwargs):
            time.sleep(self.latency(rng))
            return tool(*args, **kwargs)
        return slow

    def reward(self, episode, messages, tool_calls):
        return self.task.reward(episode, messages, tool_calls)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("both", "throughput", "curves"), default="both")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 20 throughput, 80 curves)")
    parser.add_argument("--prompts-per-step", type=int, default=16, help="throughput runs (curves: twice this)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-episodes", type=int, default=256)
    parser.add_argument("--out", type=Path, help="write PREFIX.md, PREFIX.json and (curves) PREFIX.png")
    return parser.parse_args()


def train(scratch: Path, name: str, task, steps: int, prompts: int, seed: int = 0, **settings):
    """One run; returns (its metrics per step, its trained policy)."""
    from agent_loop import TrainConfig, Trainer
    from agent_loop.tiny import tiny_agent_path

    config = TrainConfig.from_flat(model=str(tiny_agent_path(stage="mid")), steps=steps, prompts_per_step=prompts,
                                   group_size=1, threads=1, seed=seed, save_every=10**6, save_rollouts_every=0,
                                   tensorboard=False, progress=False, output_dir=str(scratch / name), **settings)
    trainer = Trainer(config, task=task)
    history = trainer.train()
    return history, trainer.policy


def held_out_success(policy, episodes: int) -> float:
    """Sampled success on held-out arithmetic questions (no latency), the same questions and seeds every call."""
    import copy

    from transformers import AutoTokenizer

    from agent_loop.backends.hf import TransformersBackend
    from agent_loop.episode.loop_config import LoopConfig
    from agent_loop.runners.local import run_rollouts
    from agent_loop.tiny import tiny_agent_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_path(stage="mid"))
    backend = TransformersBackend(copy.deepcopy(policy).eval())
    loop = LoopConfig(max_turns=3, max_tokens=48, max_response_tokens=256)
    played = asyncio.run(run_rollouts(get_task("arithmetic"), backend, tokenizer, range(episodes), loop,
                                      seed=1_000_003, concurrency=64, progress=False))
    return sum(t.success for t in played) / len(played)


KEPT = ("success", "reward", "time/step_s", "time/idle_s", "time/train_s", "producer/episodes_per_s",
        "episodes/dropped_stale", "staleness/mean", "staleness/max", "mismatch/kl_k3", "loss", "grad_norm")


def compact(raw):
    """``raw`` with each step's metrics cut to KEPT (the JSON file stays small)."""
    if isinstance(raw, dict):
        return {k: compact(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [({k: m[k] for k in KEPT if k in m} if isinstance(m, dict) and "time/step_s" in m else compact(m))
                for m in raw]
    return raw


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


class LoadSampler:
    """The machine's 1-minute load average, sampled every ``every_s`` seconds on a thread while in use."""

    def __init__(self, every_s: float = 10.0):
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def describe(self) -> str:
        s = sorted(self.samples)
        return (f"{os.cpu_count()} cores; 1-minute load average during the run: median {s[len(s) // 2]:.1f}, "
                f"range {s[0]:.1f}-{s[-1]:.1f} ({len(s)} samples)")


def throughput(args, scratch: Path) -> tuple[str, dict]:
    steps = args.steps or 20
    rows, raw = [], {}
    for tools, task in (("heavy-tailed latency", HeavyTailedTools()), ("built-in", get_task("arithmetic"))):
        base = None
        for name in ("K=0", "K=1", "K=2"):
            history, _ = train(scratch, f"tp-{tools[:5]}-{name}", task, steps, args.prompts_per_step, **SETTINGS[name])
            raw[f"{tools} {name}"] = history
            wall = mean(m["time/step_s"] for m in history)
            base = base or wall
            rows.append((tools, name, wall, wall / base, mean(m["time/idle_s"] for m in history),
                         steps * args.prompts_per_step / sum(m["time/step_s"] for m in history),
                         mean(m["producer/episodes_per_s"] for m in history),
                         sum(m["episodes/dropped_stale"] for m in history),
                         mean(m["staleness/mean"] for m in history)))
            print(f"{tools:22s} {name}: {wall:.2f} s/step ({wall / base:.2f}x K=0)", flush=True)
    lines = [f"Throughput: {steps} steps x {args.prompts_per_step} episodes, tiny agent mid, 1 thread per thread",
             "", "| tools | K | wall time per step (s) | vs K=0 | trainer idle per step (s) | trained episodes/s | "
             "producer episodes/s | dropped stale | mean staleness |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {t} | {k} | {w:.2f} | {r:.2f}x | {i:.2f} | {e:.1f} | {p:.1f} | {d:.0f} | {s:.2f} |"
              for t, k, w, r, i, e, p, d, s in rows]
    return "\n".join(lines), raw


def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    return [mean(values[max(0, i + 1 - window): i + 1]) for i in range(len(values))]


def reach(history: list[dict], target: float) -> tuple[float, int] | None:
    """The wall time (s) and step at which the mean training success of the last ``WINDOW`` steps first reaches
    ``target`` (from step ``WINDOW`` on: a whole window), or None."""
    wall, smooth = 0.0, running_mean([m["success"] for m in history])
    for step, (metrics, value) in enumerate(zip(history, smooth), start=1):
        wall += metrics["time/step_s"]
        if step >= WINDOW and value >= target:
            return wall, step
    return None


def spread(values: list[float], digits: int = 3) -> str:
    return f"{mean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def curves(args, scratch: Path) -> tuple[str, dict]:
    from agent_loop import TrainConfig

    steps, prompts = args.steps or 80, 2 * args.prompts_per_step
    names = ["K=0", "K=1"] + (["K=1 + IS"] if "rollout_is" in TrainConfig.__dataclass_fields__ else [])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    start = None
    for seed in args.seeds:
        for name in names:
            history, policy = train(scratch, f"lc-{seed}-{name}", HeavyTailedTools(), steps, prompts, seed=seed,
                                    mini_batches=1, **SETTINGS[name])
            if start is None:
                from transformers import AutoModelForCausalLM

                from agent_loop.tiny import tiny_agent_path

                start = held_out_success(AutoModelForCausalLM.from_pretrained(tiny_agent_path(stage="mid")),
                                         args.eval_episodes)
            end = held_out_success(policy, args.eval_episodes)
            runs[name].append({"seed": seed, "history": history, "held_out_end": end})
            print(f"seed {seed} {name}: {sum(m['time/step_s'] for m in history):.0f} s, held-out {start:.3f} -> "
                  f"{end:.3f}", flush=True)
    target = mean(mean(m["success"] for m in run["history"][-WINDOW:]) for run in runs["K=0"])
    lines = [f"Learning curves: {len(args.seeds)} seeds, {steps} steps x {prompts} episodes (one AdamW step each), "
             "heavy-tailed tool latency; "
             f"held-out sampled success on {args.eval_episodes} questions (start {start:.3f}); target = K=0's final "
             f"training success (mean of its last {WINDOW} steps, over seeds) = {target:.3f}", "",
             f"| setting | training success, first {WINDOW} -> last {WINDOW} steps | held-out sampled at the end | "
             "wall time (s) | per step vs K=0 | reaches the target at (s) | at step | vs K=0 |",
             "|---|---|---|---|---|---|---|---|"]
    base, base_wall = None, None
    for name in names:
        first = [mean(m["success"] for m in r["history"][:WINDOW]) for r in runs[name]]
        last = [mean(m["success"] for m in r["history"][-WINDOW:]) for r in runs[name]]
        walls = [sum(m["time/step_s"] for m in r["history"]) for r in runs[name]]
        base_wall = base_wall or mean(walls)
        reached = [reach(r["history"], target) for r in runs[name]]
        known = [r for r in reached if r is not None]
        when = f"{mean(t for t, _ in known):.0f} ({len(known)} of {len(reached)} seeds)" if known else "never"
        at_step = f"{mean(s for _, s in known):.0f}" if known else "-"
        base = base or (mean(t for t, _ in known) if known else None)
        ratio = f"{mean(t for t, _ in known) / base:.2f}x" if known and base else "-"
        lines.append(f"| {name} | {spread(first)} -> {spread(last)} | {spread([r['held_out_end'] for r in runs[name]])} "
                     f"| {spread(walls, 0)} | {mean(walls) / base_wall:.2f}x | {when} | {at_step} | {ratio} |")
    return "\n".join(lines), {"start": start, "target": target, "window": WINDOW, "runs": runs}


def plot(raw: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for color, (name, runs) in zip(("C0", "C1", "C2"), raw["runs"].items()):
        for k, run in enumerate(runs):
            wall, xs = 0.0, []
            for metrics in run["history"]:
                wall += metrics["time/step_s"]
                xs.append(wall)
            axis.plot(xs, running_mean([m["success"] for m in run["history"]]), color=color, alpha=0.8,
                      label=name if k == 0 else None)
    axis.axhline(raw["target"], color="grey", linestyle="--", label=f"K=0 final (mean of last {WINDOW} steps)")
    axis.set_xlabel("wall time (s)")
    axis.set_ylabel(f"training success ({WINDOW}-step running mean)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    args = parse_args()
    from agent_loop.tiny.build import RECIPE_VERSION

    tables, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="async-bench-") as scratch, LoadSampler() as load:
        if args.part in ("both", "throughput"):
            table, raw["throughput"] = throughput(args, Path(scratch))
            tables.append(table)
            print("\n" + table + "\n", flush=True)
        if args.part in ("both", "curves"):
            table, raw["curves"] = curves(args, Path(scratch))
            tables.append(table)
            print("\n" + table + "\n", flush=True)
    tables.insert(0, f"tiny agent recipe {RECIPE_VERSION}, {time.strftime('%Y-%m-%d')}; {load.describe()}")
    raw["load_average"] = load.samples
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.md").write_text("\n\n".join(tables) + "\n")
        Path(f"{args.out}.json").write_text(json.dumps(compact(raw)))
        if "curves" in raw:
            plot(raw["curves"], Path(f"{args.out}.png"))
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
