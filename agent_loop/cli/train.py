"""``agent-loop train``: every ``TrainConfig`` field is an option (``--prompts-per-step 16``, ``--no-progress``).

Options are checked first (values, then the model folder, ``--resume`` and ``--output-dir``); a bad one
is one line on stderr naming the option, exit status 2, before any model is loaded. ``torchrun -m trainer``
runs :func:`main` in every process.

One output per run: ``--output-dir`` is locked for the life of the run (by the launcher, for its
``--nproc`` workers; ``agent_loop.runners.outputs``), and a folder holding an earlier run is refused
unless ``--resume`` or ``--overwrite``. A stop by SIGINT/SIGTERM or a write that fails (a full disk, a
file size limit) is one line naming the folder and the ``--resume`` command that goes on.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import agent_loop.cli.preflight as preflight
from agent_loop.cli.config_file import save_config
from agent_loop.cli.flags import UsageError, add_options, resolve, validate
from agent_loop.cli.output_claim import claim_output_dir
from agent_loop.cli.stops import go_on_command, run_command
from agent_loop.recipes.train_options import TrainConfig
from agent_loop.runners.outputs import HELD_ENV, OutputLockedError, RunLock, is_write_failure

PROG = "agent-loop train"
RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "tensorboard", "config.yaml", "weight_sync", "rollouts")  # what --overwrite deletes
DESCRIPTION = ("Train an agent with multi-turn tool-calling rollouts and PPO-clip (defaults: the built-in tiny "
               "agent's middling warm start on the arithmetic task; --threads torch threads, unset: OMP_NUM_THREADS or "
               "the cores the machine leaves idle).")


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("train", help="train the policy with RL on a task (--help)", description=DESCRIPTION)
    add_options(parser, TrainConfig)
    parser.set_defaults(run=run, prog=PROG)
    return parser


def options_from(values: dict, *, keys: bool = False) -> TrainConfig:
    """A checked TrainConfig from ``values`` (flags, or a config file's keys with ``keys=True``); UsageError."""
    return validate(TrainConfig, values, keys=keys)


def check_world(config: TrainConfig, task=None) -> None:
    """The output folder is not in use by a live run (first: its run may not have saved a checkpoint yet), then
    the model folder, the checkpoint to resume, the output folder and wandb (when asked for) are usable. Reads only."""
    run, sampler, output = config.run, config.sampler, config.output
    if not os.environ.get(HELD_ENV) and int(os.environ.get("RANK", "0")) == 0:  # as in claim_output
        try:
            RunLock(output.output_dir, folder=True).check_free()
        except OutputLockedError as error:
            raise UsageError(f"--output-dir {output.output_dir}: {error}") from None
    if run.model is not None:
        preflight.check_model_dir(run.model, "hf", task=task)
    if run.model is not None and sampler.backend == "vllm" and not sampler.server:  # asked for: vLLM must run it
        preflight.check_model_dir(run.model, "vllm", task=task)
        preflight.check_vllm_binding(run.threads)
    if output.resume is not None:
        preflight.check_resume(output.resume)
    preflight.check_output_dir(output.output_dir)
    if output.wandb_project is not None:
        try:
            import wandb  # noqa: F401  (optional: only whether it is installed)
        except ImportError:
            raise UsageError(f"--wandb-project {output.wandb_project}: wandb is not installed "
                             "(pip install wandb)") from None


def claim_output(config: TrainConfig) -> RunLock | None:
    """Lock ``--output-dir`` for this run and check it holds no earlier run (unless ``--resume``; ``--overwrite``
    deletes the earlier run's files first): ``agent_loop.cli.output_claim``. None in a worker of a launcher that
    holds the lock, and in torchrun ranks other than 0 (rank 0 holds it)."""
    if os.environ.get(HELD_ENV) or int(os.environ.get("RANK", "0")) != 0:
        return None
    return claim_output_dir(config.output.output_dir, keep=config.output.resume is not None, overwrite=config.output.overwrite,
                            remove=RUN_OUTPUTS,
                            refusal="holds an earlier run ({held}); pass --resume {folder} to continue it, "
                                    "--overwrite to replace it, or another --output-dir")


def go_on(config: TrainConfig, argv: list[str]) -> str:
    """The command that continues this run from its latest complete checkpoint."""
    return go_on_command(PROG, argv, drop={"--output-dir": True, "--resume": "?", "--overwrite": False},
                         add=["--output-dir", config.output.output_dir, "--resume", config.output.output_dir])


def stop_note(config: TrainConfig, argv: list[str]):
    """What a stop leaves behind: the complete checkpoints kept, and the command that goes on."""

    def note() -> str:
        steps = sorted((Path(config.output.output_dir) / "checkpoints").glob("step_*"))
        if not steps:
            again = go_on_command(PROG, argv, drop={"--output-dir": True, "--resume": "?", "--overwrite": False},
                                  add=["--output-dir", config.output.output_dir, "--overwrite"])
            return (f"no checkpoint was saved yet in {config.output.output_dir} (--save-every "
                    f"{config.output.save_every}); to start again: {again}")
        return (f"checkpoints up to {steps[-1].name} are in {config.output.output_dir}/checkpoints; to go on from the "
                f"latest complete one: {go_on(config, argv)}")

    return note


def run(args: argparse.Namespace) -> int:
    """Resolve and check the options, train, print where the metrics and checkpoints went; exit status 0.

    ``--nproc N`` (N > 1) outside torchrun relaunches this command in N processes under torchrun (their
    output folder locked here); under torchrun (``WORLD_SIZE`` set) every process trains its share and
    rank 0 prints."""
    config = resolve(TrainConfig, args)
    try:
        task = config.rollout.load()
    except ValueError as error:  # PluginError: a plug-in that cannot load
        raise UsageError(str(error)) from None
    check_world(config, task)
    argv = list(getattr(args, "argv", None) or [])
    lock = claim_output(config)
    args.stop_note = stop_note(config, argv)
    try:
        if config.run.nproc > 1 and "WORLD_SIZE" not in os.environ:
            # torch: the rollout path imports this module without it
            from agent_loop.training.distributed import relaunch_under_torchrun

            os.environ[HELD_ENV] = str(lock.path)  # the workers write into the folder this process holds
            return relaunch_under_torchrun(config.run.nproc, [*argv, "--output-dir", config.output.output_dir])
        return train(config, task)
    except OSError as error:
        if not is_write_failure(error):
            raise
        raise SystemExit(f"{PROG}: stopped: cannot write into {config.output.output_dir}: {error.strerror} "
                         f"({error.filename or 'a file'}); {stop_note(config, argv)()}") from None
    finally:
        if lock is not None:
            lock.release()


def train(config: TrainConfig, task) -> int:
    # torch: the rollout path imports this module without it
    from agent_loop.recipes.train import Trainer
    from agent_loop.training.checkpoint import CheckpointError, step_folder
    from agent_loop.training.distributed import close_data_parallel

    started, trainer, report = time.perf_counter(), None, []
    try:
        try:
            trainer = Trainer(config, task=task)
        except CheckpointError as error:  # an incomplete checkpoint or changed settings: a message, not a traceback
            raise SystemExit(f"{PROG}: {error}") from None
        if trainer.dp.is_main:
            save_config(config.resolved(), trainer.output_dir / "config.yaml")  # rerun with --config
        history = trainer.train()
        if trainer.dp.is_main:
            if history:
                report.append(f"trained steps {trainer.step - len(history) + 1}-{trainer.step} in "
                              f"{time.perf_counter() - started:.0f} s: {trainer.closing_line}")
            report += [f"metrics: {trainer.logger.path}", f"checkpoint: {step_folder(trainer.output_dir, trainer.step)}"]
    finally:
        # The trainer (its DDP reducer holds the process group) goes first, so that the group ends in
        # destroy_process_group, which releases the GIL. Ended by the reducer's dealloc instead, the group joins
        # gloo's threads with the GIL held while one of them, ending the last collective's work, waits for the GIL:
        # a rank that never exits, now and then (pytorch#56297; seen in CI and here as a 900 s hang of --nproc 2).
        trainer = None
        gc.collect()
        close_data_parallel()
    for line in report:
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``agent-loop train ARGV`` on its own (``python -m agent_loop.recipes``, ``torchrun -m agent_loop.recipes``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = add_options(argparse.ArgumentParser(prog=PROG, description=DESCRIPTION), TrainConfig)
    args = parser.parse_args(argv)
    args.argv, args.run = argv, run
    return run_command(PROG, args)

