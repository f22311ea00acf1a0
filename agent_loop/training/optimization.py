"""AdamW and the learning-rate schedule: one place for everything that trains (``train``, ``warmstart``, the
tiny agent's build through :mod:`agent_loop.training.finetune`).

The learning rate is a pure function of the 0-based step (:func:`lr_at`), set on the optimizer before each
step (:func:`set_lr`): a resumed run needs only its step to go on with the same rates, no scheduler state.

Every schedule warms up linearly over ``warmup_steps`` and then stays at the peak or decays on a half cosine.
What differs between the trainers is only where the warm-up starts counting, whether it decays, and (the tiny
agent's build alone) the rounding of the warm-up's product; each keeps its own, because its recorded results
were trained so (tests/training/test_warmstart_optimization.py checks them against plain formulas):

- ``train``: step ``s`` at ``(s + 1) / warmup_steps`` of the peak (its first step already moves), then the
  peak (no decay): ``lr_at(s, peak=..., warmup_steps=W)``;
- ``warmstart``: step ``s`` at ``s / warmup_steps`` (step 0 at 0), then a half cosine from the peak down to
  ``MIN_LR_FRACTION`` of it at the last step, exactly transformers'
  ``get_cosine_with_min_lr_schedule_with_warmup``: ``lr_at(s, ..., warmup_start=0, decay_steps=steps,
  min_fraction=MIN_LR_FRACTION)``;
- the tiny agent's build: train's warm-up and warmstart's cosine (to a tenth), the warm-up's rate computed
  product first (``multiply_first``): its shipped weights were trained with exactly these floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TRANSFORMERS_BETAS = (0.9, 0.999)  # torch's and transformers' AdamW default


@dataclass(frozen=True)
class OptimizerSettings:
    """What :func:`adamw` reads, for a trainer without command-line options (``OptimizerOptions`` has both)."""

    learning_rate: float
    weight_decay: float


def adamw(parameters, options, *, betas: tuple[float, float] = TRANSFORMERS_BETAS,
          decay_vectors: bool = True) -> torch.optim.AdamW:
    """AdamW over ``parameters`` with ``options``' learning rate and weight decay (``OptimizerOptions`` or
    :class:`OptimizerSettings`). ``decay_vectors=False``: weight decay on matrices only (``ndim >= 2``), none on
    norms and biases (a second parameter group, after the first)."""
    if decay_vectors:
        return torch.optim.AdamW(parameters, lr=options.learning_rate, weight_decay=options.weight_decay, betas=betas)
    parameters = list(parameters)
    groups = [{"params": [p for p in parameters if p.ndim >= 2], "weight_decay": options.weight_decay},
              {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=options.learning_rate, betas=betas)


def lr_at(step: int, *, peak: float, warmup_steps: int, warmup_start: int = 1, decay_steps: int | None = None,
          min_fraction: float = 1.0, multiply_first: bool = False) -> float:
    """The learning rate of 0-based ``step``.

    Warm-up: step ``s`` below ``warmup_steps`` runs at ``(s + warmup_start) / warmup_steps`` of ``peak``
    (``peak x ((s + warmup_start) / warmup_steps)``; with ``multiply_first``, ``peak x (s + warmup_start) /
    warmup_steps``, the product rounded first). After it, without ``decay_steps``: ``peak``; with it (the run's
    total steps): a half cosine from ``peak`` at step ``warmup_steps`` to ``min_fraction x peak`` at step
    ``decay_steps``."""
    if step < warmup_steps:
        if multiply_first:
            return peak * (step + warmup_start) / warmup_steps
        return peak * ((step + warmup_start) / warmup_steps)
    if decay_steps is None:
        return peak * 1.0
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * max(0.0, factor * (1 - min_fraction) + min_fraction)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Set every parameter group's learning rate to ``lr`` (before a step); returns it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
