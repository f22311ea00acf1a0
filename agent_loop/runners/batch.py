"""Trajectories -> batch tensors: the bridge from the rollout side to ``masking`` (docs/design.md section 2)."""

from __future__ import annotations

from typing import Sequence

import torch

from agent_loop.types import Trajectory
from masking.batch import Batch, collate


def trajectories_to_batch(
    trajectories: Sequence[Trajectory], pad_token_id: int = 0, dtype: torch.dtype = torch.float32
) -> Batch:
    """Collate trajectories into the batch tensors of docs/design.md section 2 (see ``masking.collate``);
    each is checked first (:meth:`Trajectory.check`), a ValueError naming its row."""
    for row, trajectory in enumerate(trajectories):
        try:
            trajectory.check()
        except ValueError as error:
            raise ValueError(f"row {row}: {error}") from None
    return collate(
        prompt_ids=[t.prompt_ids for t in trajectories],
        response_ids=[t.response_ids for t in trajectories],
        spans=[t.spans for t in trajectories],
        turn_ids=[t.turn_ids for t in trajectories],
        logprobs=[t.logprobs for t in trajectories],
        rewards=[t.reward for t in trajectories],
        turn_rewards=[t.turn_rewards for t in trajectories],
        pad_token_id=pad_token_id,
        dtype=dtype,
    )
