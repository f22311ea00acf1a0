"""Span tensors: the mask derived from spans and back (docs/design.md section 2)."""

import torch

from masking.kinds import SpanKind

SPAN_DTYPE = torch.int8


def response_mask_from_spans(spans: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(b, t)`` spans -> ``(b, t)`` mask, 1 where the token was sampled by the policy."""
    return (spans == SpanKind.ASSISTANT).to(dtype)


def spans_from_response_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """Mask-only input: every 0 is treated as OBSERVATION (verl after PR #7300), never as PAD."""
    return torch.where(response_mask.bool(), SpanKind.ASSISTANT, SpanKind.OBSERVATION).to(SPAN_DTYPE)
