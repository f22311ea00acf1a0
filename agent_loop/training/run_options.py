"""The options every training recipe shares (``train``, ``warmstart``), each declared once: AdamW and its schedule
(:class:`OptimizerOptions`), the run's folder and reports (:class:`OutputOptions`), the device
(:class:`DeviceOptions`) and the run's length (:class:`StepsOptions`). Importing it does not import torch (the CLI
lists every command at start).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import AfterValidator, Field

from agent_loop.options import ProgressOptions, integer, number
from agent_loop.runners.outputs import fresh_path

# The learning rate measured stable on the tiny agent at 32 episodes per AdamW step; smaller batches scale it
# down in proportion (their gradients are noisier, and Adam's steps do not shrink with the signal).
BASE_LR = 2e-4
BASE_EPISODES_PER_ADAM_STEP = 32
# The warm start's: the tiny agent (1.1M parameters, trained from scratch at 3e-3) learns a new task's format and
# copies at its own training rate (BENCHMARKS.md, issue 29). A pretrained model: 1e-4, measured on SmolLM2-135M
# (benchmarks/warmstart_lr.py, BENCHMARKS.md issue 49: held-out sampled success 1.00 on arithmetic and lookup at
# 1e-4, 0.50 on arithmetic at 1e-5).
TINY_LR, MODEL_LR, MIN_LR_FRACTION = 3e-3, 1e-4, 0.1
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> torch dtype name


def check_device(name: str) -> str:
    if not (name in ("auto", "cpu") or name.split(":")[0] == "cuda"):
        raise ValueError("must be auto, cpu, cuda or cuda:N")
    return name


@dataclass
class OptimizerOptions:
    """AdamW and its schedule, for every command that trains (train, warmstart). ``learning_rate``: ``lr``, or
    the command's :meth:`default_lr` when unset; ``resolved()``: the settings as the run uses them."""

    lr: Annotated[float | None, Field(gt=0, description=(
        "AdamW learning rate (the peak, after --warmup-steps); unset: train scales "
        f"{BASE_LR:g} to the batch ({BASE_LR:g} x episodes per AdamW step / {BASE_EPISODES_PER_ADAM_STEP}, at most "
        f"{BASE_LR:g}); warmstart takes {TINY_LR:g} for the built-in tiny agent (unset --model), {MODEL_LR:g} for a "
        f"--model, and decays it on a cosine to {MIN_LR_FRACTION:g} of the peak"))] = None
    warmup_steps: integer("steps over which the learning rate rises linearly to --lr; Adam's first, "
                          "bias-corrected steps are full-size sign steps, which noisy small batches turn into "
                          "random moves of every weight (0 = off)", 0) = 10
    weight_decay: number("AdamW weight decay", ge=0) = 0.0
    max_grad_norm: number("gradient clipping norm", gt=0) = 1.0
    micro_batch_size: integer("rows per forward/backward (gradient accumulation within an optimizer step)") = 16

    def default_lr(self) -> float:
        raise NotImplementedError(f"{type(self).__name__} names no default learning rate")

    @property
    def learning_rate(self) -> float:
        """``lr`` when set, else the command's :meth:`default_lr`."""
        return self.lr if self.lr is not None else self.default_lr()

    def resolved(self) -> dict:
        """Every setting with the values the run uses (the learning rate chosen): the saved config."""
        return {**dataclasses.asdict(self), "lr": self.learning_rate}


@dataclass
class OutputOptions(ProgressOptions):
    """The run's folder and how the run reports, for every command that writes one (train, warmstart); the
    progress bar's option is every command's (:class:`~agent_loop.options.ProgressOptions`)."""

    DEFAULT_OUTPUT_DIR: ClassVar[str] = "runs/run"  # each command's own: runs/train, runs/warmstart

    output_dir: Annotated[str | None, Field(description=(
        "the run's folder: metrics.jsonl, config.yaml and what the command makes (train: checkpoints/; warmstart: "
        "model/, demonstrations.jsonl); unset: runs/COMMAND (runs/train, runs/warmstart) or the first free "
        "runs/COMMAND-N (train --resume: the resumed run's folder); a folder holding an earlier run is refused "
        "without --overwrite (train: or --resume)"), json_schema_extra={"allowed": "a folder path"})] = None
    overwrite: Annotated[bool, Field(description="replace the earlier run in --output-dir (its files are deleted "
                                     "first)")] = False
    save_every: integer("steps between checkpoints (OUTPUT_DIR/checkpoints; and one at the end): a stopped run goes "
                        "on from the latest complete one with --resume") = 20

    def default_output_dir(self) -> str:
        """Never an earlier run's folder: DEFAULT_OUTPUT_DIR, or the first free DEFAULT_OUTPUT_DIR-N."""
        return fresh_path(self.DEFAULT_OUTPUT_DIR)


@dataclass
class DeviceOptions:
    """Where the model trains (train, warmstart)."""

    device: Annotated[str, AfterValidator(check_device), Field(
        description="auto: CUDA when available (cuda:LOCAL_RANK under torchrun), else cpu",
        json_schema_extra={"allowed": "auto, cpu, cuda or cuda:N"})] = "auto"


@dataclass
class StepsOptions:
    """How long a run trains (train, warmstart; declared once)."""

    steps: Annotated[int | None, Field(ge=1, description=(
        "steps to train: train's RL steps (each plays a batch, then --ppo-epochs x --mini-batches AdamW steps); "
        "warmstart's AdamW steps (unset: --epochs passes over the demonstrations)"),
        json_schema_extra={"allowed": "an integer >= 1 (warmstart: or unset)"})] = None


def run_folder_of(resume: str) -> str:
    """The run folder a ``--resume`` folder names: OUTPUT_DIR, OUTPUT_DIR/checkpoints or
    OUTPUT_DIR/checkpoints/step_N."""
    path = Path(resume)
    if path.name == "checkpoints":
        return str(path.parent)
    return str(path.parent.parent if path.parent.name == "checkpoints" else path)
