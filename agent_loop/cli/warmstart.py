"""``agent-loop warmstart``: fine-tune a model on a task's demonstrations, so that RL on the task starts from a
model that calls its tools (``agent_loop.recipes.warmstart``; every ``WarmstartConfig`` field is an option).

Options are checked first (values, the task and whether it has demonstrations, the model folder, the
output folder); a bad one is one line on stderr naming the option, exit status 2, before any model is
loaded; so is a demonstration that cannot be trained on (it names the episode and why). ``--output-dir`` is
locked for the life of the run, and a folder holding files is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

import agent_loop.cli.preflight as preflight
from agent_loop.cli.config_file import save_config
from agent_loop.cli.flags import UsageError, add_options, flag, resolve
from agent_loop.cli.output_claim import claim_output_dir
from agent_loop.cli.stops import go_on_command
from agent_loop.options import flatten
from agent_loop.recipes.train_options import TrainConfig
from agent_loop.recipes.warmstart_options import WarmstartConfig
from agent_loop.runners.outputs import RunLock
from agent_loop.tasks.registry import TaskOptions
from agent_loop.training.demonstrations import DemonstrationError, has_demonstrations

PROG = "agent-loop warmstart"
DESCRIPTION = ("Fine-tune a model on a task's demonstrations (its demonstrate(episode, rng) hook), loss on ASSISTANT "
               "tokens only, so that RL on the task starts from a model that calls its tools (defaults: the built-in "
               "tiny agent; --threads torch threads, unset: OMP_NUM_THREADS or the cores the machine leaves idle). "
               "Then: agent-loop rollout/train --task ... --model OUTPUT_DIR/model.")


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("warmstart", help="fine-tune on a task's demonstrations (--help)", description=DESCRIPTION)
    add_options(parser, WarmstartConfig)
    parser.set_defaults(run=run, prog=PROG)
    return parser


def task_flag(config: WarmstartConfig) -> str:
    """How the command line named the task: ``--task NAME`` or ``--prompts FILE``."""
    return f"--prompts {config.prompts}" if config.prompts is not None else f"--task {config.task}"


def task_argv(config: WarmstartConfig) -> list[str]:
    """Every task option this run set (``--prompts`` with its ``--reward``, ``--tools``, ``--system``, ...), as
    arguments that name the same task to ``rollout`` and ``train`` (which take the same TaskOptions)."""
    argv, default = [], TaskOptions()
    for field in dataclasses.fields(TaskOptions):
        value = getattr(config, field.name)
        if field.name == "task" and config.prompts is not None:
            continue  # a task from data: --prompts names it
        if field.name != "task" and value == getattr(default, field.name):
            continue
        if field.name == "reward_weights":  # one flag, several values
            argv += [flag(field.name), *map(str, value)]
        elif isinstance(value, list):  # repeatable: one flag per value
            argv += [part for item in value for part in (flag(field.name), str(item))]
        else:
            argv += [flag(field.name), str(value)]
    return argv


def load_checked_task(config: WarmstartConfig):
    """The task the options name, refused in one line if it cannot load or has no demonstrations."""
    try:
        task = config.load()
    except ValueError as error:  # PluginError: a plug-in that cannot load
        raise UsageError(str(error)) from None
    if not has_demonstrations(task):
        remedy = ("give it a demonstrate(episode, rng) method returning a solved episode's messages" if config.prompts is None
                  else "give its rows a 'demonstration' column (a solved episode's messages), or write the task as a "
                  "class with a demonstrate(episode, rng) method and pass it with --task")
        raise UsageError(f"{task_flag(config)}: task {task.name!r} has no demonstrations to warm-start on; {remedy} "
                         "(examples/custom_task.py)")
    return task


def claim_output(config: WarmstartConfig) -> RunLock:
    """Lock ``--output-dir`` and check it holds nothing (``--overwrite`` deletes what it holds first; ``--resume``
    goes on with it): ``agent_loop.cli.output_claim``, as train claims its folder."""
    if config.resume and config.overwrite:  # goes on from the checkpoint there: nothing is deleted
        raise UsageError("--resume and --overwrite exclude each other: --resume goes on with what --output-dir holds")
    return claim_output_dir(config.output_dir, keep=config.resume, overwrite=config.overwrite,
                            refusal="holds files ({held}); pass --overwrite to replace them, or another --output-dir")


def run(args: argparse.Namespace) -> int:
    """Resolve and check the options, warm-start, print what was made and the next commands; exit status 0."""
    config = resolve(WarmstartConfig, args)
    task = load_checked_task(config)
    if config.model is not None:
        preflight.check_model_dir(config.model, "hf", task=task)
    preflight.check_output_dir(config.output_dir)
    lock = claim_output(config)
    args.stop_note = stop_note(config, list(getattr(args, "argv", None) or []))
    try:
        if not config.resume:
            save_config(config.resolved(), Path(config.output_dir) / "config.yaml")  # rerun with --config
        return report(config, warm(config, task))
    finally:
        lock.release()


def stop_note(config: WarmstartConfig, argv: list[str]):
    """What a stop leaves: the latest checkpoint and the command that goes on from it, or that none was saved."""
    def note() -> str:
        saved = sorted((Path(config.output_dir) / "checkpoints").glob("step_*"))
        if not saved:
            return (f"no checkpoint was saved yet (--save-every {config.save_every}); {config.output_dir} holds what "
                    "was written so far")
        again = go_on_command(PROG, argv, drop={"--output-dir": True, "--resume": "?", "--overwrite": False},
                              add=["--output-dir", config.output_dir, "--resume"])
        return f"the latest checkpoint is {saved[-1]}; to go on from it: {again}"

    return note


def warm(config: WarmstartConfig, task):
    from agent_loop.recipes.warmstart import warm_start  # torch: the rollout path imports this module without it
    from agent_loop.training.checkpoint import CheckpointError  # torch: the rollout path imports this module without it

    try:
        return warm_start(config, task)
    except DemonstrationError as error:
        raise UsageError(f"{task_flag(config)}: {error}") from None
    except (FloatingPointError, CheckpointError) as error:
        raise SystemExit(f"{PROG}: {error}") from None


def report(config: WarmstartConfig, result) -> int:
    """The loss before and after, where everything went, budget warnings and the next commands."""
    history, model = result.history, result.model_dir
    k = max(1, min(5, len(history) // 2))
    first, last = (sum(m["loss"] for m in part) / k for part in (history[:k], history[-k:]))
    print(f"warm start on {len(result.demonstrations)} demonstrations, {len(history)} steps in {result.seconds:.0f} s: "
          f"loss {first:.3f} (mean of the first {k} steps) -> {last:.3f} (mean of the last {k})")
    print(f"model: {model}\nmetrics: {Path(config.output_dir) / 'metrics.jsonl'}\n"
          f"demonstrations: {Path(config.output_dir) / 'demonstrations.jsonl'} (agent-loop inspect shows them)")
    defaults = flatten(TrainConfig())
    longest = result.longest
    for need, option in (("turns", "max_turns"), ("response_tokens", "max_response_tokens"), ("turn_tokens", "max_tokens")):
        if longest[need] > defaults[option]:
            print(f"note: a demonstration needs {longest[need]} {need.replace('_', ' ')}, more than agent-loop train's "
                  f"default --{option.replace('_', '-')} {defaults[option]}; pass a larger one to train")
    if result.check:
        from agent_loop.recipes.warmstart import CHECK_FILE  # torch: the rollout path imports this module without it
        from agent_loop.training.held_out import check_line  # torch: the rollout path imports this module without it

        print(f"{check_line(result.check)}\n  (the episodes: {Path(config.output_dir) / CHECK_FILE}; --check-episodes "
              "sizes the check, 0 skips it)")
    task = shlex.join([*task_argv(config), "--model", str(model)])
    sharp = " --lr 5e-5  # a warm-started policy is sharp: a small RL step (BENCHMARKS.md)" if config.model is None else ""
    print(f"next: agent-loop rollout {task}\n      agent-loop train {task}{sharp}")
    return 0
