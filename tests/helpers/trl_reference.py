"""Plain serial reference of agent_loop.integrations.trl.from_trl_batch (Python floats, one token at a
time), for tests/integrations/test_trl.py and the real-TRL batch in test_trl_real.py."""

import math

from tests.helpers.reference_returns import ASSISTANT, OBSERVATION, PAD


def from_trl_batch_ref(completion, tools, rewards, masked: str):
    """Serial reference: spans token by token, each reward on the row's last ASSISTANT token; a row
    without one raises ("raise", nonzero reward) or loses its reward ("drop")."""
    spans, token_rewards = [], []
    for row, (mask, tool, reward) in enumerate(zip(completion, tools, rewards)):
        if not math.isfinite(reward):
            raise ValueError(f"row {row}: reward is {reward}")
        kinds = [PAD if m == 0 else (ASSISTANT if k == 1 else OBSERVATION) for m, k in zip(mask, tool)]
        placed = [0.0] * len(kinds)
        last = max((p for p, kind in enumerate(kinds) if kind == ASSISTANT), default=None)
        if last is not None:
            placed[last] = reward
        elif reward != 0 and masked == "raise":
            raise ValueError(f"row {row}: a nonzero reward has no ASSISTANT token")
        spans.append(kinds)
        token_rewards.append(placed)
    return spans, token_rewards
