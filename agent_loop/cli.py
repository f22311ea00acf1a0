"""``agent-loop`` command line: ``rollout``, ``inspect``, ``train``."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agent_loop.config import add_config_argument, parse_with_config
from agent_loop.loop import LoopConfig


def add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that plays episodes."""
    parser.add_argument("--task", default=None,
                        help="built-in task (arithmetic, default; lookup), package.module:Name or file.py[:Name]")
    add_plugin_arguments(parser)
    parser.add_argument("--model", default=None, help="model dir (default: the built-in tiny agent)")
    parser.add_argument("--backend", default="hf", choices=["hf", "vllm", "http"])
    parser.add_argument("--server", action="append", default=[], help="OpenAI-compatible base URL (http backend)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16)
    defaults = LoopConfig()
    for name in ("max_turns", "max_response_tokens", "max_tokens", "max_observation_tokens",
                 "max_parallel_tool_calls", "tool_timeout_s", "temperature", "top_p", "top_k"):
        value = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)


def add_plugin_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompts/--reward/--reward-weights/--tools/--system: a task from data (agent_loop.plugins)."""
    parser.add_argument("--prompts", default=None, help="prompts file: .jsonl, .parquet or a saved HF dataset folder")
    parser.add_argument("--reward", action="append", default=[],
                        help="reward of --prompts: exact, number, contains, regex:PATTERN or module:function (repeatable)")
    parser.add_argument("--reward-weights", type=float, nargs="+", default=None, help="one weight per --reward")
    parser.add_argument("--tools", default=None, help="tools of --prompts: a module or .py file of functions")
    parser.add_argument("--system", default=None, help="system prompt for --prompts episodes")


def task_from_args(args: argparse.Namespace):
    """The task the options name; exits with the reason if it cannot be loaded."""
    from agent_loop.plugins import PluginError, task_from_options

    try:
        return task_from_options(args.task, args.prompts, args.tools, args.reward, args.reward_weights, args.system)
    except PluginError as error:
        raise SystemExit(f"agent-loop: {error}") from None


def check_model(model_path: str, backend: str):
    """The model's tokenizer, after checking the folder (agent_loop.models); exits with every problem found
    before anything expensive starts."""
    from agent_loop.models import ModelError, check_model_dir

    try:
        return check_model_dir(model_path, backend).tokenizer
    except ModelError as error:
        raise SystemExit(f"agent-loop: {error}") from None


def loop_config_from(args: argparse.Namespace) -> LoopConfig:
    names = LoopConfig.__dataclass_fields__
    return LoopConfig(**{k: v for k, v in vars(args).items() if k in names})


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from agent_loop.tiny import tiny_agent_path

    return str(tiny_agent_path())


def make_backend(args: argparse.Namespace, model_path: str):
    """The backend named by ``--backend``, built over ``model_path``."""
    if args.backend == "hf":
        from agent_loop.backends.hf import TransformersBackend

        return TransformersBackend(model_path)
    if args.backend == "vllm":
        from agent_loop.backends.vllm_engine import VLLMEngineBackend

        return VLLMEngineBackend(model_path)
    from agent_loop.backends.openai_http import OpenAIHTTPBackend

    if not args.server:
        raise SystemExit("--backend http needs at least one --server URL")
    return OpenAIHTTPBackend(args.server, model=model_path)


def summary_table(trajectories, title: str) -> Table:
    """Success, reward, turns, token counts, finish reasons and tool errors of a batch of episodes."""
    n = len(trajectories)
    finish = Counter(t.finish_reason for t in trajectories)
    errors = Counter()
    for t in trajectories:
        errors.update(t.metrics.get("tool_errors", {}))
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("episodes", f"{n}"),
        ("success rate", f"{sum(bool(t.info.get('success')) for t in trajectories) / n:.3f}"),
        ("mean reward", f"{sum(t.reward for t in trajectories) / n:.3f}"),
        ("mean turns", f"{sum(t.metrics['turns'] for t in trajectories) / n:.2f}"),
        ("assistant tokens / episode", f"{sum(t.metrics['assistant_tokens'] for t in trajectories) / n:.1f}"),
        ("observation tokens / episode", f"{sum(t.metrics['observation_tokens'] for t in trajectories) / n:.1f}"),
        ("tool calls / episode", f"{sum(t.metrics['tool_calls'] for t in trajectories) / n:.2f}"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in finish.most_common())),
        ("tool errors", ", ".join(f"{k} {v}" for k, v in errors.most_common()) or "none"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def returns_table(trajectories, pad_token_id: int, gamma: float) -> Table:
    """Collate the batch and show what carry-through REINFORCE++ gives the assistant tokens."""
    from advantages import reinforce_plus_plus
    from agent_loop.collate import trajectories_to_batch

    batch = trajectories_to_batch(trajectories, pad_token_id=pad_token_id)
    adv, returns = reinforce_plus_plus(batch["token_level_rewards"], batch["response_mask"], gamma, spans=batch["spans"])
    mask = batch["response_mask"].bool()
    table = Table(title=f"batch tensors and REINFORCE++ (carry-through, gamma={gamma})")
    table.add_column("tensor")
    table.add_column("value", justify="right")
    table.add_row("responses shape (b, t)", str(tuple(batch["responses"].shape)))
    table.add_row("ASSISTANT / OBSERVATION / PAD tokens",
                  " / ".join(str(int((batch["spans"] == k).sum())) for k in (1, 2, 0)))
    table.add_row("mean return on ASSISTANT tokens", f"{returns[mask].mean():.4f}")
    table.add_row("first-turn ASSISTANT tokens with nonzero return",
                  f"{int(((batch['turn_ids'] == 0) & mask & (returns != 0)).sum())}")
    table.add_row("advantage mean / std (ASSISTANT)", f"{adv[mask].mean():.3f} / {adv[mask].std():.3f}")
    table.add_row("max |return| on OBSERVATION/PAD", f"{returns.masked_fill(mask, 0).abs().max():.1f}")
    return table


def cmd_rollout(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from agent_loop.config import save_resolved_config
    from agent_loop.runner import run_rollouts

    console = Console()
    task = task_from_args(args)
    model_path = resolve_model(args)
    tokenizer = check_model(model_path, args.backend) if args.model else AutoTokenizer.from_pretrained(model_path)
    backend = make_backend(args, model_path)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")  # a fresh file per run; episodes are appended as they finish
    saved = save_resolved_config(args, args.parser, out.with_name(out.stem + ".config.yaml"))
    started = time.perf_counter()
    trajectories = asyncio.run(run_rollouts(
        task, backend, tokenizer, range(args.episodes), loop_config_from(args),
        seed=args.seed, concurrency=args.concurrency, output_path=out,
    ))
    elapsed = time.perf_counter() - started
    console.print(summary_table(trajectories, f"{task.name} rollout"))
    assistant_tokens = sum(t.metrics["assistant_tokens"] for t in trajectories)
    console.print(f"{len(trajectories) / elapsed:.2f} episodes/s, {assistant_tokens / elapsed:.0f} assistant tokens/s "
                  f"({elapsed:.1f} s, concurrency {args.concurrency}, backend {args.backend}, model {model_path})")
    console.print(returns_table(trajectories, tokenizer.pad_token_id or 0, args.gamma))
    console.print(f"wrote {len(trajectories)} trajectories to {out}  (look inside: agent-loop inspect {out}); "
                  f"settings: {saved}")
    return 0


def cmd_inspect(argv: list[str]) -> int:
    from agent_loop.inspect import main as inspect_main

    return inspect_main(argv)


def cmd_train(argv: list[str]) -> int:
    from trainer.cli import main as train_main

    return train_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # inspect and train own their options; hand them the rest of the command line unchanged
    delegated = {"inspect": cmd_inspect, "train": cmd_train}
    if argv and argv[0] in delegated:
        return delegated[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(prog="agent-loop", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    rollout = commands.add_parser("rollout", help="play episodes and write them as JSON Lines")
    add_loop_arguments(rollout)
    rollout.add_argument("--episodes", type=int, default=64)
    rollout.add_argument("--out", default="runs/rollouts.jsonl")
    rollout.add_argument("--gamma", type=float, default=1.0)
    add_config_argument(rollout)
    rollout.set_defaults(run=cmd_rollout, parser=rollout)
    commands.add_parser("inspect", help="see spans, rewards, returns and advantages token by token (--help)")
    commands.add_parser("train", help="train the policy with RL on a task (--help)")

    args = parse_with_config(parser, argv, target=rollout)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
