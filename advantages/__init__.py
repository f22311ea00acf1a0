"""Carry-through returns, advantage estimators (one registry) and losses for multi-turn RL
(docs/design.md section 3; verl correspondence in docs/verl.md), and the sampler/trainer mismatch
correction (``correct_rollouts``). Depends on torch only.

The estimators' settings (``advantages.settings``) import without torch, so that the command line declares
its options from them without loading it; the rest loads torch on first use (PEP 562 lazy attributes), with
every built-in estimator registered then."""

import importlib

from advantages.settings import SETTINGS_CLASSES, TURN_LEVEL, DiscountSettings, GAESettings, GiGPOSettings

_MODULES = {
    "advantages.estimators": ("group_ids", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                              "reinforce_plus_plus_ignore_mask", "reinforce_plus_plus_reset_at_observation", "rloo"),
    "advantages.losses": ("KL_PENALTY_MODES", "LOSS_AGG_MODES", "POLICY_LOSSES", "aggregate_loss", "cispo_policy_loss",
                          "clipped_value_loss", "entropy_from_logits", "entropy_loss", "get_policy_loss_fn",
                          "gpg_policy_loss", "gspo_policy_loss", "kl_penalty", "ppo_clip_policy_loss",
                          "register_policy_loss", "reinforce_policy_loss"),
    "advantages.registry": ("ESTIMATORS", "AdvantageEstimator", "Estimator", "get_adv_estimator_fn", "get_estimator",
                            "register_adv_est"),
    "advantages.returns": ("discounted_returns", "gae", "returns_ignore_mask", "returns_reset_at_observation"),
    "advantages.rollout_correction": ("ROLLOUT_RS_OPTIONS", "RolloutCorrection", "compute_rollout_correction_weights",
                                      "compute_rollout_rejection_mask", "correct_rollouts", "masked_quantiles",
                                      "mismatch_metrics"),
    "advantages.sessions": ("estimate_by_session",),
    "advantages.stats": ("MIN_WHITEN_TOKENS", "WHITEN_EPS", "check_whitenable", "masked_mean", "masked_sum",
                         "masked_var", "masked_whiten", "whitenable"),
    "advantages.turn_credit": ("gigpo", "gigpo_anchor_groups", "turn_gae", "turn_ids_from_spans",
                               "turn_index_normalized", "turn_returns", "turn_rloo"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["SETTINGS_CLASSES", "TURN_LEVEL", "DiscountSettings", "GAESettings", "GiGPOSettings", *sorted(_LAZY)]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'advantages' has no attribute {name!r}")
    importlib.import_module("advantages.registry").register_built_in()  # ESTIMATORS holds every built-in one
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
