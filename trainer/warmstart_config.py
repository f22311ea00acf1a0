"""The options of a warm start (``agent-loop warmstart``, :mod:`trainer.warmstart`): one dataclass, whose
defaults fine-tune the built-in tiny agent on CPU (its torch threads by ``agent_loop.threads``).

It takes the task's options (``--task`` or ``--prompts ...``), the model and the seed
(:class:`~agent_loop.runners.spec.ModelOptions`), the threads, and the optimizer's, output's and device's
options it shares with ``train`` (``trainer.config``): each declared once, reused, not written again; the
rest is the fine-tune's. Importing it does not import torch (the CLI lists every command at start).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from agent_loop.config import integer, override_defaults
from agent_loop.runners.spec import ModelOptions
from agent_loop.tasks.registry import TaskOptions
from agent_loop.threads import ThreadOptions
from trainer.config import MIN_LR_FRACTION, MODEL_LR, TINY_LR, DeviceOptions, OptimizerOptions, OutputOptions

__all__ = ["MIN_LR_FRACTION", "MODEL_LR", "TINY_LR", "WarmstartConfig"]
DEFAULT_OUTPUT_DIR = "runs/warmstart"  # unset --output-dir: this, or the first free runs/warmstart-N


# a warm-start step is one batch's forward and backward (no rollouts): saving every 20 would cost more than it keeps
@override_defaults("warmstart's own: its steps are cheap (no rollouts), a checkpoint is not", save_every=100)
class WarmstartConfig(ThreadOptions, DeviceOptions, OutputOptions, OptimizerOptions, TaskOptions, ModelOptions):
    """Everything one warm start needs. The CLI exposes every field as ``--field-name``."""

    DEFAULT_OUTPUT_DIR: ClassVar[str] = DEFAULT_OUTPUT_DIR

    episodes: integer("demonstrations: the task's episodes 0 .. N-1 under --seed, each solved by its "
                      "demonstrate(episode, rng) hook (evaluate on another --seed)") = 256
    steps: Annotated[int | None, Field(ge=1, description="optimizer steps; unset: --epochs passes over the "
                                       "demonstrations")] = None
    epochs: Annotated[float, Field(gt=0, description="passes over the demonstrations when --steps is unset: steps = "
                                   "ceil(epochs x demonstrations / --batch-size); 37.5 gives the 600 steps x 16 of "
                                   "256 demonstrations that README's and BENCHMARKS.md's warm starts used")] = 37.5
    batch_size: integer("demonstrations per optimizer step (in a new random order every pass)") = 16
    resume: Annotated[bool, Field(description="go on from the latest complete checkpoint in --output-dir (a warm "
                                  "start that was stopped), with the same settings")] = False

    def default_lr(self) -> float:
        """:data:`TINY_LR` for the built-in tiny agent, :data:`MODEL_LR` for a ``--model``."""
        return TINY_LR if self.model is None else MODEL_LR

    def check(self) -> None:
        """The task's rules (OptionError); then the default ``output_dir``: never an earlier run's folder."""
        TaskOptions.check(self)
        if self.output_dir is None:
            self.output_dir = self.default_output_dir()
