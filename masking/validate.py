"""Checks on span and reward tensors, with errors that name the row and position.

Each ``validate_*`` check costs one host synchronisation (to decide whether to raise).
:func:`validate_batch` runs all of them in one cheap fused pass (on CPU a compiled loop,
:mod:`masking.native_checks`; elsewhere torch ops with one synchronisation), and falls back to the
single checks (for their messages) only when something is wrong. Keep validation on by default;
hot paths pass ``validate=False`` to the estimators.
"""

import torch

from masking.native_checks import native_check
from masking.spans import SpanKind, spans_from_response_mask

_KNOWN_SPANS = (SpanKind.PAD, SpanKind.ASSISTANT, SpanKind.OBSERVATION)


def _first_bad(bad: torch.Tensor) -> tuple[int, int] | None:
    """(row, position) of the first True in a (b, t) bool tensor, or None."""
    if not bool(bad.any()):
        return None
    row, pos = torch.nonzero(bad)[0].tolist()
    return row, pos


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipping the call when ``x`` has it (even a no-op ``to`` pays a call's
    overhead, which adds up in a small batch's call)."""
    return x if x.dtype == dtype else x.to(dtype)


def check_same_shape(name: str, tensor: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    """Raise ValueError unless ``tensor`` is 2-D and has the shape of ``reference``."""
    if tensor.dim() != 2 or tensor.shape != reference.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)} "
            f"(the (b, t) shape of {reference_name})"
        )


def validate_spans(spans: torch.Tensor) -> None:
    """Raise ValueError unless ``spans`` (b, t) holds only SpanKind values and PAD only trails each row."""
    validate_spans_dtype(spans)
    known = torch.zeros_like(spans, dtype=torch.bool)
    for kind in _KNOWN_SPANS:
        known |= spans == kind
    where = _first_bad(~known)
    if where is not None:
        row, pos = where
        raise ValueError(f"spans: unknown span value {int(spans[row, pos])} at row {row}, position {pos}")
    # PAD must not be followed by a non-PAD token: a PAD at t is bad if any later token is not PAD.
    is_pad = spans == SpanKind.PAD
    later_non_pad = torch.flip(torch.cumsum(torch.flip((~is_pad).int(), [1]), 1), [1]) - (~is_pad).int()
    where = _first_bad(is_pad & (later_non_pad > 0))
    if where is not None:
        row, pos = where
        raise ValueError(f"spans: PAD at row {row}, position {pos} comes before a non-PAD token")


def validate_spans_dtype(spans: torch.Tensor) -> None:
    """Raise ValueError unless ``spans`` is a 2-D integer tensor (free: no host sync)."""
    if spans.dim() != 2:
        raise ValueError(f"spans must be (b, t), got shape {tuple(spans.shape)}")
    if spans.dtype.is_floating_point or spans.dtype == torch.bool:
        raise ValueError(f"spans must have an integer dtype, got {spans.dtype}")


def validate_response_mask(response_mask: torch.Tensor) -> None:
    """Raise ValueError unless the (b, t) mask holds only 0 and 1."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (b, t), got shape {tuple(response_mask.shape)}")
    where = _first_bad((response_mask != 0) & (response_mask != 1))
    if where is not None:
        row, pos = where
        raise ValueError(
            f"response_mask: value {float(response_mask[row, pos])} at row {row}, position {pos} is not 0 or 1"
        )


def validate_token_level_rewards(token_level_rewards: torch.Tensor, spans: torch.Tensor) -> None:
    """Raise ValueError on NaN/inf rewards and on nonzero rewards off ASSISTANT tokens.

    Every return estimator would silently drop a reward placed on an OBSERVATION or PAD token
    (their returns are 0 by definition), so it is rejected here instead (docs/design.md section 2).
    """
    check_same_shape("token_level_rewards", token_level_rewards, "spans", spans)
    where = _first_bad(~torch.isfinite(token_level_rewards))
    if where is not None:
        row, pos = where
        raise ValueError(
            f"token_level_rewards: non-finite value {float(token_level_rewards[row, pos])} "
            f"at row {row}, position {pos}"
        )
    where = _first_bad((token_level_rewards != 0) & (spans != SpanKind.ASSISTANT))
    if where is not None:
        row, pos = where
        kind = SpanKind(int(spans[row, pos])).name
        article = "an" if kind[0] in "AEIOU" else "a"  # an OBSERVATION, a PAD
        raise ValueError(
            f"token_level_rewards: reward {float(token_level_rewards[row, pos])} at row {row}, position {pos} "
            f"sits on {article} {kind} token and would be lost; place rewards on ASSISTANT tokens"
        )


def validate_mask_matches_spans(response_mask: torch.Tensor, spans: torch.Tensor) -> None:
    """Raise ValueError unless the (b, t) mask equals ``spans == ASSISTANT`` everywhere."""
    disagree = response_mask.bool() != (spans == SpanKind.ASSISTANT)
    where = _first_bad(disagree)
    if where is not None:
        row, pos = where
        raise ValueError(
            f"response_mask is {float(response_mask[row, pos])} at row {row}, position {pos} but the span there "
            f"is {SpanKind(int(spans[row, pos])).name}; the mask must equal (spans == ASSISTANT)"
        )


CPU_BLOCK_ELEMENTS = 2**19  # rows checked together on CPU (as the scans' blocks): temporaries stay in the cache


def validate_batch(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    spans: torch.Tensor | None = None,
    count: bool = False,
) -> int | None:
    """Every value check of a batch in one fused pass; with ``count``, returns the number of ASSISTANT tokens.

    The same checks, in the same order and with the same messages (row and position), as
    :func:`validate_response_mask`, :func:`validate_spans`, :func:`validate_mask_matches_spans` and
    :func:`validate_token_level_rewards` (with ``spans=None`` every 0 of the mask is an OBSERVATION).
    ``(b, t)`` tensors of one shape (the caller checks shapes); ``token_level_rewards`` floating point.

    On CPU, contiguous float32/float64 rewards (any 0/1 mask dtype, int8/uint8 spans) are checked
    by one compiled loop (:func:`masking.native_checks.native_check`). Otherwise, and on CUDA, each
    check becomes a residual that is exactly 0 everywhere on good input, and all their reductions
    reach the host together (one synchronisation on CUDA):

    * ``max(spans as uint8) <= 2`` iff every span is known (a negative int8 is >= 128 as uint8);
    * for known spans, ``spans[t + 1] - 2 spans[t]`` (in {-4, .., 2}) is positive exactly where a
      PAD precedes a non-PAD, so its max is <= 0 iff PAD only trails;
    * ``(spans & 1) - mask`` (``spans & 1`` is the ASSISTANT indicator of a known span) is 0 iff the
      mask is 0/1 and equals ``spans == ASSISTANT``; without spans ``mask - mask * mask`` is 0 iff it is 0/1;
    * ``rewards - rewards * mask`` is 0 iff every reward is finite (``inf - inf`` and NaN are NaN)
      and 0 off the mask.

    The two float residuals share one buffer, reduced by an integer min and max of its bits (+0.0
    is the only float whose bits are all 0). Only a nonzero residual runs the single checks, which
    raise with their messages. On CPU, rows are checked in blocks of :data:`CPU_BLOCK_ELEMENTS`;
    the estimators then skip zeroing the rewards off the mask (validated), which the rewards
    residual paid for (BENCHMARKS.md, issue 20).
    """
    if spans is not None:
        validate_spans_dtype(spans)
    if token_level_rewards.numel() == 0:
        return 0 if count else None
    native = native_check(token_level_rewards, response_mask, spans)
    if native is not None:
        ok, tokens = native
        if not ok:
            _raise_first_failure(token_level_rewards, response_mask, spans)
        return tokens if count else None
    return _validate_with_torch(token_level_rewards, response_mask, spans, count)


def _validate_with_torch(token_level_rewards, response_mask, spans, count: bool) -> int | None:
    """:func:`validate_batch` in torch ops, for a non-empty ``(b, t)`` batch: the residual checks
    of :func:`_block_checks` (and, with ``count``, the number of ASSISTANT tokens) reach the host
    together; only a residual out of its bounds runs the single checks, which raise."""
    checks = _block_checks(token_level_rewards, response_mask, spans)
    if count:  # exact for 0/1 values
        exact = token_level_rewards.dtype == torch.float32 and token_level_rewards.numel() <= 2**24
        tokens = as_dtype(response_mask, token_level_rewards.dtype).sum(dtype=None if exact else torch.float64)
        checks.append((tokens, 0, float("inf")))
    values = _to_host([value for value, _, _ in checks])
    total = int(values[-1]) if count else None
    if not all(low <= value <= high for value, (_, low, high) in zip(values, checks)):  # NaN is never within
        _raise_first_failure(token_level_rewards, response_mask, spans)
    return total


def _block_checks(token_level_rewards, response_mask, spans) -> list[tuple[torch.Tensor, float, float]]:
    """:func:`_residual_checks` of the ``(b, t)`` batch: on CPU per block of about
    :data:`CPU_BLOCK_ELEMENTS` elements of rows, elsewhere of the whole batch."""
    b, t = token_level_rewards.shape
    rows = b if token_level_rewards.device.type != "cpu" else max(1, CPU_BLOCK_ELEMENTS // t)
    if b <= rows:  # one block (no slicing: at small sizes every op counts)
        return _residual_checks(token_level_rewards, response_mask, spans)
    return [  # per block of rows: (0-d tensor, low, high): on good input low <= value <= high
        check
        for start in range(0, b, rows)
        for check in _residual_checks(
            token_level_rewards[start : start + rows],
            response_mask[start : start + rows],
            None if spans is None else spans[start : start + rows],
        )
    ]


def _raise_first_failure(token_level_rewards, response_mask, spans) -> None:
    """The single checks in their order: the first that fails raises with its row and position."""
    validate_response_mask(response_mask)
    if spans is None:
        spans = spans_from_response_mask(response_mask)
    else:
        validate_spans(spans)
        validate_mask_matches_spans(response_mask, spans)
    validate_token_level_rewards(token_level_rewards, spans)


def _residual_checks(token_level_rewards, mask, spans) -> list[tuple[torch.Tensor, float, float]]:
    """The reductions of :func:`validate_batch`'s residuals over one block of rows, as
    ``(0-d tensor, low, high)``: on good input ``low <= value <= high``."""
    checks = []
    if spans is not None:
        if spans.dtype in (torch.int8, torch.uint8):
            checks.append((spans.view(torch.uint8).amax(), 0, 2))
            spans8 = spans if spans.dtype == torch.int8 else spans.view(torch.int8)
        else:
            checks += [(extreme, 0, 2) for extreme in spans.aminmax()]
            spans8 = spans.to(torch.int8)
        if spans.shape[-1] > 1:  # for known spans, s[t + 1] - 2 s[t] > 0 exactly where a PAD precedes a non-PAD
            later, earlier = spans8.narrow(-1, 1, spans.shape[-1] - 1), spans8.narrow(-1, 0, spans.shape[-1] - 1)
            checks.append((torch.sub(later, earlier, alpha=2).amax(), -4, 0))
        is_assistant = torch.bitwise_and(spans8, _ONE)  # exact where every span is known (checked above)
    else:
        is_assistant = None
    numeric = None if spans is None and mask.dtype == torch.bool else mask  # a bool mask is 0/1
    mask_r = as_dtype(mask, token_level_rewards.dtype)
    if numeric is not None and numeric.dtype == token_level_rewards.dtype:  # both residuals in one buffer, one reduction
        residuals = torch.empty((2, *mask.shape), dtype=numeric.dtype, device=mask.device)
        mask_residual, rewards_residual = residuals
        _mask_residual(numeric, is_assistant, mask_residual)
        torch.addcmul(token_level_rewards, token_level_rewards, mask_r, value=-1, out=rewards_residual)
        extrema = list(_bits(residuals).aminmax())
    else:
        if numeric is not None and numeric.dtype == torch.bool:
            numeric = numeric.to(torch.int8)
        extrema = [] if numeric is None else list(_mask_residual(numeric, is_assistant).aminmax())
        extrema += torch.addcmul(token_level_rewards, token_level_rewards, mask_r, value=-1).aminmax()
    return checks + [(value, 0, 0) for value in extrema]


_ONE = torch.tensor(1, dtype=torch.int8)  # a 0-d CPU tensor combines with tensors on any device


def _mask_residual(mask: torch.Tensor, is_assistant: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """0 everywhere iff ``mask`` equals ``is_assistant`` (0/1 int8), or, without it, iff ``mask`` is 0/1."""
    if is_assistant is None:
        return torch.addcmul(mask, mask, mask, value=-1, out=out)
    if out is None:
        return torch.sub(mask, is_assistant)
    return out.copy_(is_assistant).sub_(mask)  # one conversion, then a sub of one dtype (faster than a mixed sub)


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(residuals: torch.Tensor) -> torch.Tensor:
    """The float ``residuals`` viewed as integers of the same size: 0 exactly where a residual is +0.0
    (a valid input gives +0.0 everywhere; -0.0, rare, only sends the input to the single checks). An
    integer min and max reduce faster than a float ``aminmax``, and see NaN and inf as nonzero."""
    return residuals.view(_SAME_SIZE_INT[residuals.element_size()])


def _to_host(scalars: list[torch.Tensor]) -> list[float]:
    """Python numbers of 0-d tensors: one ``tolist`` (one synchronisation) on an accelerator; on
    the CPU each is read directly (cheaper than stacking, and there is nothing to wait for)."""
    if scalars[0].device.type == "cpu":
        return [value.item() for value in scalars]
    return torch.stack([value.double() for value in scalars]).tolist()
