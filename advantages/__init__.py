"""Carry-through returns and advantage estimators for multi-turn RL (docs/design.md section 3). Depends on torch only."""

from advantages.estimators import (
    ESTIMATORS,
    get_estimator,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from advantages.losses import aggregate_loss, kl_penalty, ppo_clip_policy_loss
from advantages.returns import discounted_returns, gae, returns_ignore_mask, returns_reset_at_observation
from advantages.stats import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ESTIMATORS",
    "aggregate_loss",
    "discounted_returns",
    "gae",
    "get_estimator",
    "grpo",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip_policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "returns_ignore_mask",
    "returns_reset_at_observation",
    "rloo",
]
