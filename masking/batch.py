"""Unpadded per-trajectory lists <-> the padded batch tensors of docs/design.md section 2 (verl DataProto layout).

Prompts are left-padded and responses right-padded, so ``input_ids = cat(prompts, responses)`` has
every sequence's prompt end at the same column, as verl's actor expects.
"""

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from masking.rewards import place_rewards
from masking.sessions import check_segments, dense_ids, row_ids, segment_numbers
from masking.spans import SPAN_DTYPE, SpanKind, response_mask_from_spans
from masking.validate import validate_spans


@dataclass
class Batch:
    """The padded batch tensors of one set of trajectories (docs/design.md section 2; verl DataProto names).

    ``b`` rows, ``p`` prompt columns (left-padded), ``t`` response columns (right-padded).
    """

    responses: torch.Tensor  # (b, t) long, pad id on PAD
    spans: torch.Tensor  # (b, t) int8 SpanKind
    response_mask: torch.Tensor  # (b, t) float, == (spans == ASSISTANT)
    turn_ids: torch.Tensor  # (b, t) int16, -1 on PAD
    old_logprobs: torch.Tensor  # (b, t) float, sampling logprobs on ASSISTANT tokens, 0 elsewhere
    token_level_rewards: torch.Tensor  # (b, t) float, rewards on each turn's/the episode's last ASSISTANT token
    prompts: torch.Tensor  # (b, p) long, left-padded
    input_ids: torch.Tensor  # (b, p + t) long, cat(prompts, responses)
    attention_mask: torch.Tensor  # (b, p + t) long
    position_ids: torch.Tensor  # (b, p + t) long
    rollout_logprobs: torch.Tensor | None = None  # (b, t) float, the sampler's logprobs (collate: = old_logprobs), kept
    # when a trainer replaces old_logprobs by its own (advantages.rollout_correction compares the two)
    # Filled in by the trainer after collation:
    index: torch.Tensor | None = None  # (b,) long, the prompt group of each row (group estimators)
    session: torch.Tensor | None = None  # (b,) long, dense session id of each row (collate(sessions=...)); None:
    # every row its own session. A session's rows are its segments (masking/sessions.py, docs/design.md section 3)
    segment: torch.Tensor | None = None  # (b,) long, the row's segment number within its session: 0, 1, ..
    values: torch.Tensor | None = None  # (b, t) float, value estimates (GAE)
    turn_states: torch.Tensor | None = None  # (b, n_turns) long, an id per turn of the task's state key (gigpo's
    # anchor states, Task.turn_states; equal ids: equal keys), -1 past a row's last turn
    advantages: torch.Tensor | None = None  # (b, t) float
    returns: torch.Tensor | None = None  # (b, t) float
    rollout_is_weights: torch.Tensor | None = None  # (b, t) float, importance weights of the policy loss (--rollout-is)
    loss_mask: torch.Tensor | None = None  # (b, t) float, the tokens the loss is over: response_mask less the ones
    # rollout correction rejected (--rollout-rs); response_mask itself always stays == (spans == ASSISTANT)

    @property
    def trained_mask(self) -> torch.Tensor:
        """``(b, t)``: ``loss_mask`` when the trainer set one, else ``response_mask`` (every ASSISTANT token)."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    @property
    def batch_size(self) -> int:
        return self.responses.shape[0]

    def to(self, device) -> "Batch":
        return Batch(**{name: tensor.to(device) for name, tensor in self.items()})

    def select(self, rows: torch.Tensor | Sequence[int]) -> "Batch":
        """The sub-batch of ``rows`` (an index tensor or list), same column layout."""
        return Batch(**{name: tensor[rows] for name, tensor in self.items()})

    # Read (and fill) like a mapping too, so code written for verl's ``batch["responses"]`` keeps working;
    # the keys are the fields that hold a tensor.
    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, getattr(self, name)) for name in self.keys())

    def get(self, name: str, default=None):
        return getattr(self, name, None) if name in self else default

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        return getattr(self, name)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        if name not in _FIELDS:
            raise KeyError(f"Batch has no field {name!r}; fields: {', '.join(_FIELDS)}")
        setattr(self, name, tensor)

    def __contains__(self, name: object) -> bool:
        return name in _FIELDS and getattr(self, name) is not None


_FIELDS = tuple(f.name for f in dataclasses.fields(Batch))


def _pad(rows: Sequence[Sequence], dtype: torch.dtype, value, side: str = "right") -> torch.Tensor:
    """``b`` rows of varied length -> one ``(b, longest)`` tensor of ``dtype``, ``value`` on ``side``."""
    tensors = [torch.as_tensor(list(row), dtype=dtype) for row in rows]
    return pad_sequence(tensors, batch_first=True, padding_value=value, padding_side=side)


def _check_row_counts(reference_name: str, b: int, named_rows: Sequence[tuple[str, Sequence]]) -> None:
    """Raise ValueError unless every ``(name, rows)`` has ``b`` rows, as ``reference_name`` has."""
    for name, rows in named_rows:
        if len(rows) != b:
            raise ValueError(f"{name} has {len(rows)} rows, {reference_name} has {b}")


def _check_row_lengths(
    reference_name: str,
    reference: Sequence[Sequence],
    named_rows: Sequence[tuple[str, Sequence[Sequence]]],
    spans: Sequence[Sequence[int]],
) -> None:
    """Raise ValueError (naming the row) unless each row of every ``(name, rows)`` is as long as
    that row of ``reference``, and no non-empty row of the unpadded ``spans`` holds a PAD."""
    for row in range(len(reference)):
        n = len(reference[row])
        for name, rows in named_rows:
            if len(rows[row]) != n:
                raise ValueError(f"row {row}: {name} has {len(rows[row])} entries, {reference_name} has {n}")
        if n and SpanKind.PAD in spans[row]:
            raise ValueError(f"row {row}: position {list(spans[row]).index(SpanKind.PAD)} is PAD inside an unpadded response")


def collate_rewards(
    spans: Sequence[Sequence[int]],
    turn_ids: Sequence[Sequence[int]],
    rewards: Sequence[float],
    turn_rewards: Sequence[Sequence[float] | None] | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    sessions: Sequence | None = None,
    segments: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad b trajectories' spans and turn ids and place their rewards: what the returns need.

    ``spans`` and ``turn_ids`` are per-row unpadded lists of one length per row; ``rewards`` one
    outcome reward per row; ``turn_rewards`` per row a list of per-turn rewards or None (or None
    for all rows). Returns ``(spans, turn_ids, token_level_rewards)``, right-padded ``(b, t)``:
    ``spans`` int8 SpanKind (PAD on padding), ``turn_ids`` int16 (-1 on padding) and
    ``token_level_rewards`` in ``dtype`` (:func:`~masking.rewards.place_rewards`: the outcome
    reward on each row's last ASSISTANT token, per-turn rewards on each turn's). These are the
    fields of :func:`collate`, which calls this; ``sessions``/``segments`` as there (the outcome
    reward then sits on the last segment of each session only).

    Raises ValueError (naming the row) when the lists disagree in rows or lengths, the spans are
    invalid, or a nonzero reward has no ASSISTANT token to sit on.
    """
    _check_row_counts("spans", len(spans), (("turn_ids", turn_ids), ("rewards", rewards)))
    _check_row_lengths("spans", spans, (("turn_ids", turn_ids),), spans)
    session, segment = _sessions(len(spans), sessions, segments, rewards)
    return _pad_and_place_rewards(spans, turn_ids, rewards, turn_rewards, dtype, session, segment)


def _sessions(b: int, sessions, segments, rewards, index=None, tasks=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(b,)`` dense session ids and segment numbers (None, None without ``sessions``), checked: each
    session's segments are numbered 0..n-1 and share one outcome reward, one ``index`` group and one
    ``tasks`` entry (when given). ValueError naming the rows otherwise."""
    if sessions is None and segments is None:
        return None, None
    if sessions is None or segments is None:
        raise ValueError("sessions and segments come together: one session id and one segment number per row")
    _check_row_counts("rewards", b, (("sessions", sessions), ("segments", segments)))
    session = dense_ids(row_ids(sessions, b, "sessions", what="session id"))
    segment = segment_numbers(segments, b, "segments")
    check_segments(session, segment)
    first = torch.full((b,), b, dtype=torch.long).scatter_reduce(0, session, torch.arange(b), "amin")[session]
    named = [("outcome reward", torch.as_tensor(list(rewards), dtype=torch.float64))]
    named += [(name, row_ids(values, b, name, what="key")) for name, values in (("index", index), ("tasks", tasks)) if values is not None]
    for name, per_row in named:
        differs = torch.nonzero(per_row != per_row[first])
        if len(differs):
            row = int(differs[0, 0])
            raise ValueError(
                f"rows {int(first[row])} and {row} are segments of one session but differ in {name}: "
                f"{_show(name, per_row, rewards, int(first[row]))} vs {_show(name, per_row, rewards, row)}"
            )
    return session, segment


def _show(name: str, per_row: torch.Tensor, rewards, row: int):
    return rewards[row] if name == "outcome reward" else int(per_row[row])


def _outcomes(rewards: Sequence[float], session: torch.Tensor | None, segment: torch.Tensor | None, dtype) -> torch.Tensor:
    """``(b,)`` the outcome reward to place on each row: the row's own, or with sessions the session's on
    its last segment and 0 on the others (a session is one sample with one return)."""
    outcome = torch.as_tensor(list(rewards), dtype=dtype)
    if session is None:
        return outcome
    count = torch.zeros(int(session.max()) + 1 if len(session) else 0, dtype=torch.long).index_add_(0, session, torch.ones_like(session))
    return torch.where(segment == count[session] - 1, outcome, 0.0).to(dtype)


def _pad_and_place_rewards(spans, turn_ids, rewards, turn_rewards, dtype, session=None, segment=None):
    """:func:`collate_rewards` on lists whose rows and lengths are already checked (``session``, ``segment``:
    ``(b,)`` tensors from :func:`_sessions`, or None)."""
    span_tensor = _pad(spans, SPAN_DTYPE, SpanKind.PAD)
    validate_spans(span_tensor)
    turn_tensor = _pad(turn_ids, torch.int16, -1)
    per_turn = None
    if turn_rewards is not None and any(r is not None for r in turn_rewards):
        per_turn = _pad([r or [] for r in turn_rewards], dtype, 0.0)
    outcome = _outcomes(rewards, session, segment, dtype)
    token_level_rewards = place_rewards(span_tensor, outcome, turn_tensor, per_turn, dtype=dtype)
    return span_tensor, turn_tensor, token_level_rewards


def _attention_mask(prompt_ids: Sequence[Sequence[int]], spans: torch.Tensor) -> torch.Tensor:
    """``(b, p + t)`` long: 1 on each row's prompt tokens (left-padded) and non-PAD response tokens."""
    prompt_attention = _pad([[1] * len(p) for p in prompt_ids], torch.long, 0, side="left")
    return torch.cat([prompt_attention, (spans != SpanKind.PAD).long()], dim=1)


def collate(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    spans: Sequence[Sequence[int]],
    turn_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    rewards: Sequence[float],
    turn_rewards: Sequence[Sequence[float] | None] | None = None,
    pad_token_id: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    sessions: Sequence | None = None,
    segments: Sequence[int] | None = None,
    index: Sequence | torch.Tensor | None = None,
    tasks: Sequence | None = None,
) -> Batch:
    """Pad b trajectories into batch tensors.

    Returns a :class:`Batch` with ``responses`` (b, t) long, ``spans`` (b, t) int8, ``response_mask`` (b, t),
    ``turn_ids`` (b, t) int16 (-1 on PAD), ``old_logprobs`` (b, t) and ``rollout_logprobs`` (b, t) (both the
    sampling logprobs, 0 off ASSISTANT tokens; a trainer may replace ``old_logprobs``), ``token_level_rewards`` (b, t)
    (outcome reward on the last ASSISTANT token, per-turn rewards on each turn's last ASSISTANT
    token), ``prompts`` (b, p) left-padded, ``input_ids`` (b, p + t), ``attention_mask`` (b, p + t)
    and ``position_ids`` (b, p + t). ``spans``, ``turn_ids`` and ``token_level_rewards`` are built as
    :func:`collate_rewards` builds them (after this function's own checks of the lists).

    Sessions (design.md section 3): ``sessions`` (an id per row) and ``segments`` (0, 1, .. in the session)
    give ``session`` (b,) (dense ids) and ``segment`` (b,); a session's outcome (each segment carries it in
    ``rewards``) sits on the last ASSISTANT token of its LAST segment only, per-turn rewards on their turns.
    ``index`` (group ids, kept) and ``tasks`` (checked only) must agree within a session. Without
    ``sessions`` every row is its own session (``session``/``segment`` None: the batch as it always was).

    Raises ValueError naming the row(s) when a row's lists disagree in length, its spans are invalid, or a
    session's segments are not numbered 0..n-1 or differ in reward, index or task.
    """
    per_token = (("spans", spans), ("turn_ids", turn_ids), ("logprobs", logprobs))
    _check_row_counts("response_ids", len(response_ids), (("prompt_ids", prompt_ids), *per_token, ("rewards", rewards)))
    _check_row_lengths("response_ids", response_ids, per_token, spans)
    session, segment = _sessions(len(response_ids), sessions, segments, rewards, index, tasks)
    span_tensor, turn_tensor, token_level_rewards = _pad_and_place_rewards(spans, turn_ids, rewards, turn_rewards, dtype,
                                                                           session, segment)
    responses = _pad(response_ids, torch.long, pad_token_id)
    prompts = _pad(prompt_ids, torch.long, pad_token_id, side="left")
    attention_mask = _attention_mask(prompt_ids, span_tensor)
    sampled = _pad(logprobs, dtype, 0.0)
    return Batch(
        responses=responses,
        spans=span_tensor,
        response_mask=response_mask_from_spans(span_tensor, dtype),
        turn_ids=turn_tensor,
        old_logprobs=sampled,
        token_level_rewards=token_level_rewards,
        prompts=prompts,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=(torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0),
        rollout_logprobs=sampled.clone(),
        index=None if index is None else row_ids(index, len(response_ids), "index"),
        session=session, segment=segment,
    )


def uncollate(batch: Batch) -> list[dict[str, list]]:
    """Inverse of :func:`collate` for the per-token lists: one dict per row with ``prompt_ids``,
    ``response_ids``, ``spans``, ``turn_ids`` and ``logprobs`` (the sampler's: ``rollout_logprobs``, or
    ``old_logprobs`` in a batch without them), padding removed."""
    sampled = batch.old_logprobs if batch.rollout_logprobs is None else batch.rollout_logprobs
    prompt_lengths = batch.attention_mask[:, : batch.prompts.shape[1]].sum(1).tolist()
    response_lengths = (batch.spans != SpanKind.PAD).sum(1).tolist()
    rows = []
    for row, (p, n) in enumerate(zip(prompt_lengths, response_lengths)):
        p_start = batch.prompts.shape[1] - p
        rows.append({
            "prompt_ids": batch.prompts[row, p_start:].tolist(),
            "response_ids": batch.responses[row, :n].tolist(),
            "spans": batch.spans[row, :n].tolist(),
            "turn_ids": batch.turn_ids[row, :n].tolist(),
            "logprobs": sampled[row, :n].tolist(),
        })
    return rows
