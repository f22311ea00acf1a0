"""Sampler/trainer mismatch correction: importance weights and rejection on the ratio of the trainer's
logprobs to the sampler's (verl's rollout correction, ``verl/trainer/ppo/rollout_corr_helper.py``).

The sampler (vLLM, other kernels, bf16, maybe an older policy) and the trainer give the same sampled
tokens different probabilities. Per ASSISTANT token the ratio is

    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_log_prob - rollout_log_prob)

(``old_log_prob``: the trainer's recomputed logprobs, the PPO "old" policy; ``rollout_log_prob``: the
sampler's, ``Trajectory.logprobs``). Two remedies, each at token or sequence level:

- **Truncated importance sampling** (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings
  you off-policy RL training", slime's and verl's TIS): the weight ``w_t = min(rho_t, C)`` (token), or
  one weight per row ``min(prod_t rho_t, C)`` over its ASSISTANT tokens (sequence), detached.
- **Masked importance sampling / rejection** (IcePop, Ling team 2025, Ring-1T; verl's
  ``rollout_rs``): tokens whose ratio (or rows whose sequence ratio) falls outside ``[lower, upper]``
  leave the loss mask.

**Composition with the PPO clip** (the decoupled objective of Hilton et al. 2022, arXiv:2110.00641, and
AReaL; verl's "decoupled mode"): the PPO ratio stays ``pi_theta / pi_old`` and is clipped as usual; the
importance weight corrects ``pi_old`` back to the sampler and multiplies the per-token PPO loss::

    loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps))   (dual clip for A_t < 0 as usual)

aggregated over the loss mask, rejected tokens excluded (``advantages.losses``: every policy loss takes
``rollout_is_weights`` as verl's ``compute_policy_loss_*`` do). ``w`` is a constant of the update (no
gradient), computed once per step from ``old_log_prob`` and ``rollout_log_prob``.

All per-token tensors are ``(b, t)``; ``response_mask`` ``(b, t)`` is 1/True on ASSISTANT tokens
(``spans == SpanKind.ASSISTANT``), bool or 0/1 of any dtype. Nothing off the mask leaks into a result
(``torch.where``, even NaN). bf16/fp16 inputs are computed in float32. No function here synchronises
with the host: metrics are 0-dim tensors. Functions with a verl name take verl's arguments in verl's
order with verl's meaning (docs/verl.md lists what differs); :func:`correct_rollouts` is the trainer's
entry point.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from advantages.stats import masked_mean, masked_sum

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp`` (verl's bound): weights stay finite."""

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""verl's rejection criteria: a divergence ``k1 = -log rho`` (bounded below and above), ``k2 = (log rho)^2 / 2``
or ``k3 = rho - 1 - log rho`` (bounded above), per token or summed / averaged / maxed over each row."""

MISMATCH_QUANTILES = (0.05, 0.5, 0.95)


# --- pieces --------------------------------------------------------------------------------------------


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 for half precisions (a bf16 sum of log-ratios keeps 3 digits), float64 kept."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _safe_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(b, t)`` log-ratio in the compute dtype, clamped to +-SAFETY_BOUND, 0 off the mask."""
    log_ratio = log_ratio.to(_compute_dtype(log_ratio))
    return torch.where(mask, log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND), 0.0)


def _raw_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``(b, t)`` untruncated importance weights, 0 off the mask: ``rho_t`` (token), or per row
    ``exp(clamp(sum_t log rho_t))`` broadcast over its tokens (sequence)."""
    if level == "token":
        log_weights = _safe_log_ratio(log_ratio, mask)
    else:
        row_sum = masked_sum(log_ratio.to(_compute_dtype(log_ratio)), mask, dim=-1)
        log_weights = row_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND).unsqueeze(-1).expand_as(log_ratio)
    return torch.where(mask, log_weights.exp(), 0.0)


def _row_statistic(values: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """``(b, t)`` per-token values -> ``(b, t)``: the value itself (``token``), or the row's masked
    ``sum``, ``mean`` or ``max`` broadcast over the row (a row without tokens: 0)."""
    if how == "token":
        return values
    if how == "sum":
        row = masked_sum(values, mask, dim=-1)
    elif how == "mean":
        row = masked_sum(values, mask, dim=-1) / mask.sum(-1).clamp(min=1)
    else:
        row = torch.where(mask, values, -math.inf).amax(-1)
        row = torch.where(mask.any(-1), row, 0.0)
    return row.unsqueeze(-1).expand_as(values)


def _divergence(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    """verl's per-token rejection statistics of a clamped log-ratio: k1, k2 or k3."""
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return log_ratio.exp() - 1.0 - log_ratio


def masked_quantiles(values: torch.Tensor, mask: torch.Tensor, quantiles=MISMATCH_QUANTILES) -> torch.Tensor:
    """Quantiles of ``values`` ``(b, t)`` over the positions where ``mask`` is set, ``(len(quantiles),)``.

    Linear interpolation between order statistics, as ``torch.quantile``; without a host sync (the
    positions off the mask sort last, the count stays a tensor). NaN when nothing is set."""
    flat = torch.where(mask, values, math.inf).flatten().sort().values
    count = mask.sum()
    position = torch.tensor(quantiles, dtype=flat.dtype, device=flat.device) * (count - 1).clamp(min=0)
    low = position.floor().long()
    high = position.ceil().long()
    below, above = flat[low], flat[high]
    found = below + (position - low) * torch.where(high > low, above - below, 0.0)
    return torch.where(count > 0, found, math.nan)


# --- verl's functions ----------------------------------------------------------------------------------


def _parse_rollout_is_threshold(threshold_spec: str | float) -> tuple[float, float | None]:
    """verl's parsing: a number (or numeric string) is the TIS cap ``(upper, None)``; ``"lower_upper"`` is
    IcePop's ``(upper, lower)``. ValueError/TypeError on anything else, as verl."""
    if isinstance(threshold_spec, bool) or not isinstance(threshold_spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {threshold_spec!r}")
    spec = str(threshold_spec).strip()
    try:
        lower, upper = (float(part) for part in spec.split("_", 1)) if "_" in spec else (None, float(spec))
    except ValueError:
        raise ValueError(f"invalid rollout_is_threshold {threshold_spec!r}: a number or 'lower_upper'") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {threshold_spec!r}: bounds must be positive, lower <= upper")
    return upper, lower


def _is_fractions(log_ratio, mask, raw, level, upper, lower) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``rollout_is_ratio_fraction_high`` / ``_low``: at token level the shares of ASSISTANT tokens
    whose untruncated weight is above ``upper`` / below ``lower``; at sequence level the shares of all rows
    whose log sequence ratio is above ``log upper`` / below ``log lower`` (a row without tokens: ratio 1)."""
    if level == "token":
        return masked_mean((raw > upper).to(raw.dtype), mask), masked_mean((raw < lower).to(raw.dtype), mask)
    row = masked_sum(log_ratio.to(_compute_dtype(log_ratio)), mask, dim=-1)
    return (row > math.log(upper)).to(row.dtype).mean(), (row < math.log(lower)).to(row.dtype).mean()


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated (or IcePop-masked) importance weights, as verl's ``compute_rollout_correction_weights``.

    ``log_ratio`` ``(b, t)``: ``old_log_prob - rollout_log_prob`` (trainer over sampler);
    ``response_mask`` ``(b, t)``. ``rollout_is``: ``token`` (``rho_t``) or ``sequence`` (one weight per
    row, ``prod_t rho_t`` over its ASSISTANT tokens). ``rollout_is_threshold``: a number ``C`` truncates
    the weights at ``C`` (TIS); a ``"lower_upper"`` string zeroes the weights outside ``[lower, upper]``
    (IcePop; the tokens stay in the mask and count in a token-mean). ``rollout_is_batch_normalize``
    divides by the mean weight over the tokens (token) or the rows with tokens (sequence), unless that
    mean is at most 1e-8.

    Returns ``(weights, metrics)``: ``weights`` ``(b, t)`` detached, 0 off the mask (a row without
    ASSISTANT tokens: 0), in float32 (float64 for float64 input); ``metrics`` 0-dim tensors with verl's
    meaning: ``rollout_is_mean`` (of the weights over the ASSISTANT tokens, before normalising),
    ``rollout_is_ratio_fraction_high`` / ``_low`` (:func:`_is_fractions`; ``lower`` defaults to
    ``1 / upper``), and ``rollout_is_batch_norm_factor`` when normalising.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; choose one of {ROLLOUT_IS_LEVELS}")
    upper, lower = _parse_rollout_is_threshold(rollout_is_threshold)
    mask = response_mask.bool()
    raw = _raw_weights(log_ratio, mask, rollout_is)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    weights = weights.detach()
    high, low = _is_fractions(log_ratio, mask, raw, rollout_is, upper, 1.0 / upper if lower is None else lower)
    metrics = {"rollout_is_mean": masked_mean(weights, mask), "rollout_is_ratio_fraction_high": high,
               "rollout_is_ratio_fraction_low": low}
    if rollout_is_batch_normalize:
        rows = mask.any(-1)
        if rollout_is == "token":
            mean = metrics["rollout_is_mean"]
        else:  # one weight per row with tokens
            mean = masked_sum(weights.amax(-1), rows) / rows.sum()
        factor = torch.where(mean > 1e-8, mean, 1.0)
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _parse_rollout_rs_thresholds(options: list[str], threshold_spec) -> dict[str, tuple[float | None, float]]:
    """verl's parsing: one threshold per option (or one for all), comma-separated; k1 options take
    ``"lower_upper"`` ratio bounds (a single number ``u`` means ``1/u _ u``) returned as log bounds, the
    others one positive upper bound. Returns ``{option: (lower or None, upper)}`` in the statistic's units."""
    if threshold_spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    specs = [part.strip() for part in str(threshold_spec).split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold needs one threshold or one per option ({len(options)}), got {threshold_spec!r}")
    bounds = {}
    for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
        try:
            if option.endswith("k1"):
                lower, upper = (float(p) for p in spec.split("_", 1)) if "_" in spec else (1.0 / float(spec), float(spec))
            elif "_" in spec:
                raise ValueError(f"rollout_rs option {option!r} takes one upper bound, got {spec!r}")
            else:
                lower, upper = None, float(spec)
        except ValueError as error:
            raise ValueError(f"invalid rollout_rs_threshold {spec!r} for {option!r}: {error}") from None
        if not upper > 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold {spec!r} for {option!r}: bounds must be positive, lower <= upper")
        bounds[option] = (math.log(lower), math.log(upper)) if lower is not None else (None, upper)
    return bounds


def _rs_keep(log_ratio: torch.Tensor, mask: torch.Tensor, option: str, lower: float | None, upper: float) -> torch.Tensor:
    """``(b, t)`` bool: where ``option``'s statistic lies in ``[lower, upper]`` (``lower`` None: below ``upper``)."""
    level, kind = option.rsplit("_", 1)
    statistic = _row_statistic(_divergence(_safe_log_ratio(log_ratio, mask), kind), mask, level.removeprefix("seq_"))
    keep = statistic <= upper
    return keep if lower is None else keep & (statistic >= lower)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rejection on divergence statistics, as verl's ``compute_rollout_rejection_mask``.

    ``log_ratio``, ``response_mask`` ``(b, t)`` as :func:`compute_rollout_correction_weights`.
    ``rollout_rs``: comma-separated options of :data:`ROLLOUT_RS_OPTIONS`, all of which must pass. Note
    verl's sign: ``k1 = -log rho = log(pi_rollout / pi_old)``, so ``token_k1`` with ``"l_u"`` keeps
    ``1/u <= rho <= 1/l`` (the same as ``l <= rho <= u`` when ``l = 1/u``).

    Returns ``(modified_response_mask, metrics)``: the mask (its dtype) with rejected tokens set to 0;
    ``rollout_rs_masked_fraction`` (share of ASSISTANT tokens rejected) and
    ``rollout_rs_seq_masked_fraction`` (share of all rows with a rejected token), 0-dim tensors.
    """
    options = list(dict.fromkeys(o.strip() for o in (rollout_rs or "").split(",") if o.strip()))
    if not options or any(o not in ROLLOUT_RS_OPTIONS for o in options):
        raise ValueError(f"invalid rollout_rs {rollout_rs!r}; comma-separated options of {ROLLOUT_RS_OPTIONS}")
    bounds = _parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    mask = response_mask.bool()
    keep = torch.ones_like(mask)
    for option, (lower, upper) in bounds.items():
        keep = keep & _rs_keep(log_ratio, mask, option, lower, upper)
    rejected = mask & ~keep
    metrics = {
        "rollout_rs_masked_fraction": masked_mean(rejected.float(), mask),
        "rollout_rs_seq_masked_fraction": rejected.any(-1).float().mean(),
    }
    return torch.where(keep, response_mask, torch.zeros_like(response_mask)), metrics


# --- the trainer's entry point ---------------------------------------------------------------------------


def mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the sampler is from the trainer, over the ASSISTANT tokens (0-dim tensors, NaN without any).

    - ``mismatch/kl_k1``: mean of ``rollout_log_prob - old_log_prob``, the k1 estimate of
      KL(pi_rollout || pi_old) from the sampled tokens (verl's ``rollout_corr/kl``);
    - ``mismatch/kl_k3``: mean of ``rho - 1 - log rho`` (k3, >= 0 per token; verl's ``rollout_corr/k3_kl``);
    - ``mismatch/ratio_mean|min|max|p05|p50|p95``: of the token ratios ``rho = exp(old - rollout)``.

    Log-ratios are clamped to +-SAFETY_BOUND first (verl leaves them unclamped here).
    """
    mask = response_mask.bool()
    log_ratio = _safe_log_ratio(old_log_prob.to(_compute_dtype(old_log_prob)) - rollout_log_prob, mask)
    ratio = log_ratio.exp()
    p05, p50, p95 = masked_quantiles(ratio, mask).unbind()
    return {
        "mismatch/kl_k1": masked_mean(-log_ratio, mask),
        # >= 0 per token in exact arithmetic; float32 rounds tiny gaps below 0
        "mismatch/kl_k3": masked_mean((ratio - 1.0 - log_ratio).clamp_min(0.0), mask),
        "mismatch/ratio_mean": masked_mean(ratio, mask),
        "mismatch/ratio_min": torch.where(mask, ratio, math.inf).amin().where(mask.any(), math.nan),
        "mismatch/ratio_max": torch.where(mask, ratio, -math.inf).amax().where(mask.any(), math.nan),
        "mismatch/ratio_p05": p05,
        "mismatch/ratio_p50": p50,
        "mismatch/ratio_p95": p95,
    }


class RolloutCorrection(NamedTuple):
    """What :func:`correct_rollouts` returns."""

    weights: torch.Tensor | None  # (b, t) importance weights for the policy loss, None when rollout_is is off
    loss_mask: torch.Tensor  # (b, t) response_mask less the rejected tokens (its dtype)
    metrics: dict[str, torch.Tensor]  # mismatch/*, 0-dim tensors


def correct_rollouts(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str = "off",
    rollout_is_threshold: float = 2.0,
    rollout_rs: str = "off",
    rollout_rs_lower: float = 0.5,
    rollout_rs_upper: float = 2.0,
) -> RolloutCorrection:
    """The trainer's correction and metrics from the trainer's ``old_log_prob`` and the sampler's
    ``rollout_log_prob`` ``(b, t)`` over ``response_mask`` ``(b, t)`` (ASSISTANT tokens).

    - ``rollout_is`` ``token`` | ``sequence`` | ``off``: TIS weights capped at ``rollout_is_threshold``
      (verl's ``compute_rollout_correction_weights`` with a number as threshold);
    - ``rollout_rs`` ``token`` | ``sequence`` | ``off``: drop from the loss mask the tokens whose ratio
      ``rho_t``, or the rows whose ratio ``prod_t rho_t``, lies outside ``[rollout_rs_lower,
      rollout_rs_upper]`` (verl's ``token_k1`` / ``seq_sum_k1`` with threshold ``"1/upper_1/lower"``).

    Metrics: :func:`mismatch_metrics`, plus ``mismatch/frac_capped`` (share of ASSISTANT tokens whose
    weight was truncated at the cap) and ``mismatch/frac_masked`` (share dropped from the loss mask),
    0 when the remedy is off.
    """
    for name, value in (("rollout_is", rollout_is), ("rollout_rs", rollout_rs)):
        if value not in ("off", *ROLLOUT_IS_LEVELS):
            raise ValueError(f"unknown {name} {value!r}; choose one of off, token, sequence")
    if not 0 < rollout_rs_lower <= rollout_rs_upper:
        raise ValueError(f"rollout_rs bounds must satisfy 0 < lower <= upper, got [{rollout_rs_lower}, {rollout_rs_upper}]")
    mask = response_mask.bool()
    log_ratio = old_log_prob.to(_compute_dtype(old_log_prob)) - rollout_log_prob
    metrics = mismatch_metrics(old_log_prob, rollout_log_prob, response_mask)
    weights, capped = None, torch.zeros_like(mask)
    if rollout_is != "off":
        weights, _ = compute_rollout_correction_weights(log_ratio, mask, rollout_is, float(rollout_is_threshold))
        capped = _raw_weights(log_ratio, mask, rollout_is) > rollout_is_threshold
    keep = mask
    if rollout_rs != "off":  # verl's k1 statistic is -log rho: bounds [-log upper, -log lower]
        how = "token_k1" if rollout_rs == "token" else "seq_sum_k1"
        keep = mask & _rs_keep(log_ratio, mask, how, -math.log(rollout_rs_upper), -math.log(rollout_rs_lower))
    metrics["mismatch/frac_capped"] = masked_mean(capped.to(log_ratio.dtype), mask)
    metrics["mismatch/frac_masked"] = masked_mean((mask & ~keep).to(log_ratio.dtype), mask)
    return RolloutCorrection(weights, torch.where(keep, response_mask, torch.zeros_like(response_mask)), metrics)
