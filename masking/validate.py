"""Checks on span and reward tensors, with errors that name the row and position.

Each check costs one host synchronisation (to decide whether to raise). Keep them on by default;
hot paths pass ``validate=False`` to the estimators.
"""

import torch

from masking.spans import SpanKind

_KNOWN_SPANS = (SpanKind.PAD, SpanKind.ASSISTANT, SpanKind.OBSERVATION)


def _first_bad(bad: torch.Tensor) -> tuple[int, int] | None:
    """(row, position) of the first True in a (b, t) bool tensor, or None."""
    if not bool(bad.any()):
        return None
    row, pos = torch.nonzero(bad)[0].tolist()
    return row, pos


def check_same_shape(name: str, tensor: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    """Raise ValueError unless ``tensor`` is 2-D and has the shape of ``reference``."""
    if tensor.dim() != 2 or tensor.shape != reference.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)} "
            f"(the (b, t) shape of {reference_name})"
        )


def validate_spans(spans: torch.Tensor) -> None:
    """Raise ValueError unless ``spans`` (b, t) holds only SpanKind values and PAD only trails each row."""
    if spans.dim() != 2:
        raise ValueError(f"spans must be (b, t), got shape {tuple(spans.shape)}")
    if spans.dtype.is_floating_point or spans.dtype == torch.bool:
        raise ValueError(f"spans must have an integer dtype, got {spans.dtype}")
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
        raise ValueError(
            f"token_level_rewards: reward {float(token_level_rewards[row, pos])} at row {row}, position {pos} "
            f"sits on a {kind} token and would be lost; place rewards on ASSISTANT tokens"
        )
