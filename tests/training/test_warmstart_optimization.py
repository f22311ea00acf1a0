"""The optimizer and learning-rate schedule of train, warmstart and the tiny agent's build
(agent_loop/training/optimization.py), one module for all three.

Checks: each one's sequence of learning rates equals a plain serial reference formula written here and
what it used before the shared module (warmstart: transformers' ``get_cosine_with_min_lr_schedule_with_warmup``
stepped on a real optimizer; train: ``PPO.lr_at``; the tiny agent: the formula its shipped weights were
trained with), bit for bit; the two commands' schedules are not the same (train's first step moves, warmstart's
does not; warmstart decays); AdamW takes the options' values, and the tiny agent's spares norms and biases.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from agent_loop.recipes.train_options import TrainConfig
from agent_loop.recipes.warmstart import lr_at as warmstart_lr_at
from agent_loop.recipes.warmstart_options import MIN_LR_FRACTION, WarmstartConfig
from agent_loop.training.optimization import OptimizerSettings, adamw, lr_at, set_lr
from agent_loop.training.tiny_agent import learning_rate as tiny_lr

WARMUPS = (0, 1, 3, 10)


def serial_train_lr(step: int, peak: float, warmup: int) -> float:
    """Train's rate written out: warm-up counted from 1 (step 0 already at peak / warmup), then flat."""
    if warmup <= 1:
        return peak
    fraction = (step + 1) / warmup
    return peak * fraction if fraction < 1 else peak


def serial_warmstart_lr(step: int, peak: float, warmup: int, total: int) -> float:
    """Warmstart's rate written out: warm-up from 0, then a half cosine from peak to MIN_LR_FRACTION x peak."""
    if step < warmup:
        return peak * (step / warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * (1 + math.cos(math.pi * progress)) / 2)


def serial_tiny_lr(step: int, total: int, peak: float, warmup: int = 30, floor: float = 0.1) -> float:
    """The tiny agent's rate as its shipped builds computed it: warm-up counted from 1, the product first, then
    the cosine to ``floor x peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize(("total", "peak"), [(1000, 3e-3), (150, 3e-3), (100, 1e-3), (40, 3e-3)])
def test_the_tiny_agents_rates_are_those_its_shipped_weights_were_trained_with(total, peak):
    """The default build (1000 steps) and the chain build's two phases (agent_loop.tiny.chain.PHASES), bit for bit."""
    assert [tiny_lr(s, total, peak=peak) for s in range(total + 1)] == [serial_tiny_lr(s, total, peak)
                                                                        for s in range(total + 1)]


def test_the_tiny_agents_adamw_decays_matrices_only():
    matrix, vector = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    optimizer = adamw([vector, matrix], OptimizerSettings(learning_rate=3e-3, weight_decay=0.01), betas=(0.9, 0.98),
                      decay_vectors=False)
    assert [([id(p) for p in g["params"]], g["weight_decay"], g["betas"]) for g in optimizer.param_groups] == [
        ([id(matrix)], 0.01, (0.9, 0.98)), ([id(vector)], 0.0, (0.9, 0.98))]


@pytest.mark.parametrize("warmup", WARMUPS)
def test_train_rates_equal_the_serial_formula_and_the_trainers(warmup):
    from agent_loop.training.ppo import PPO

    config = TrainConfig.from_flat(lr=2e-4, warmup_steps=warmup)
    ppo = SimpleNamespace(options=config.update)  # PPO.lr_at reads only the update's options
    for step in range(40):
        reference = serial_train_lr(step, 2e-4, warmup)
        assert lr_at(step, peak=2e-4, warmup_steps=warmup) == pytest.approx(reference, rel=1e-12, abs=0)
        assert lr_at(step, peak=2e-4, warmup_steps=warmup) == PPO.lr_at(ppo, step)  # bit for bit


@pytest.mark.parametrize("warmup", WARMUPS)
def test_warmstart_rates_equal_the_serial_formula_and_transformers_schedule(warmup):
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    steps, peak = 25, 3e-3
    config = WarmstartConfig(lr=peak, warmup_steps=warmup, steps=steps)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=peak)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, steps, min_lr_rate=MIN_LR_FRACTION)
    for step in range(steps):
        assert warmstart_lr_at(step, config) == schedule.get_last_lr()[0]  # what warm start used, bit for bit
        assert warmstart_lr_at(step, config) == pytest.approx(serial_warmstart_lr(step, peak, warmup, steps),
                                                              rel=1e-12, abs=1e-18)
        optimizer.step()
        schedule.step()
    assert warmstart_lr_at(steps, config) == pytest.approx(MIN_LR_FRACTION * peak)  # the cosine ends at its floor


def test_the_two_commands_schedules_differ_where_each_was_trained_so():
    train = [lr_at(s, peak=1.0, warmup_steps=4) for s in range(8)]
    warm = [warmstart_lr_at(s, WarmstartConfig(lr=1.0, warmup_steps=4, steps=8)) for s in range(8)]
    assert train[:4] == [0.25, 0.5, 0.75, 1.0] and train[4:] == [1.0] * 4
    assert warm[:5] == [0.0, 0.25, 0.5, 0.75, 1.0] and warm[5] < 1.0 and warm[7] > MIN_LR_FRACTION


def test_adamw_takes_the_options_values_and_set_lr_sets_every_group():
    options = WarmstartConfig(lr=5e-4, weight_decay=0.01)
    parameters = [torch.nn.Parameter(torch.ones(3))]
    optimizer = adamw(parameters, options)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == 5e-4 and optimizer.param_groups[0]["weight_decay"] == 0.01
    assert adamw(parameters, WarmstartConfig()).param_groups[0]["lr"] == WarmstartConfig().learning_rate
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    assert set_lr(optimizer, 1e-5) == 1e-5 and [g["lr"] for g in optimizer.param_groups] == [1e-5, 1e-5]
