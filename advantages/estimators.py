"""Advantage estimators with verl's argument names and order, registered in :mod:`advantages.registry`.

Every estimator returns ``(advantages, returns)``, both ``(b, t)`` in the rewards' dtype. Outcome
estimators (REINFORCE++-baseline, GRPO, RLOO) score a trajectory by the sum of its token-level
rewards and broadcast one advantage over its ASSISTANT tokens (exactly 0 elsewhere); groups (the
responses to one prompt) are given as ``index`` ``(b,)``: an integer tensor, or, as in verl, a
numpy array or list of ints or strings (uids). Group statistics use a sort and ``index_add_``: no
Python loop over groups or tokens, no host sync for tensor ids.

Positional arguments are verl's (``core_algos.compute_*_advantage``); our additions (``spans``,
``whiten``, ``validate``) are keyword-only.

Every estimator's advantages are exactly 0 off the ASSISTANT tokens, for any batch, with or without
``validate``. A whitened estimator (REINFORCE++, its baseline and ablations, GAE) needs 2 ASSISTANT
tokens: ``validate=True`` raises ``ValueError`` below that (as verl's ``masked_whiten``), and
``validate=False`` gives advantages exactly 0 everywhere (:mod:`advantages.stats` says why).
"""

import torch

from advantages.registry import AdvantageEstimator, register_adv_est
from advantages.returns import (
    check_batch,
    discounted_returns,
    gae,
    returns_ignore_mask,
    returns_reset_at_observation,
    whitened_discounted_returns,
)
from advantages.settings import DiscountSettings, GAESettings
from advantages.stats import accumulation_dtype, masked_whiten
from masking.sessions import dense_ids, row_ids

GRPO_EPS = 1e-6  # verl's default epsilon in the GRPO std normalisation


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS, settings=DiscountSettings)
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    *,
    spans: torch.Tensor | None = None,
    whiten: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): carry-through discounted returns, whitened over the batch.

    ``returns`` are :func:`~advantages.returns.discounted_returns` (verl after PR #7300); the
    advantages are the returns whitened over every ASSISTANT token of the batch (``whiten=False``
    keeps them raw). ``validate`` also checks there are at least 2 ASSISTANT tokens to whiten;
    without it such a batch gets advantages exactly 0 everywhere (the returns as always).
    """
    if whiten:
        return whitened_discounted_returns(token_level_rewards, response_mask, gamma, spans=spans, validate=validate)
    returns = discounted_returns(token_level_rewards, response_mask, gamma, spans, validate)
    return returns, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_RESET_AT_OBSERVATION, settings=DiscountSettings)
def reinforce_plus_plus_reset_at_observation(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    *,
    spans: torch.Tensor | None = None,
    whiten: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ablation: REINFORCE++ as verl computed it before PR #7300 (the return resets to 0 at every
    0 of the mask, so a reward never reaches an earlier turn); otherwise as :func:`reinforce_plus_plus`.

    ``returns`` keep verl's nonzero values on a masked token just before an assistant span
    (:func:`~advantages.returns.returns_reset_at_observation`); the whitened advantages are 0 off
    ASSISTANT tokens. ``spans`` is used for validation only: the bug knows only the mask.
    """
    check_batch(token_level_rewards, response_mask, spans, validate)
    returns = returns_reset_at_observation(token_level_rewards, response_mask, gamma)
    return _whitened(returns, response_mask, whiten, validate)


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_IGNORE_MASK, settings=DiscountSettings)
def reinforce_plus_plus_ignore_mask(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    *,
    spans: torch.Tensor | None = None,
    whiten: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ablation: REINFORCE++ whose returns ignore the mask (every observation token costs a discount
    step: :func:`~advantages.returns.returns_ignore_mask`); whitened over ASSISTANT tokens as
    :func:`reinforce_plus_plus`. ``returns`` are nonzero on OBSERVATION tokens too; ``spans`` is used
    for validation only."""
    check_batch(token_level_rewards, response_mask, spans, validate)
    returns = returns_ignore_mask(token_level_rewards, gamma)
    return _whitened(returns, response_mask, whiten, validate)


register_adv_est(AdvantageEstimator.GAE, needs_values=True, settings=GAESettings)(gae)


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, needs_index=True)
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    *,
    spans: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262; verl): score minus its group's mean, broadcast over
    ASSISTANT tokens, then whitened over the batch. A group of one has baseline 0 (as in verl)."""
    scores, is_assistant, group = _scores(token_level_rewards, response_mask, index, spans, validate)
    count, mean, _ = _group_moments(scores, group)
    baseline = torch.where(count > 1, mean, 0.0)
    advantages = masked_whiten(_broadcast(scores - baseline, is_assistant, scores.dtype), is_assistant, check=validate)
    advantages = advantages.to(token_level_rewards.dtype)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO, needs_index=True)
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = GRPO_EPS,
    norm_adv_by_std_in_grpo: bool = True,
    *,
    spans: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (DeepSeekMath, arXiv:2402.03300; verl): ``(score - group mean) / (group std + epsilon)``.

    ``norm_adv_by_std_in_grpo=False`` keeps ``score - group mean`` (Dr. GRPO). The std is
    Bessel-corrected; a group of one gets mean 0 and std 1, as in verl.
    """
    scores, is_assistant, group = _scores(token_level_rewards, response_mask, index, spans, validate)
    count, mean, var = _group_moments(scores, group)
    single = count < 2
    advantages = scores - torch.where(single, 0.0, mean)
    if norm_adv_by_std_in_grpo:
        advantages = advantages / (torch.where(single, 1.0, var.sqrt()) + epsilon)
    advantages = _broadcast(advantages, is_assistant, token_level_rewards.dtype)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO, needs_index=True)
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    *,
    spans: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740; verl): score minus the mean of the *other*
    responses of its group, ``(score - mean) * n / (n - 1)``; a group of one keeps its score."""
    scores, is_assistant, group = _scores(token_level_rewards, response_mask, index, spans, validate)
    count, mean, _ = _group_moments(scores, group)
    advantages = torch.where(count > 1, (scores - mean) * count / (count - 1), scores)
    advantages = _broadcast(advantages, is_assistant, token_level_rewards.dtype)
    return advantages, advantages


def _whitened(returns: torch.Tensor, response_mask: torch.Tensor, whiten: bool, validate: bool):
    """``(advantages, returns)``: the returns whitened over the ASSISTANT tokens, or raw without
    ``whiten``; the advantages are exactly 0 off them either way (the ablations' returns are not)."""
    if not whiten:
        return torch.where(response_mask.bool(), returns, 0.0), returns
    return masked_whiten(returns, response_mask, check=validate), returns


def group_ids(index, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``index`` -> ``(b,)`` long group ids on ``device`` (equal ids = same group).

    Takes what verl passes: an integer tensor (kept as is, no host sync), or a numpy array / list /
    tuple of ints or strings (uids), numbered in order of first appearance. ValueError for a wrong
    length, floats, bools or None (:func:`masking.sessions.row_ids`).
    """
    return row_ids(index, batch_size, "index", device)


def _scores(token_level_rewards, response_mask, index, spans, validate):
    """Per-trajectory score ``(b,)`` (sum of rewards, accumulated and kept in float32 for half precisions,
    float64 for float64: :func:`~advantages.stats.accumulation_dtype`), the ASSISTANT mask and ``(b,)`` group ids."""
    group = group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)
    check_batch(token_level_rewards, response_mask, spans, validate)
    scores = token_level_rewards.sum(-1, dtype=accumulation_dtype(token_level_rewards.dtype))
    return scores, response_mask.bool(), group  # the mask equals spans == ASSISTANT


def _broadcast(per_row: torch.Tensor, is_assistant: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(b,)`` per-row advantages (in the accumulation dtype) -> ``(b, t)`` on ASSISTANT tokens, in ``dtype``
    (the rewards'): one rounding, at the end."""
    return torch.where(is_assistant, per_row.unsqueeze(-1), 0.0).to(dtype)


def _group_moments(scores: torch.Tensor, group: torch.Tensor):
    """Size, mean and Bessel-corrected variance of each row's group, gathered back to ``(b,)``.

    Ids are made dense (0..groups-1) by sorting, then summed with ``index_add_``. A group of one has
    variance NaN (callers treat groups of one separately, as verl does). In the dtype of ``scores``
    (:func:`_scores` gives float32 for half precisions, as verl's group statistics).
    """
    dense = dense_ids(group)
    zeros = torch.zeros_like(scores)
    count = zeros.index_add(0, dense, torch.ones_like(scores))[dense]
    mean = zeros.index_add(0, dense, scores)[dense] / count
    var = zeros.index_add(0, dense, (scores - mean).square())[dense] / (count - 1)
    return count, mean, var

