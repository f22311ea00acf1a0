"""``agent-loop train``: every ``TrainConfig`` field is an option (``--prompts-per-step 16``, ``--no-progress``).

Options are checked first (values, then the model folder, ``--resume`` and ``--output-dir``); a bad one
is one line on stderr naming the option, exit status 2, before any model is loaded. ``torchrun -m trainer``
runs :func:`main` in every process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import agent_loop.cli.preflight as preflight
from agent_loop.cli.config_file import save_config
from agent_loop.cli.options import USAGE_EXIT, UsageError, add_options, resolve, validate
from trainer.config import TrainConfig

PROG = "agent-loop train"
DESCRIPTION = ("Train an agent with multi-turn tool-calling rollouts and PPO-clip (defaults: the built-in tiny "
               "agent's middling warm start on the arithmetic task, 2 CPU threads).")


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("train", help="train the policy with RL on a task (--help)", description=DESCRIPTION)
    add_options(parser, TrainConfig)
    parser.set_defaults(run=run, prog=PROG)
    return parser


def options_from(values: dict, *, keys: bool = False) -> TrainConfig:
    """A checked TrainConfig from ``values`` (flags, or a config file's keys with ``keys=True``); UsageError."""
    return validate(TrainConfig, values, keys=keys)


def check_world(config: TrainConfig) -> None:
    """The model folder, the checkpoint to resume, the output folder and wandb (when asked for) are usable. Reads only."""
    if config.model is not None:
        preflight.check_model_dir(config.model, "hf")
    if config.resume is not None:
        preflight.check_resume(config.resume)
    preflight.check_output_dir(config.output_dir)
    if config.wandb_project is not None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UsageError(f"--wandb-project {config.wandb_project}: wandb is not installed (pip install wandb)") from None


def run(args: argparse.Namespace) -> int:
    """Resolve and check the options, train, print where the metrics and checkpoints went; exit status 0.

    ``--nproc N`` (N > 1) outside torchrun relaunches this command in N processes under torchrun;
    under torchrun (``WORLD_SIZE`` set) every process trains its share and rank 0 prints."""
    config = resolve(TrainConfig, args)
    try:
        task = config.load()
    except ValueError as error:  # PluginError: a plug-in that cannot load
        raise UsageError(str(error)) from None
    check_world(config)
    if config.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from trainer.distributed import relaunch_under_torchrun

        return relaunch_under_torchrun(config.nproc, args.argv)
    return train(config, task)


def train(config: TrainConfig, task) -> int:
    from trainer.checkpoint import CheckpointError
    from trainer.distributed import close_data_parallel
    from trainer.trainer import Trainer

    started = time.perf_counter()
    try:
        try:
            trainer = Trainer(config, task=task)
        except CheckpointError as error:  # an incomplete checkpoint or changed settings: a message, not a traceback
            raise SystemExit(f"{PROG}: {error}") from None
        if trainer.dp.is_main:
            save_config(config.resolved(), trainer.output_dir / "config.yaml")  # rerun with --config
        history = trainer.train()
    finally:
        close_data_parallel()
    if not trainer.dp.is_main:
        return 0
    if history:
        from trainer.metrics import progress_summary

        print(f"trained steps {trainer.step - len(history) + 1}-{trainer.step} in {time.perf_counter() - started:.0f} s: "
              f"{progress_summary(history)}")
    print(f"metrics: {trainer.logger.path}")
    print(f"checkpoint: {trainer.checkpoint_dir(trainer.step)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``agent-loop train ARGV`` on its own (``python -m trainer``, ``torchrun -m trainer``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = add_options(argparse.ArgumentParser(prog=PROG, description=DESCRIPTION), TrainConfig)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return run(args)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_EXIT

