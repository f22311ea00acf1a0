"""``agent-loop train``: every ``TrainConfig`` field is an option (``--prompts-per-step 16``, ``--no-progress``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, train, print where the metrics and checkpoints went; exit status 0.

    ``--nproc N`` (N > 1) outside torchrun relaunches this command in N processes under torchrun;
    under torchrun (``WORLD_SIZE`` set) every process trains its share and rank 0 prints."""
    if argv is None:
        argv = sys.argv[1:]
    args = build_parser().parse_args(argv)
    config = TrainConfig(**vars(args))
    try:
        config.validate()
    except ValueError as error:
        raise SystemExit(f"agent-loop train: {error}") from None
    if config.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from trainer.distributed import relaunch_under_torchrun

        return relaunch_under_torchrun(config.nproc, list(argv))

    from trainer.distributed import close_data_parallel
    from trainer.trainer import Trainer

    started = time.perf_counter()
    try:
        trainer = Trainer(config)
        history = trainer.train()
    finally:
        close_data_parallel()
    if not trainer.dp.is_main:
        return 0
    if history:
        first, last = history[0], history[-1]
        print(f"trained steps {trainer.step - len(history) + 1}-{trainer.step} in {time.perf_counter() - started:.0f} s: "
              f"success {first['success']:.3f} -> {last['success']:.3f}")
    print(f"metrics: {trainer.logger.path}")
    print(f"checkpoint: {trainer.checkpoint_dir(trainer.step)}")
    return 0
