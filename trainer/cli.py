"""``agent-loop train``: every ``TrainConfig`` field is an option (``--prompts-per-step 16``, ``--no-progress``).

Options are checked first (values, then the model folder, ``--resume`` and ``--output-dir``); a bad one
is one line on stderr naming the option, exit status 2, before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from agent_loop import options, preflight
from agent_loop.options import USAGE_EXIT, UsageError
from trainer.config import TrainConfig, validate_values

STATE_FILE = "trainer_state.pt"  # trainer.trainer.STATE_FILE (not imported: that module loads torch and transformers)


def build_parser(prog: str = "agent-loop train") -> argparse.ArgumentParser:
    """One option per TrainConfig field, plus the plug-in options (a task from data) and ``--config``."""
    from agent_loop.cli import add_plugin_arguments
    from agent_loop.config import add_config_argument

    parser = options.build_parser(
        TrainConfig, prog,
        "Train an agent with multi-turn tool-calling rollouts and PPO-clip "
        "(defaults: the built-in tiny agent's middling warm start on the arithmetic task, 2 CPU threads).")
    add_plugin_arguments(parser)
    add_config_argument(parser)
    return parser


def validate(values: dict, *, keys: bool = False) -> TrainConfig:
    """A checked TrainConfig (see :func:`trainer.config.validate_values`)."""
    return validate_values(values, keys=keys)


def preflight_train(config: TrainConfig) -> None:
    """The model folder, the checkpoint to resume, the output folder and wandb (when asked for) are usable. Reads only."""
    if config.model is not None:
        preflight.check_model_dir(config.model, "hf")
    if config.resume is not None:
        resume = Path(config.resume)
        if not resume.is_dir():
            raise UsageError(f"--resume {config.resume}: no such folder (give a checkpoint folder, "
                             "OUTPUT_DIR/checkpoints/step_NNNNNN)")
        if (resume / "checkpoints").is_dir():
            pass  # a run folder: the trainer picks its latest complete checkpoint (trainer.checkpoint)
        elif not (resume / STATE_FILE).is_file():
            raise UsageError(f"--resume {config.resume}: not a checkpoint (no {STATE_FILE}; give "
                             "OUTPUT_DIR/checkpoints/step_NNNNNN or a run's OUTPUT_DIR)")
        else:
            preflight.check_model_dir(str(resume / "model"), "hf", option="--resume")
    preflight.check_output_dir(config.output_dir)
    if config.wandb_project is not None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UsageError(f"--wandb-project {config.wandb_project}: wandb is not installed (pip install wandb)") from None


def main(argv: list[str] | None = None) -> int:
    """Parse and check ``argv``, train, print where the metrics and checkpoints went; exit status 0 (2: usage).

    ``--nproc N`` (N > 1) outside torchrun relaunches this command in N processes under torchrun;
    under torchrun (``WORLD_SIZE`` set) every process trains its share and rank 0 prints."""
    prog = "agent-loop train"
    argv = sys.argv[1:] if argv is None else argv
    try:
        from agent_loop.cli import parse_command

        parser = build_parser(prog)
        args, config, task = parse_command(parser, list(argv), TrainConfig.task, validate)
        preflight_train(config)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_EXIT
    if config.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from trainer.distributed import relaunch_under_torchrun

        return relaunch_under_torchrun(config.nproc, list(argv))

    from trainer.checkpoint import CheckpointError
    from trainer.distributed import close_data_parallel
    from trainer.trainer import Trainer

    started = time.perf_counter()
    try:
        try:
            trainer = Trainer(config, task=task)
        except CheckpointError as error:  # an incomplete checkpoint or changed settings: a message, not a traceback
            raise SystemExit(f"agent-loop train: {error}") from None
        if trainer.dp.is_main:
            from agent_loop.config import save_resolved_config

            save_resolved_config(args, parser, trainer.output_dir / "config.yaml")  # rerun with --config
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
