"""Advantage estimators with verl's argument names, and a registry to pick one by name.

Every estimator returns ``(advantages, returns)``, both ``(b, t)`` in the rewards' dtype and exactly
0 off ASSISTANT tokens. Outcome estimators (REINFORCE++-baseline, GRPO, RLOO) score a trajectory by
the sum of its token-level rewards and broadcast one advantage over its ASSISTANT tokens; groups
(the responses to one prompt) are given as an integer tensor ``index`` ``(b,)`` of any ids.
Group statistics use a sort and ``index_add_``: no Python loop over groups, no host sync.
"""

from typing import Callable

import torch

from advantages.returns import check_batch, discounted_returns, gae, whitened_discounted_returns
from advantages.stats import masked_whiten

GRPO_EPS = 1e-6  # verl's epsilon in the GRPO std normalisation


def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    spans: torch.Tensor | None = None,
    whiten: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): carry-through discounted returns, whitened over the batch.

    ``returns`` are :func:`~advantages.returns.discounted_returns` (verl after PR #7300); the
    advantages are the returns whitened over every ASSISTANT token of the batch (``whiten=False``
    keeps them raw). ``validate`` also checks there are at least 2 ASSISTANT tokens to whiten.
    """
    if whiten:
        return whitened_discounted_returns(token_level_rewards, response_mask, gamma, spans=spans, validate=validate)
    returns = discounted_returns(token_level_rewards, response_mask, gamma, spans, validate)
    return returns, returns


def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    spans: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262; verl): score minus its group's mean, broadcast over
    ASSISTANT tokens, then whitened over the batch. A group of one has baseline 0 (as in verl)."""
    scores, is_assistant = _scores(token_level_rewards, response_mask, index, spans, validate)
    count, mean, _ = _group_moments(scores, index)
    baseline = torch.where(count > 1, mean, 0.0)
    advantages = masked_whiten(_broadcast(scores - baseline, is_assistant), is_assistant, check=validate)
    return advantages, advantages


def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    spans: torch.Tensor | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (DeepSeekMath, arXiv:2402.03300; verl): ``(score - group mean) / (group std + 1e-6)``.

    ``norm_adv_by_std_in_grpo=False`` keeps ``score - group mean`` (Dr. GRPO). The std is
    Bessel-corrected; a group of one gets mean 0 and std 1, as in verl.
    """
    scores, is_assistant = _scores(token_level_rewards, response_mask, index, spans, validate)
    count, mean, var = _group_moments(scores, index)
    single = count < 2
    advantages = scores - torch.where(single, 0.0, mean)
    if norm_adv_by_std_in_grpo:
        advantages = advantages / (torch.where(single, 1.0, var.sqrt()) + GRPO_EPS)
    advantages = _broadcast(advantages, is_assistant)
    return advantages, advantages


def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    spans: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740; verl): score minus the mean of the *other*
    responses of its group, ``(score - mean) * n / (n - 1)``; a group of one keeps its score."""
    scores, is_assistant = _scores(token_level_rewards, response_mask, index, spans, validate)
    count, mean, _ = _group_moments(scores, index)
    advantages = torch.where(count > 1, (scores - mean) * count / (count - 1), scores)
    advantages = _broadcast(advantages, is_assistant)
    return advantages, advantages


def _scores(token_level_rewards, response_mask, index, spans, validate):
    """Per-trajectory score ``(b,)`` (sum of rewards) and the ASSISTANT mask, after validation."""
    if (
        not isinstance(index, torch.Tensor)
        or index.shape != token_level_rewards.shape[:1]
        or index.dtype.is_floating_point
        or index.dtype == torch.bool
    ):
        got = f"{index.dtype} of shape {tuple(index.shape)}" if isinstance(index, torch.Tensor) else repr(index)
        raise ValueError(
            f"index must be an integer tensor of shape ({token_level_rewards.shape[0]},) holding one group id per "
            f"row, got {got}"
        )
    check_batch(token_level_rewards, response_mask, spans, validate)
    return token_level_rewards.sum(-1), response_mask.bool()  # the mask equals spans == ASSISTANT


def _broadcast(per_row: torch.Tensor, is_assistant: torch.Tensor) -> torch.Tensor:
    return torch.where(is_assistant, per_row.unsqueeze(-1), 0.0)


def _group_moments(scores: torch.Tensor, index: torch.Tensor):
    """Size, mean and Bessel-corrected variance of each row's group, gathered back to ``(b,)``.

    Ids are made dense (0..groups-1) by sorting, then summed with ``index_add_``. A group of one has
    variance NaN (callers treat groups of one separately, as verl does).
    """
    sorted_ids, order = torch.sort(index)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    group = torch.empty_like(order).scatter_(0, order, starts.cumsum(0) - 1)
    zeros = torch.zeros_like(scores)
    count = zeros.index_add(0, group, torch.ones_like(scores))[group]
    mean = zeros.index_add(0, group, scores)[group] / count
    var = zeros.index_add(0, group, (scores - mean).square())[group] / (count - 1)
    return count, mean, var


# --- registry: a trainer picks an estimator by name --------------------------------------------------


def _reinforce_plus_plus(token_level_rewards, response_mask, *, spans=None, gamma=1.0, validate=True, **_):
    return reinforce_plus_plus(token_level_rewards, response_mask, gamma, spans, validate=validate)


def _reinforce_plus_plus_baseline(token_level_rewards, response_mask, *, index=None, spans=None, validate=True, **_):
    return reinforce_plus_plus_baseline(token_level_rewards, response_mask, index, spans, validate)


def _grpo(
    token_level_rewards, response_mask, *, index=None, spans=None, norm_adv_by_std_in_grpo=True, validate=True, **_
):
    return grpo(token_level_rewards, response_mask, index, spans, norm_adv_by_std_in_grpo, validate)


def _rloo(token_level_rewards, response_mask, *, index=None, spans=None, validate=True, **_):
    return rloo(token_level_rewards, response_mask, index, spans, validate)


def _gae(token_level_rewards, response_mask, *, values=None, spans=None, gamma=1.0, lam=1.0, validate=True, **_):
    if values is None:
        raise ValueError("the gae estimator needs values=(b, t) critic values")
    return gae(token_level_rewards, values, response_mask, gamma, lam, spans, validate=validate)


Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ESTIMATORS: dict[str, Estimator] = {
    "reinforce_plus_plus": _reinforce_plus_plus,
    "reinforce_plus_plus_baseline": _reinforce_plus_plus_baseline,
    "grpo": _grpo,
    "rloo": _rloo,
    "gae": _gae,
}
"""Every entry has one signature::

    fn(token_level_rewards, response_mask, *, spans=None, index=None, values=None,
       gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, validate=True) -> (advantages, returns)

Each uses the keywords it needs (``index`` for the group estimators, ``values`` for GAE) and
ignores the rest, so a trainer passes the whole batch and config to whichever it picked.
"""


def get_estimator(name: str) -> Estimator:
    """The registered estimator called ``name`` (see :data:`ESTIMATORS`); ValueError lists the names."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}") from None
