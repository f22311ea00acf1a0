"""Span kinds: one small int per response token (docs/design.md section 2). No torch, so the rollout side can label tokens without it."""

from enum import IntEnum


class SpanKind(IntEnum):
    """What a response token is. The span tensor is the source of truth; the loss mask derives from it."""

    PAD = 0  # trailing padding, no token
    ASSISTANT = 1  # sampled by the policy: gets loss
    OBSERVATION = 2  # tool/environment/user tokens and template tokens around them: no loss
