"""TRL recipe: spans and token-level rewards from a TRL ``GRPOTrainer`` batch with tools, so tool
tokens get no return and the reward reaches every earlier assistant turn (docs/verl.md).

TRL's batch: ``completion_mask`` ``(b, t)`` (1 on completion tokens, 0 on right padding and on rows
TRL masks as truncated), ``tool_mask`` ``(b, t)`` (0 on tool-result tokens, 1 elsewhere, padded
with 1) and one reward per sequence ``(b,)``.
"""

import torch

from agent_loop.integrations.spans import spans_from_masks
from masking.rewards import place_rewards
from masking.spans import response_mask_from_spans


def from_trl_batch(
    completion_mask: torch.Tensor, tool_mask: torch.Tensor | None, rewards: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(spans, response_mask, token_level_rewards)``, all ``(b, t)``, from a TRL batch.

    Spans: PAD where ``completion_mask`` is 0, OBSERVATION where ``tool_mask`` is 0, ASSISTANT
    elsewhere (``response_mask`` = TRL's loss mask ``completion_mask * tool_mask``). Each reward
    sits on its row's last ASSISTANT token, in the rewards' dtype (float32 for integer rewards).
    ValueError (naming the row) for a nonzero reward on a row without an ASSISTANT token (a row
    TRL masked as truncated): give it 0 or drop the row, TRL trains on none of its tokens.
    """
    present = completion_mask.bool()
    sampled = present if tool_mask is None else present & tool_mask.bool()
    spans = spans_from_masks(present, sampled)
    if rewards.shape != completion_mask.shape[:1]:
        raise ValueError(f"rewards must be one per sequence, shape ({completion_mask.shape[0]},); got {tuple(rewards.shape)}")
    dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    token_level_rewards = place_rewards(spans, rewards, dtype=dtype)
    return spans, response_mask_from_spans(spans, dtype), token_level_rewards
