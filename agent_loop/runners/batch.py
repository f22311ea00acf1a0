"""Trajectories -> batch tensors: the bridge from the rollout side to ``masking`` (docs/design.md section 2)."""

from __future__ import annotations

from typing import Sequence

import torch

from agent_loop.episode.contracts import turn_state_keys
from agent_loop.types import Trajectory
from masking.batch import Batch, collate
from masking.spans import SpanKind


def trajectories_to_batch(
    trajectories: Sequence[Trajectory], pad_token_id: int = 0, dtype: torch.dtype = torch.float32, *,
    index: Sequence[int] | None = None, sessions: bool = True,
) -> Batch:
    """Collate trajectories into the batch tensors of docs/design.md section 2 (see ``masking.collate``);
    each is checked first (:meth:`Trajectory.check`), a ValueError naming its row.

    Where a session has several segments (an agent rewrote its history), the batch carries ``session`` and
    ``segment``, and collate checks each session's segments: numbered in order, one reward, one task row and,
    given ``index`` (one group per row), one group (the batch's ``index`` is then set, renumbered). The
    estimators then treat each session as one sample. Where every session has one segment, the batch is what it
    always was. ``sessions=False``: every segment its own row, carrying its session's reward (the row-per-segment
    ablation, biased: docs/design.md section 3)."""
    for row, trajectory in enumerate(trajectories):
        try:
            trajectory.check()
        except ValueError as error:
            raise ValueError(f"row {row}: {error}") from None
    batch = collate(
        prompt_ids=[t.prompt_ids for t in trajectories],
        response_ids=[t.response_ids for t in trajectories],
        spans=[t.spans for t in trajectories],
        turn_ids=[t.turn_ids for t in trajectories],
        logprobs=[t.logprobs for t in trajectories],
        rewards=[t.reward for t in trajectories],
        turn_rewards=[t.turn_rewards for t in trajectories],
        pad_token_id=pad_token_id,
        dtype=dtype,
        **(_sessions(trajectories, index) if sessions else {}),
    )
    batch.turn_states = turn_state_ids(trajectories)
    return batch


def _sessions(trajectories: Sequence[Trajectory], index: Sequence[int] | None) -> dict:
    """collate's session arguments (``index`` checked per session) where some session has several segments."""
    if not any(t.segment for t in trajectories):
        return {}
    return {"sessions": [t.session_id for t in trajectories], "segments": [t.segment for t in trajectories],
            "tasks": [f"{t.info.get('task')}/{t.info.get('seed')}/{t.info.get('index')}" for t in trajectories],
            **({} if index is None else {"index": index})}


def turn_state_ids(trajectories: Sequence[Trajectory]) -> torch.Tensor | None:
    """``(b, n_turns)`` long: the task's state key of each turn (``info["turn_states"]``, :meth:`Task.turn_states`)
    as an id per distinct key over the batch (equal keys, equal ids; in order of first appearance), -1 past a
    row's last turn; None when no episode records them. ValueError naming the row when only some do, or a
    row's keys are not one per assistant turn."""
    recorded = [t.info.get("turn_states") for t in trajectories]
    if all(states is None for states in recorded):
        return None
    ids: dict = {}
    rows = []
    for row, (trajectory, states) in enumerate(zip(trajectories, recorded)):
        if states is None:
            first = next(r for r, s in enumerate(recorded) if s is not None)
            raise ValueError(f"row {row}: no turn_states, while row {first} has them (a task gives every episode "
                             "its turn states, or none)")
        turns = len({k for k, s in zip(trajectory.turn_ids, trajectory.spans) if s == SpanKind.ASSISTANT})
        try:
            keys = turn_state_keys(states, turns, "info['turn_states']")
        except (TypeError, ValueError) as error:
            raise ValueError(f"row {row}: {error}") from None
        rows.append([ids.setdefault(key, len(ids)) for key in keys])
    width = max(map(len, rows), default=0)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long).reshape(len(rows), width)


# the batch fields an estimator may accept (advantages.registry.Estimator.batch_arguments) -> the Batch's name
ESTIMATOR_FIELDS = ("index", "values", "spans", "turn_ids", "responses", "turn_states")


def estimator_arguments(estimator, batch: Batch) -> dict[str, torch.Tensor]:
    """The batch fields ``estimator`` (a registry entry) accepts, from ``batch``, beside the rewards and the mask:
    those of :data:`ESTIMATOR_FIELDS` it names in ``batch_arguments`` and ``batch`` holds (a missing ``index`` or
    ``values`` it needs is the estimator's own ValueError)."""
    accepted = set(estimator.batch_arguments)
    fields = {name: batch[name] for name in ESTIMATOR_FIELDS if name in accepted and name in batch}
    if batch.session is not None:  # segments of sessions: the estimator runs on each session's joined segments
        fields.update(session=batch.session, segment=batch.segment, spans=batch.spans)
    return fields
