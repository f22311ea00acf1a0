"""AdamW and its learning-rate schedule from ``OptimizerOptions``: one place for every command that trains
(``train``, ``warmstart``).

The learning rate is a pure function of the 0-based step (:func:`lr_at`), set on the optimizer before each
step (:func:`set_lr`): a resumed run needs only its step to go on with the same rates, no scheduler state.

Both commands warm up linearly over ``warmup_steps``; they count it differently and decay differently, and
each keeps its own (their recorded results were trained so; tests/training/test_warmstart_optimization.py
checks both against plain formulas):

- ``train``: step ``s`` at ``(s + 1) / warmup_steps`` of the peak (its first step already moves), then the
  peak (no decay): ``lr_at(s, peak=..., warmup_steps=W)``;
- ``warmstart``: step ``s`` at ``s / warmup_steps`` (step 0 at 0), then a half cosine from the peak down to
  ``MIN_LR_FRACTION`` of it at the last step, exactly transformers'
  ``get_cosine_with_min_lr_schedule_with_warmup``: ``lr_at(s, ..., warmup_start=0, decay_steps=steps,
  min_fraction=MIN_LR_FRACTION)``.
"""

from __future__ import annotations

import math

import torch


def adamw(parameters, options) -> torch.optim.AdamW:
    """AdamW over ``parameters`` with ``options``' (``OptimizerOptions``) learning rate and weight decay."""
    return torch.optim.AdamW(parameters, lr=options.learning_rate, weight_decay=options.weight_decay)


def lr_at(step: int, *, peak: float, warmup_steps: int, warmup_start: int = 1, decay_steps: int | None = None,
          min_fraction: float = 1.0) -> float:
    """The learning rate of 0-based ``step``.

    Warm-up: step ``s`` below ``warmup_steps - warmup_start`` runs at ``(s + warmup_start) / warmup_steps`` of
    ``peak``. After it, without ``decay_steps``: ``peak``; with it (the run's total steps): a half cosine from
    ``peak`` at the end of warm-up to ``min_fraction x peak`` at step ``decay_steps``."""
    if step < warmup_steps - warmup_start:
        return peak * ((step + warmup_start) / max(1, warmup_steps))
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
