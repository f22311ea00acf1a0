"""``agent-loop train``: every ``TrainConfig`` field is an option (``--prompts-per-step 16``, ``--no-progress``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from trainer.config import TrainConfig


def build_parser(prog: str = "agent-loop train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train an agent with multi-turn tool-calling rollouts and PPO-clip "
        "(defaults: the built-in tiny agent's middling warm start on the arithmetic task, 2 CPU threads).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = str if field.default is None else type(field.default)
            parser.add_argument(flag, type=kind, default=field.default, metavar=field.name.upper())
    from agent_loop.cli import add_plugin_arguments
    from agent_loop.config import add_config_argument

    add_plugin_arguments(parser)  # --prompts/--reward/--tools/--system: a task from data
    add_config_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, train, print where the metrics and checkpoints went; exit status 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    from agent_loop.config import parse_with_config, save_resolved_config
    from agent_loop.plugins import task_from_options

    parser = build_parser()
    args = parse_with_config(parser, argv)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    task_given = args.task != TrainConfig.task or any(a == "--task" or a.startswith("--task=") for a in argv)
    try:
        config.validate()
        task = task_from_options(args.task if task_given else None, args.prompts, args.tools, args.reward,
                                 args.reward_weights, args.system, default_task=TrainConfig.task)
        if config.model:
            from agent_loop.models import check_model_dir

            check_model_dir(config.model, "hf")
    except ValueError as error:  # PluginError and ModelError too
        raise SystemExit(f"agent-loop train: {error}") from None
    if args.prompts:
        config.task = task.name

    from trainer.trainer import Trainer

    started = time.perf_counter()
    trainer = Trainer(config, task=task)
    save_resolved_config(args, parser, trainer.output_dir / "config.yaml")
    history = trainer.train()
    if history:
        first, last = history[0], history[-1]
        print(f"trained steps {trainer.step - len(history) + 1}-{trainer.step} in {time.perf_counter() - started:.0f} s: "
              f"success {first['success']:.3f} -> {last['success']:.3f}")
    print(f"metrics: {trainer.logger.path}")
    print(f"checkpoint: {trainer.checkpoint_dir(trainer.step)}")
    return 0
