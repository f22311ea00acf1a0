"""Token spans and batch tensors: SpanKind, collation, reward placement, validation. Depends on torch only.

``SpanKind`` (``masking.kinds``) imports without torch, so the rollout side (which only labels tokens) stays
importable without it; the tensor functions load torch on first use (PEP 562 lazy attributes).
"""

import importlib

from masking.kinds import SpanKind

_LAZY = {
    "Batch": "masking.batch", "collate": "masking.batch", "collate_rewards": "masking.batch",
    "uncollate": "masking.batch",
    "last_assistant_index": "masking.rewards", "last_assistant_index_per_turn": "masking.rewards",
    "place_rewards": "masking.rewards", "relocate_observation_rewards": "masking.rewards",
    "OBSERVATION_REWARD_POLICIES": "masking.rewards",
    "SessionJoin": "masking.sessions", "session_join": "masking.sessions", "join_tokens": "masking.sessions",
    "split_tokens": "masking.sessions",
    "SPAN_DTYPE": "masking.spans", "response_mask_from_spans": "masking.spans", "spans_from_response_mask": "masking.spans",
    "check_same_shape": "masking.validate", "validate_response_mask": "masking.validate",
    "validate_batch": "masking.validate", "validate_spans": "masking.validate",
    "validate_token_level_rewards": "masking.validate",
}

__all__ = ["SpanKind", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'masking' has no attribute {name!r}")
