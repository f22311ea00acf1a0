"""The options of a warm start (``agent-loop warmstart``, :mod:`agent_loop.recipes.warmstart`): one dataclass, whose
defaults fine-tune the built-in tiny agent on CPU (its torch threads by ``agent_loop.threads``).

It takes the task's options (``--task`` or ``--prompts ...``), the model and the seed
(:class:`~agent_loop.runners.spec.ModelOptions`), the threads, and the optimizer's, output's and device's
options it shares with ``train`` (``agent_loop.recipes.train_options``): each declared once, reused, not written again; the
rest is the fine-tune's. Importing it does not import torch (the CLI lists every command at start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field

from agent_loop.options import OptionError, integer, override_defaults
from agent_loop.runners.spec import EpisodesOptions, ModelOptions, ResumeOptions
from agent_loop.tasks.registry import TaskOptions
from agent_loop.threads import ThreadOptions
from agent_loop.training.run_options import (
    MIN_LR_FRACTION,
    MODEL_LR,
    TINY_LR,
    DeviceOptions,
    OptimizerOptions,
    OutputOptions,
    StepsOptions,
    run_folder_of,
)

__all__ = ["MIN_LR_FRACTION", "MODEL_EPOCHS", "MODEL_LR", "TINY_EPOCHS", "TINY_LR", "WarmstartConfig"]
DEFAULT_OUTPUT_DIR = "runs/warmstart"  # unset --output-dir: this, or the first free runs/warmstart-N
# unset --epochs: the tiny agent's 600 steps x 16 of 256 demonstrations (issue 29); a pretrained model learns the
# format in a few passes at MODEL_LR (BENCHMARKS.md, "How long and how fast a real model's warm start", issue 49)
TINY_EPOCHS, MODEL_EPOCHS = 37.5, 2.5


# a warm-start step is one batch's forward and backward (no rollouts): saving every 20 would cost more than it keeps
@override_defaults({"save_every": "warmstart's own: its steps are cheap (no rollouts), a checkpoint is not",
                    "episodes": "warmstart's own: more demonstrations than rollout's episodes to look at"},
                   save_every=100, episodes=256)
class WarmstartConfig(ThreadOptions, DeviceOptions, OutputOptions, OptimizerOptions, TaskOptions, ResumeOptions,
                      StepsOptions, EpisodesOptions, ModelOptions):
    """Everything one warm start needs. The CLI exposes every field as ``--field-name``."""

    DEFAULT_OUTPUT_DIR: ClassVar[str] = DEFAULT_OUTPUT_DIR

    epochs: Annotated[float | None, Field(gt=0, description=(
        "passes over the demonstrations when --steps is unset: steps = ceil(epochs x demonstrations / --batch-size); "
        f"unset: {TINY_EPOCHS:g} for the built-in tiny agent (the 600 steps x 16 of 256 demonstrations that "
        "docs/bring_your_own.md's and BENCHMARKS.md's warm starts used), "
        f"{MODEL_EPOCHS:g} for a --model (BENCHMARKS.md, issue 49)"))] = None
    batch_size: integer("demonstrations per optimizer step (in a new random order every pass)") = 16
    check_episodes: integer("held-out questions of the task (another --seed stream, as train's evaluation) played "
                            "at the end, sampled at T=1, and their success printed: whether the warm start took "
                            "before RL; written to OUTPUT_DIR/check.jsonl (0 = skip)", low=0) = 16

    def default_lr(self) -> float:
        """:data:`TINY_LR` for the built-in tiny agent, :data:`MODEL_LR` for a ``--model``."""
        return TINY_LR if self.model is None else MODEL_LR

    @property
    def passes(self) -> float:
        """``epochs`` when set, else :data:`TINY_EPOCHS` for the built-in tiny agent, :data:`MODEL_EPOCHS` for a
        ``--model``: the passes over the demonstrations that set the steps when ``steps`` is unset."""
        if self.epochs is not None:
            return self.epochs
        return TINY_EPOCHS if self.model is None else MODEL_EPOCHS

    def check(self) -> None:
        """The task's rules (OptionError); then the default ``output_dir``: never an earlier run's folder."""
        TaskOptions.check(self)
        if isinstance(self.resume, str):  # a checkpoint or run folder: the warm start goes on in that run's folder
            folder = run_folder_of(self.resume)
            if self.output_dir is not None and Path(self.output_dir).resolve() != Path(folder).resolve():
                raise OptionError("resume", f"is a checkpoint of the run in {folder}, not of {{output_dir}} "
                                  f"{self.output_dir}: a warm start goes on in its own folder", self.resume)
            self.output_dir, self.resume = folder, True
        if self.output_dir is None:
            self.output_dir = self.default_output_dir()
