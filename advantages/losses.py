"""KL penalties and the PPO-clip policy loss, over ASSISTANT tokens only (verl's ``core_algos``)."""

import torch

from advantages.stats import masked_mean, masked_sum

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def kl_penalty(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, response_mask: torch.Tensor, kind: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens, 0 off ASSISTANT tokens.

    Schulman, "Approximating KL divergence" (2020), with ``log_ratio = logprob - ref_logprob``:
    ``k1 = log_ratio`` (unbiased, high variance), ``k2 = log_ratio**2 / 2``, ``k3`` (alias
    ``low_var_kl``) ``= exp(-log_ratio) + log_ratio - 1`` (unbiased, low variance, >= 0), clamped
    as in verl: the log-ratio to [-20, 20] and the result to [-10, 10].
    All inputs ``(b, t)``; returns ``(b, t)`` in the logprobs' dtype.
    """
    log_ratio = logprob - ref_logprob
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind in ("k3", "low_var_kl"):
        ref_over_policy = (-log_ratio).clamp(-20, 20)
        kl = (ref_over_policy.exp() - ref_over_policy - 1).clamp(-10, 10)
    else:
        raise ValueError(f"unknown KL penalty kind {kind!r}; choose one of {KL_KINDS}")
    return torch.where(response_mask.bool(), kl, 0.0)


def aggregate_loss(loss: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Reduce a ``(b, t)`` per-token loss to a scalar over ASSISTANT tokens (verl's ``agg_loss``).

    ``token-mean``: mean over all ASSISTANT tokens of the batch. ``seq-mean-token-sum``: per-row
    sum, averaged over rows. ``seq-mean-token-mean``: per-row mean, averaged over the rows that have
    at least one ASSISTANT token.
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss, response_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(loss, response_mask, dim=-1).mean()
    if loss_agg_mode == "seq-mean-token-mean":
        tokens = response_mask.bool().sum(-1)
        per_row = masked_sum(loss, response_mask, dim=-1) / tokens.clamp(min=1)
        return masked_mean(per_row, tokens > 0)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")


def ppo_clip_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) as in verl's ``compute_policy_loss``.

    ``ratio = exp(log_prob - old_log_prob)`` (log-ratio clamped to [-20, 20]); per token
    ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))`` with ``low``/``high`` defaulting to
    ``clip_ratio`` (asymmetric clipping as in DAPO). All inputs ``(b, t)``.

    Returns ``(loss, metrics)``: the scalar loss aggregated by :func:`aggregate_loss` and tensors
    (no host sync) ``clipfrac`` (share of ASSISTANT tokens where the clipped term was taken) and
    ``approx_kl`` (mean of ``old_log_prob - log_prob``, verl's ``ppo_kl``).
    """
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = (log_prob - old_log_prob).clamp(-20, 20)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    loss = aggregate_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode)
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask),
    }
    return loss, metrics
