"""Masked statistics over ASSISTANT tokens (verl's ``masked_mean``/``masked_var``/``masked_whiten``).

``mask`` is ``(b, t)`` bool or 0/1 float; only True/1 positions count. Positions off the mask never
leak into a result (``torch.where``, so even a NaN there is ignored).

The whitening's constants live here, once, for every whitening in :mod:`advantages` (the torch,
compiled and Triton paths): :data:`WHITEN_EPS` and :data:`MIN_WHITEN_TOKENS`.

**Fewer than 2 tokens.** A Bessel-corrected variance needs two tokens. Checked (``check=True``, the
estimators' ``validate=True``), such a batch raises ``ValueError``, as verl's ``masked_var`` does.
Unchecked (the hot path, which cannot raise without a host sync), every whitening here gives
exactly 0 everywhere: off the mask as always, and on the mask too, where the centred value of a
single token is exactly 0 already (``v - mean(v)``; it is also what the biased variance's whitening
gives). A NaN there would turn the loss and then the weights NaN; a 0 advantage gives no gradient.
"""

import torch

WHITEN_EPS = 1e-8  # verl's masked_whiten epsilon, added to the variance
MIN_WHITEN_TOKENS = 2  # a Bessel-corrected variance needs at least two tokens


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics of ``dtype`` values accumulate in: float64 stays float64, every other
    float (float32, float16, bfloat16) float32, as verl's statistics of bf16 rewards."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set: a scalar, or reduced over ``dim``."""
    kept = torch.where(mask.bool(), values, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set: a scalar, or reduced over ``dim``. NaN if nothing is set."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(values, mask, dim) / count


def whitenable(count: int) -> bool:
    """Whether ``count`` ASSISTANT tokens (a Python int, already on the host) can be whitened: at
    least :data:`MIN_WHITEN_TOKENS`, so the Bessel-corrected variance is defined."""
    return count >= MIN_WHITEN_TOKENS


def check_whitenable(count: int, needed: int = MIN_WHITEN_TOKENS) -> None:
    """Raise ValueError unless ``count`` tokens (a Python int, already on the host) reach ``needed``
    (by default :data:`MIN_WHITEN_TOKENS`, a Bessel-corrected variance); no tensor, no host sync."""
    if count < needed:
        raise ValueError(
            f"need at least {needed} unmasked tokens for a Bessel-corrected variance, got {count} "
            "(a batch without enough ASSISTANT tokens cannot be whitened)"
        )


def check_enough_tokens(mask: torch.Tensor, needed: int = MIN_WHITEN_TOKENS) -> None:
    """Raise ValueError if fewer than ``needed`` positions of the ``(b, t)`` ``mask`` are set
    (:func:`check_whitenable` on their count; costs one host sync)."""
    check_whitenable(int(mask.bool().sum()), needed)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, check: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the set positions (a scalar), Bessel-corrected when ``unbiased``.

    ``check`` raises ValueError when fewer than 2 positions (1 if not ``unbiased``) are set; that
    check syncs with the host. With ``check=False`` such input gives NaN instead.
    """
    if check:
        check_enough_tokens(mask, MIN_WHITEN_TOKENS if unbiased else 1)
    count = mask.bool().sum()
    centered = values - masked_mean(values, mask)
    return masked_sum(centered.square(), mask) / (count - 1 if unbiased else count).clamp(min=0)  # 0/0: NaN


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, check: bool = True, eps: float = WHITEN_EPS
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` over the set positions, 0 elsewhere (same shape and dtype;
    computed in :func:`accumulation_dtype`, so bf16 values are whitened in float32 and rounded once).

    ``shift_mean=False`` adds the mean back (only rescales). ``check`` as in :func:`masked_var`;
    with ``check=False`` fewer than 2 set positions give 0 on them (the module docstring), plus
    the mean with ``shift_mean=False``.
    """
    work = values.to(accumulation_dtype(values.dtype))  # half precisions whiten in float32, rounded once at the end
    mean = masked_mean(work, mask)
    scale = torch.rsqrt(masked_var(work, mask, check=check) + eps)
    if not check:  # no variance below 2 tokens: scale 0 (the centred value is 0 there anyway), no host sync
        scale = torch.where(mask.bool().sum() >= MIN_WHITEN_TOKENS, scale, 0.0)
    whitened = (work - mean) * scale
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0).to(values.dtype if values.dtype.is_floating_point else work.dtype)
