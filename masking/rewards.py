"""Where rewards sit: on the last ASSISTANT token of a row (outcome) or of each turn (per-turn rewards)."""

import torch

from masking.spans import SpanKind


def last_assistant_index(spans: torch.Tensor) -> torch.Tensor:
    """``(b, t)`` spans -> ``(b,)`` long index of each row's last ASSISTANT token, -1 where there is none."""
    positions = torch.arange(spans.shape[1], device=spans.device).expand_as(spans)
    # the -1 column keeps amax defined for t == 0 (a batch where no episode produced a token)
    marked = torch.where(spans == SpanKind.ASSISTANT, positions, -1)
    return torch.cat([marked, marked.new_full((marked.shape[0], 1), -1)], dim=1).amax(dim=1)


def last_assistant_index_per_turn(spans: torch.Tensor, turn_ids: torch.Tensor, num_turns: int) -> torch.Tensor:
    """``(b, t)`` spans and turn ids -> ``(b, num_turns)`` index of each turn's last ASSISTANT token, -1 if none."""
    b, t = spans.shape
    positions = torch.arange(t, device=spans.device).expand(b, t)
    is_assistant = spans == SpanKind.ASSISTANT
    # Non-assistant tokens write -1 into an extra overflow column that is dropped afterwards.
    column = torch.where(is_assistant, turn_ids.long(), num_turns)
    out = torch.full((b, num_turns + 1), -1, dtype=torch.long, device=spans.device)
    out.scatter_reduce_(1, column, torch.where(is_assistant, positions, -1), reduce="amax")
    return out[:, :num_turns]


def place_rewards(
    spans: torch.Tensor,
    outcome_rewards: torch.Tensor,
    turn_ids: torch.Tensor | None = None,
    turn_rewards: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Build ``token_level_rewards`` (b, t) from per-row outcome rewards and optional per-turn rewards.

    Args:
        spans: (b, t) SpanKind.
        outcome_rewards: (b,) reward of each episode, placed on the row's last ASSISTANT token.
        turn_ids: (b, t) assistant-turn index per token (needed with ``turn_rewards``).
        turn_rewards: (b, n) reward of each turn, placed on that turn's last ASSISTANT token
            (added to the outcome reward where both land on the same token). Use 0 for absent turns.

    Rows without any ASSISTANT token cannot hold a reward: a nonzero reward there raises ValueError,
    since it would be lost.
    """
    b, t = spans.shape
    rewards = torch.zeros(b, t + 1, dtype=dtype, device=spans.device)  # column t: sink for "no token"
    last = last_assistant_index(spans)
    rewards.scatter_add_(1, torch.where(last >= 0, last, t).unsqueeze(1), outcome_rewards.to(dtype).unsqueeze(1))
    if turn_rewards is not None:
        if turn_ids is None:
            raise ValueError("turn_rewards need turn_ids")
        per_turn_last = last_assistant_index_per_turn(spans, turn_ids, turn_rewards.shape[1])
        rewards.scatter_add_(1, torch.where(per_turn_last >= 0, per_turn_last, t), turn_rewards.to(dtype))
    lost = rewards[:, t] != 0
    if bool(lost.any()):
        row = int(torch.nonzero(lost)[0, 0])
        raise ValueError(f"row {row}: a nonzero reward has no ASSISTANT token to sit on and would be lost")
    return rewards[:, :t]
