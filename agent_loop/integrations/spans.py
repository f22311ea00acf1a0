"""Spans from the two masks every trainer has: which response positions hold a token, and which of
those the policy sampled (docs/design.md section 2)."""

import torch

from masking.spans import SPAN_DTYPE, SpanKind
from masking.validate import check_same_shape, validate_response_mask, validate_spans


def spans_from_masks(present: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """``(b, t)`` spans: PAD where ``present`` is 0, ASSISTANT where ``sampled`` is 1, OBSERVATION for
    the other present tokens (tool results and the template tokens around them).

    ``present`` and ``sampled`` are ``(b, t)`` 0/1 (any dtype). ValueError, naming row and position,
    for a sampled token that is not present and for PAD before a present token (padding must trail).
    One host sync per check.
    """
    check_same_shape("sampled", sampled, "present", present)
    validate_response_mask(present)
    validate_response_mask(sampled)
    present, sampled = present.bool(), sampled.bool()
    orphan = sampled & ~present
    if bool(orphan.any()):
        row, pos = torch.nonzero(orphan)[0].tolist()
        raise ValueError(f"row {row}, position {pos} is marked sampled but holds no token (its padding mask is 0)")
    spans = torch.where(sampled, SpanKind.ASSISTANT, torch.where(present, SpanKind.OBSERVATION, SpanKind.PAD))
    spans = spans.to(SPAN_DTYPE)
    validate_spans(spans)
    return spans
