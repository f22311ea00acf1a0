"""Token spans and batch tensors: SpanKind, collation, reward placement, validation. Depends on torch only."""

from masking.batch import collate, uncollate
from masking.rewards import last_assistant_index, last_assistant_index_per_turn, place_rewards
from masking.spans import SPAN_DTYPE, SpanKind, response_mask_from_spans, spans_from_response_mask
from masking.validate import (
    check_same_shape,
    validate_batch,
    validate_response_mask,
    validate_spans,
    validate_token_level_rewards,
)

__all__ = [
    "SPAN_DTYPE",
    "SpanKind",
    "check_same_shape",
    "collate",
    "last_assistant_index",
    "last_assistant_index_per_turn",
    "place_rewards",
    "response_mask_from_spans",
    "spans_from_response_mask",
    "uncollate",
    "validate_batch",
    "validate_response_mask",
    "validate_spans",
    "validate_token_level_rewards",
]
