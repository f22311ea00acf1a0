"""Train the built-in tiny agent from its middling warm start on the arithmetic task, and watch it learn.

    python examples/train_tiny_agent.py                 # defaults of `agent-loop train`, 2 CPU threads
    python examples/train_tiny_agent.py --steps 20      # shorter

Prints one line per step (success rate of that step's sampled episodes, ...), a greedy evaluation on
held-out questions every few steps, and a summary: success over the first and the last steps, and
the wall time. Metrics go to ``<output-dir>/metrics.jsonl``, checkpoints to ``<output-dir>/checkpoints``.
"""

from __future__ import annotations

import argparse
import time

import torch

from agent_loop import TrainConfig, Trainer
from agent_loop.options import flatten


def summarize(history: list[dict], evals: list[tuple[int, float]], window: int) -> str:
    """Mean sampled success of the first and the last ``window`` steps, and the greedy evaluations."""
    first = sum(m["success"] for m in history[:window]) / min(window, len(history))
    last = sum(m["success"] for m in history[-window:]) / min(window, len(history))
    lines = [f"sampled success, mean of the first {window} steps: {first:.3f}; of the last {window} steps: {last:.3f}"]
    if evals:
        lines.append("greedy held-out success by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in evals))
    return "\n".join(lines)


def main() -> None:
    defaults = argparse.Namespace(**flatten(TrainConfig()))  # the options' defaults, by their flat names
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--model", default=None, help="model dir (default: the tiny agent's middling warm start)")
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-episodes", type=int, default=defaults.eval_episodes)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--output-dir", default="runs/train_tiny_agent")
    args = parser.parse_args()

    config = TrainConfig.from_flat(model=args.model, prompts_per_step=args.prompts_per_step, lr=args.lr,
                                   steps=args.steps, eval_every=args.eval_every, eval_episodes=args.eval_episodes,
                                   seed=args.seed, threads=args.threads, output_dir=args.output_dir, progress=False)
    started = time.perf_counter()
    trainer = Trainer(config)
    threads = torch.get_num_threads()  # what the Trainer resolved (agent_loop.threads): config.run.threads may be None
    history = trainer.train()  # one line per step: sampled success, reward, loss, ...; eval every few steps
    elapsed = time.perf_counter() - started
    print()
    print(summarize(history, trainer.eval_history, window=5))
    print(f"{len(history)} steps x {config.episodes_per_step} episodes in {elapsed:.0f} s "
          f"({elapsed / 60:.1f} min, {threads} threads)")


if __name__ == "__main__":
    main()
