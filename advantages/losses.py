"""Losses over ASSISTANT tokens with verl's argument order and semantics (verl's ``core_algos``):
loss aggregation, KL penalties, a registry of policy losses (PPO with dual clip, GSPO, CISPO, GPG,
REINFORCE), the clipped value loss and the entropy loss.

All per-token inputs are ``(b, t)`` (``full`` KL and the entropy take ``(b, t, v)``); masks are
0/1 or bool, and a masked position never leaks into a result, even NaN (``torch.where``). Metrics
come back as 0-dim tensors: no host sync.
"""

from typing import Callable

import torch

from advantages.stats import masked_mean, masked_sum
from masking.sessions import dense_ids

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_PENALTY_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
"""Each mode but ``full`` also comes as a straight-through variant with a trailing ``+`` (``k3+``)."""


# --- loss aggregation ---------------------------------------------------------------------------------


def aggregate_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    *,
    session: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a ``(b, t)`` per-token loss to a scalar over the masked tokens (verl's ``agg_loss``).

    Modes (a "row" counts only if it has at least one masked token, as in verl):

    - ``token-mean``: sum over tokens / ``batch_num_tokens`` (default: this batch's token count);
    - ``token-sum``: sum over tokens;
    - ``seq-mean-token-sum``: per-row sums, summed / ``global_batch_size`` (default: this batch's rows);
    - ``seq-mean-token-mean``: per-row means, summed / ``global_batch_size``;
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): ``seq-mean-token-sum / loss_scale_factor`` (default:
      ``t``, the padded length; set a constant to keep the scale fixed across batches).

    Data parallelism as verl: each of ``dp_size`` ranks passes its micro-batch with the *global*
    ``batch_num_tokens`` / ``global_batch_size``, and the result is multiplied by ``dp_size`` so the
    mean over ranks is the full batch's loss (``token-sum`` is multiplied too, so that mean is the
    full sum). ``dp_size > 1`` without the global count raises ValueError, as verl.

    Sessions (docs/design.md section 3, "Sessions"): with ``session`` ``(b,)`` (``Batch.session``: the
    session id of each row, rows being segments), the ``seq-mean-*`` modes treat a session as one
    sequence: its segments' tokens are summed (and, for ``seq-mean-token-mean``, averaged) together, and
    ``global_batch_size`` counts sessions (default: this batch's sessions with a masked token). Pass all
    of a session's segments in one call (a session split over micro-batches counts once in each).
    The token modes need no sessions: a token is a token.

    Without any masked token every mean mode is 0/0 = NaN (as verl; the trainer skips such batches)
    and ``token-sum`` is 0.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            _check_local(dp_size, "batch_num_tokens")
            batch_num_tokens = loss_mask.bool().sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    tokens = loss_mask.bool().sum(-1)
    per_row = masked_sum(loss_mat, loss_mask, dim=-1)
    if session is not None:
        tokens, per_row = _sum_by_session(session, tokens, per_row)
    if loss_agg_mode == "seq-mean-token-mean":
        per_row = per_row / tokens.clamp(min=1)  # rows without tokens sum to 0 and are not counted below
    if global_batch_size is None:
        _check_local(dp_size, "global_batch_size")
        global_batch_size = (tokens > 0).sum()
    loss = per_row.sum() / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _sum_by_session(session: torch.Tensor, *per_row: torch.Tensor) -> list[torch.Tensor]:
    """``(b,)`` per-row quantities -> their sums per session, ``(b,)`` (one slot per dense session id,
    zeros past the last; a sort and ``index_add``, no host sync)."""
    b = per_row[0].shape[0]
    if session.shape != (b,):
        raise ValueError(f"session must hold one session id per row, shape ({b},); got shape {tuple(session.shape)}")
    dense = dense_ids(session.to(per_row[0].device))
    return [torch.zeros_like(x).index_add_(0, dense, x) for x in per_row]


def _check_local(dp_size: int, name: str) -> None:
    if dp_size > 1:
        raise ValueError(f"{name} (the global count over all ranks) is required when dp_size > 1")


# --- KL penalties -------------------------------------------------------------------------------------


def kl_penalty(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    kl_penalty: str,
    *,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) (verl's ``kl_penalty``; Schulman, "Approximating
    KL divergence", 2020), with ``log_ratio = logprob - ref_logprob``:

    - ``kl``/``k1``: ``log_ratio`` (unbiased, high variance); ``abs``: ``|log_ratio|``;
    - ``mse``/``k2``: ``log_ratio**2 / 2``;
    - ``low_var_kl``/``k3``: ``exp(-log_ratio) + log_ratio - 1`` (unbiased, >= 0), with the
      log-ratio clamped to [-20, 20] and the result to [-10, 10] as verl;
    - ``full``: the exact KL over the vocabulary, ``sum_v p (log p - log q)``, from ``(b, t, v)``
      log-probabilities (TRL's ``full``; verl raises NotImplementedError).

    A trailing ``+`` (``k1+``, ``k3+``, ...) keeps the value and takes the gradient of ``k2``
    (straight-through, as verl): ``k1`` and ``k3`` are unbiased in value but not in gradient.

    ``logprob``, ``ref_logprob``: ``(b, t)`` (``(b, t, v)`` for ``full``). Returns ``(b, t)`` in their
    dtype. ``response_mask`` (ours, keyword-only): ``(b, t)``; if given, 0 off the mask.
    """
    base, straight_through = (kl_penalty[:-1], True) if kl_penalty.endswith("+") else (kl_penalty, False)
    if base not in KL_PENALTY_MODES or (straight_through and base == "full"):
        raise ValueError(
            f"unknown KL penalty {kl_penalty!r}; choose one of {KL_PENALTY_MODES}, or one of them but full with a "
            "trailing + (straight-through k2 gradient)"
        )
    if response_mask is not None:  # mask the inputs, so no NaN off the mask reaches a value or a gradient
        keep = response_mask.bool().unsqueeze(-1) if base == "full" else response_mask.bool()
        logprob, ref_logprob = torch.where(keep, logprob, 0.0), torch.where(keep, ref_logprob, 0.0)
    if base == "full":
        kl = _full_kl(logprob, ref_logprob)
    else:
        kl = _kl_forward(logprob, ref_logprob, base)
        if straight_through and base not in ("mse", "k2"):
            k2 = 0.5 * (logprob - ref_logprob).square()
            kl = k2 - k2.detach() + kl.detach()
    return kl  # exactly 0 off the mask: every mode is 0 at equal (zeroed) inputs


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, base: str) -> torch.Tensor:
    log_ratio = logprob - ref_logprob
    if base in ("kl", "k1"):
        return log_ratio
    if base == "abs":
        return log_ratio.abs()
    if base in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    ref_over_policy = (-log_ratio).clamp(-20, 20)  # low_var_kl / k3
    return (ref_over_policy.exp() - ref_over_policy - 1).clamp(-10, 10)


def _full_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    if logprob.dim() != 3 or logprob.shape != ref_logprob.shape:
        raise ValueError(
            "the full KL needs (b, t, v) log-probabilities of the whole vocabulary for policy and reference, got "
            f"{tuple(logprob.shape)} and {tuple(ref_logprob.shape)}"
        )
    prob = logprob.exp()
    return torch.where(prob > 0, prob * (logprob - ref_logprob), 0.0).sum(-1)  # 0 log 0 = 0


# --- policy losses ------------------------------------------------------------------------------------

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""name -> loss. Every loss takes ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode)``
positionally (verl's ``PolicyLossFn`` order), then its own settings as keywords, and returns
``(loss, metrics)``. Settings verl reads from its actor config are explicit keywords here."""


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering a policy loss under ``name`` (verl's ``register_policy_loss``); another
    function under a taken name raises ValueError (verl overwrites it)."""

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        if POLICY_LOSSES.get(name, fn) is not fn:
            raise ValueError(f"policy loss {name!r} is already registered: {POLICY_LOSSES[name]} vs {fn}")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; ValueError lists the names."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}") from None


def _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, global_batch_info):
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return aggregate_loss(pg_losses, response_mask, loss_agg_mode, **(global_batch_info or {}))


@register_policy_loss("vanilla")
def ppo_clip_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO (Schulman et al. 2017, arXiv:1707.06347; Ye et al. 2019, arXiv:1912.09729) as
    verl's ``compute_policy_loss_vanilla``.

    ``ratio = exp(log_prob - old_log_prob)`` (log-ratio clamped to [-20, 20]); per token
    ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))`` with ``low``/``high`` defaulting to
    ``clip_ratio`` (asymmetric clipping as in DAPO), and for ``A < 0`` capped at ``-A * clip_ratio_c``
    (dual clip; ``clip_ratio_c > 1``). ``rollout_is_weights`` ``(b, t)`` multiply the per-token
    losses after the clips (the sampler/trainer correction: ``advantages.rollout_correction``);
    ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ...) goes to :func:`aggregate_loss`.

    Returns ``(loss, metrics)``: ``clipfrac`` (share of tokens where the clipped term was taken),
    ``clipfrac_lower`` (share where the dual clip was), ``approx_kl`` (mean ``old_log_prob - log_prob``,
    verl's ``ppo_kl``).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (the dual-clip bound) must be greater than 1, got {clip_ratio_c}")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = (log_prob - old_log_prob).clamp(-20, 20)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    clip_losses = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(dual_bound, clip_losses), clip_losses)
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, global_batch_info)
    return loss, {
        "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), response_mask),
        "clipfrac_lower": masked_mean(((clip_losses > dual_bound) & negative).to(ratio.dtype), response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask),
    }


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071) as verl's ``compute_policy_loss_gspo``.

    The sequence ratio ``s = exp(mean over the row's tokens of (log_prob - old_log_prob))`` is used at
    every token as ``sg(s) * pi / sg(pi)`` (value ``s``, gradient through each token), log clamped at
    10, then clipped as PPO (no dual clip). The paper aggregates ``seq-mean-token-mean``, the default
    (verl 0.9 honours ``loss_agg_mode`` too). Metrics: ``clipfrac``, ``clipfrac_lower`` (0), ``approx_kl``.
    """
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / response_mask.bool().sum(-1).clamp(min=1)
    log_seq_ratio = (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    seq_ratio = log_seq_ratio.exp()
    unclipped = -advantages * seq_ratio
    clipped = -advantages * seq_ratio.clamp(1 - low, 1 + high)
    pg_losses = torch.maximum(unclipped, clipped)
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, global_batch_info)
    return loss, {
        "clipfrac": masked_mean((clipped > unclipped).to(seq_ratio.dtype), response_mask),
        "clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
        "approx_kl": masked_mean(-log_ratio, response_mask),
    }


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585) as verl's ``compute_policy_loss_cispo``: per token
    ``-sg(clip(ratio, 1 - low, 1 + high)) * A * log_prob``: the importance weight is clipped and
    detached, so every token keeps a gradient (none is dropped by the clip). Metrics: ``clipfrac``
    (share of tokens whose ratio was clipped), ``clipfrac_lower`` (0), ``approx_kl``."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = (log_prob - old_log_prob).clamp(-20, 20)
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1 - low, 1 + high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, global_batch_info)
    return loss, {
        "clipfrac": masked_mean((ratio != clipped_ratio).to(ratio.dtype), response_mask),
        "clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
        "approx_kl": masked_mean(-log_ratio, response_mask),
    }


@register_policy_loss("gpg")
def gpg_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (Chu et al. 2025, arXiv:2504.02546) as verl's ``compute_policy_loss_gpg``: the plain policy
    gradient ``-A * log_prob`` per token (``old_log_prob`` is unused). No metrics, as verl."""
    loss = _aggregate(-advantages * log_prob, response_mask, loss_agg_mode, rollout_is_weights, global_batch_info)
    return loss, {}


@register_policy_loss("reinforce")
def reinforce_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain REINFORCE (Williams 1992) as verl's ``compute_policy_loss_reinforce``: ``-A * log_prob``
    per token, optionally times ``rollout_is_weights``, default ``seq-mean-token-sum``. Metric:
    ``approx_kl`` (mean ``old_log_prob - log_prob``, the rollout policy's log-probs as verl)."""
    loss = _aggregate(-advantages * log_prob, response_mask, loss_agg_mode, rollout_is_weights, global_batch_info)
    return loss, {"approx_kl": masked_mean(old_log_prob - log_prob, response_mask)}


# --- value and entropy losses -------------------------------------------------------------------------


def clipped_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO; verl's ``compute_value_loss``): ``0.5 * max((V - R)^2, (V_clip - R)^2)``
    aggregated, with ``V_clip = clip(vpreds, values - c, values + c)`` around the old ``values``.

    All ``(b, t)``; the aggregation arguments as :func:`aggregate_loss`. Returns ``(loss, clipfrac)``,
    the share of tokens where the clipped term was larger.
    """
    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, dp_size,
                                batch_num_tokens, global_batch_size, loss_scale_factor)
    return loss, masked_mean((clipped > unclipped).to(vpreds.dtype), response_mask)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``(..., v)`` logits -> ``(...)`` entropy of the softmax in nats (verl's ``entropy_from_logits``)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_batch_info: dict | None = None,
) -> torch.Tensor:
    """Entropy of each next-token distribution, aggregated (verl's ``compute_entropy_loss``).

    ``logits`` ``(b, t, v)``, ``response_mask`` ``(b, t)``. A trainer subtracts ``coef * entropy_loss``
    to reward exploration.
    """
    return aggregate_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, **(global_batch_info or {}))
