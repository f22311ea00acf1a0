"""The options of a warm start (``agent-loop warmstart``, :mod:`trainer.warmstart`): one dataclass, whose
defaults fine-tune the built-in tiny agent on 2 CPU cores.

It takes the task's options (``--task`` or ``--prompts ...``) and, of the run's, the model and the seed
(their declarations are :class:`~agent_loop.runners.spec.RunOptions`' own, reused, not written again);
the rest is the fine-tune's. Importing it does not import torch (the CLI lists every command at start).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, Field

from agent_loop.runners.outputs import fresh_path
from agent_loop.runners.spec import RunOptions
from agent_loop.tasks.registry import TaskOptions
from trainer.config import check_device

# The tiny agent (1.1M parameters, trained from scratch at 3e-3) learns a new task's format and copies at its own
# training rate (BENCHMARKS.md, issue 29); pretrained models of 0.5B parameters and more take fine-tuning rates.
TINY_LR, MODEL_LR, MIN_LR_FRACTION = 3e-3, 1e-5, 0.1
DEFAULT_OUTPUT_DIR = "runs/warmstart"  # unset --output-dir: this, or the first free runs/warmstart-N
_RUN = typing.get_type_hints(RunOptions, include_extras=True)  # the run's declarations (type, constraint, help)
_MODEL, _SEED = _RUN["model"], _RUN["seed"]


def _int(low: int, text: str):
    return Annotated[int, Field(ge=low, description=text)]


def _number(text: str, **bounds):
    return Annotated[float, Field(description=text, **bounds)]


@dataclass
class WarmstartConfig(TaskOptions):
    """Everything one warm start needs. The CLI exposes every field as ``--field-name``."""

    model: _MODEL = None
    seed: _SEED = 0
    episodes: _int(1, "demonstrations: the task's episodes 0 .. N-1 under --seed, each solved by its "
                      "demonstrate(episode, rng) hook (evaluate on another --seed)") = 256
    steps: Annotated[int | None, Field(ge=1, description="optimizer steps; unset: --epochs passes over the "
                                       "demonstrations")] = None
    epochs: Annotated[float, Field(gt=0, description="passes over the demonstrations when --steps is unset: steps = "
                                   "ceil(epochs x demonstrations / --batch-size); 37.5 gives the 600 steps x 16 of "
                                   "256 demonstrations that README's and BENCHMARKS.md's warm starts used")] = 37.5
    batch_size: _int(1, "demonstrations per optimizer step (in a new random order every pass)") = 16
    save_every: Annotated[int, Field(ge=1, description="steps between checkpoints (OUTPUT_DIR/checkpoints, the "
                                     "latest kept): a stopped warm start goes on from it with --resume")] = 100
    resume: Annotated[bool, Field(description="go on from the latest complete checkpoint in --output-dir (a warm "
                                  "start that was stopped), with the same settings")] = False
    micro_batch_size: _int(1, "rows per forward/backward (gradient accumulation within a step)") = 16
    lr: Annotated[float | None, Field(gt=0, description=f"AdamW learning rate: the peak of a linear warm-up and a cosine "
                                      f"decay to {MIN_LR_FRACTION:g} of it; unset: {TINY_LR:g} for the built-in tiny "
                                      f"agent (unset --model), {MODEL_LR:g} for a --model")] = None
    warmup_steps: _int(0, "steps over which the learning rate rises linearly to its peak") = 10
    weight_decay: _number("AdamW weight decay", ge=0) = 0.0
    max_grad_norm: _number("gradient clipping norm", gt=0) = 1.0
    output_dir: Annotated[str | None, Field(description="the model (OUTPUT_DIR/model), metrics.jsonl (loss per step), "
                                            "demonstrations.jsonl (what it was trained on) and config.yaml go "
                                            f"here; unset: {DEFAULT_OUTPUT_DIR}, or the first free "
                                            f"{DEFAULT_OUTPUT_DIR}-N (a folder holding files is refused without "
                                            "--overwrite)", json_schema_extra={"allowed": "a folder path"})] = None
    overwrite: Annotated[bool, Field(description="replace what --output-dir holds (its files are deleted "
                                     "first)")] = False
    device: Annotated[str, AfterValidator(check_device), Field(
        description="auto: CUDA when available, else cpu", json_schema_extra={"allowed": "auto, cpu, cuda or cuda:N"})] = "auto"
    threads: _int(1, "torch intra-op threads") = 2
    progress: Annotated[bool, Field(description="progress bar")] = True

    @property
    def learning_rate(self) -> float:
        """``lr`` when set, else the default for the model (:data:`TINY_LR`, :data:`MODEL_LR`)."""
        if self.lr is not None:
            return self.lr
        return TINY_LR if self.model is None else MODEL_LR

    def resolved(self) -> dict:
        """Every setting with the values the run uses (the learning rate chosen): the saved config."""
        import dataclasses

        return {**dataclasses.asdict(self), "lr": self.learning_rate}

    def check(self) -> None:
        """The task's rules (OptionError); then the default ``output_dir``: never an earlier run's folder."""
        TaskOptions.check(self)
        if self.output_dir is None:
            self.output_dir = fresh_path(DEFAULT_OUTPUT_DIR)
