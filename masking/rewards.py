"""Where rewards sit: on the last ASSISTANT token of a row (outcome) or of each turn (per-turn rewards),
and what to do with a reward found on an OBSERVATION token (:func:`relocate_observation_rewards`)."""

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


OBSERVATION_REWARD_POLICIES = ("raise", "move", "drop")


def relocate_observation_rewards(
    token_level_rewards: torch.Tensor, spans: torch.Tensor, policy: str = "raise"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a policy to the rewards that sit on OBSERVATION tokens (a trajectory that ends in a tool
    output, as custom verl agent loops produce, puts its reward there; every return would lose it).

    Args:
        token_level_rewards: ``(b, t)`` float rewards.
        spans: ``(b, t)`` SpanKind (mask-only callers: :func:`~masking.spans.spans_from_response_mask`).
        policy: ``"raise"``: ValueError naming the row and position of the first such reward (one
            host sync, to decide); ``"move"``: add each to the last ASSISTANT token before it in its
            row (a reward with no ASSISTANT token before it stays where it is); ``"drop"``: set them
            to 0, as verl's REINFORCE++ and GAE loops ignore them.

    Returns:
        ``(rewards, count)``: new ``(b, t)`` rewards in the input's dtype (the input is not changed)
        and a 0-dim int64 tensor, the number of rewards moved or dropped. No host sync for "move"
        and "drop". Only finite nonzero rewards on OBSERVATION tokens are touched: NaN/inf and
        rewards on PAD stay where they are, for validation to name (nothing is lost silently).
    """
    if policy not in OBSERVATION_REWARD_POLICIES:
        raise ValueError(f"observation reward policy must be one of {OBSERVATION_REWARD_POLICIES}, got {policy!r}")
    if token_level_rewards.dim() != 2 or spans.shape != token_level_rewards.shape:
        raise ValueError(f"spans {tuple(spans.shape)} and token_level_rewards {tuple(token_level_rewards.shape)} "
                         "must both be (b, t)")
    found = (spans == SpanKind.OBSERVATION) & (token_level_rewards != 0) & torch.isfinite(token_level_rewards)
    if policy == "raise":
        if bool(found.any()):
            row, pos = torch.nonzero(found)[0].tolist()
            raise ValueError(
                f"token_level_rewards: reward {float(token_level_rewards[row, pos])} at row {row}, position {pos} "
                "sits on an OBSERVATION token and would be lost; move it to an ASSISTANT token "
                "(observation_reward='move') or drop it as verl does (observation_reward='drop')"
            )
        return token_level_rewards, found.sum()
    if policy == "move":
        positions = torch.arange(spans.shape[1], device=spans.device).expand(spans.shape)
        before = torch.where(spans == SpanKind.ASSISTANT, positions, -1).cummax(dim=1).values  # -1: none yet
        found &= before >= 0
    kept = torch.where(found, 0.0, token_level_rewards)  # a Python scalar keeps the rewards' dtype
    if policy == "move":
        kept = kept.scatter_add(1, before.clamp(min=0), torch.where(found, token_level_rewards, 0.0))
    return kept, found.sum()
