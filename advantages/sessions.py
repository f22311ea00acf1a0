"""Every estimator, session-aware by one mechanism: join each session's segments into one row, run the
session-free estimator there, read the results back (docs/design.md section 3, "Sessions"; issue 54).

:func:`estimate_by_session` is what :class:`advantages.registry.Estimator` calls when given
``session=``/``segment=``. The joined batch (:mod:`masking.sessions`) holds one row per session: its
segments end to end, turn ids continued, ``turn_states`` concatenated, ``index`` the session's group.
So, for every registered estimator at once: a session counts once in group statistics (GRPO's mean
and std, RLOO's leave-one-out, the turn-index and GiGPO anchor sets, which then exclude every segment
of the session's own), returns run across segment boundaries in segment order (the discount and
turn index carry on, a per-turn reward in a later segment reaches the turns before it) and GAE
bootstraps segment k's last ASSISTANT token from the value at segment k+1's first. Cutting an
episode at a turn boundary (with or without OBSERVATION tokens opening the later segment) leaves
every ASSISTANT token's advantage and return unchanged (tests/advantages/test_sessions.py).

The ablation, today's row-per-segment treatment, is ``session=None`` on a batch collated without
sessions (every segment its own episode, carrying the session's reward). It is biased: a segment
sits in the baseline of its own session's other segments (RLOO, GRPO, the turn-index sets), so the
baseline depends on the session's own reward, and a session that rewrites more counts more often.
"""

from __future__ import annotations

from typing import Callable

import torch

from masking.sessions import (
    SessionJoin,
    join_rows,
    join_tokens,
    join_turn_ids,
    join_turns,
    number_keys,
    row_ids,
    session_join,
    split_tokens,
)
from masking.spans import SpanKind

_TOKEN_FIELDS = ("values", "responses")  # (b, t) tensors joined as they are (0 on the joined PAD)


def estimate_by_session(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    session,
    segment,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn``'s ``(advantages, returns)`` ``(b, t)`` with each session's segments joined into one row.

    ``session``, ``segment``: ``(b,)`` the session of each row (ints, strings or a tensor) and its
    segment number (0..n-1 per session). ``kwargs`` are ``fn``'s other arguments; ``spans`` ``(b, t)``
    is required (it says where each segment's PAD starts). With ``validate=False`` the mask is taken to be
    ``spans == ASSISTANT``, as every Batch's is (``validate=True`` checks the one given). ``index`` must be one group per session
    (checked with ``validate``). Outputs are exactly 0 on PAD, as every estimator's.
    """
    spans = kwargs.get("spans")
    if spans is None:
        raise ValueError("session-aware estimation needs spans=(b, t): they mark where each segment's PAD starts")
    validate = kwargs.get("validate", True)
    join = session_join(spans, session, segment, validate=validate)
    joined_spans = join_tokens(spans, join, SpanKind.PAD)
    joined = dict(kwargs, spans=joined_spans)
    for name in _TOKEN_FIELDS:
        if kwargs.get(name) is not None:
            joined[name] = join_tokens(kwargs[name], join)
    if kwargs.get("turn_ids") is not None:
        joined["turn_ids"] = join_turn_ids(kwargs["turn_ids"], join)
    if kwargs.get("index") is not None:
        joined["index"] = _joined_index(kwargs["index"], join, validate)
    if kwargs.get("turn_states") is not None:
        joined["turn_states"] = _joined_turn_states(kwargs["turn_states"], join, validate)
    try:
        advantages, returns = fn(
            token_level_rewards=join_tokens(token_level_rewards, join),
            # the mask is spans == ASSISTANT (section 2): read from the joined spans (a bool, a quarter of a float's
            # bytes) unless validating, which checks the caller's mask against the spans
            response_mask=join_tokens(response_mask, join) if validate else joined_spans == SpanKind.ASSISTANT,
            **joined,
        )
    except ValueError as error:
        raise ValueError(f"{error} (in the batch joined by session: row s is session s, its segments end to end)") from error
    advantages_rows = split_tokens(advantages, join)
    return advantages_rows, advantages_rows if returns is advantages else split_tokens(returns, join)


def _joined_index(index, join: SessionJoin, validate: bool) -> torch.Tensor:
    """``(sessions,)`` the group of each session; ``validate``: ValueError naming the rows of a session
    whose segments are in different groups."""
    group = row_ids(index, join.session.shape[0], "index", join.session.device)
    per_session = join_rows(group, join)
    if validate:
        differs = torch.nonzero(group != per_session[join.session])
        if len(differs):
            row = int(differs[0, 0])
            first = int(join.first_row[join.session[row]])
            raise ValueError(f"index: rows {first} and {row} are segments of one session but in groups "
                             f"{int(group[first])} and {int(group[row])}")
    return per_session


def _joined_turn_states(turn_states, join: SessionJoin, validate: bool) -> torch.Tensor:
    """``(b, m)`` turn states (an integer tensor with -1 past a row's turns, or lists of hashable keys)
    -> ``(sessions, n)``: each session's segments' states in turn order. ``validate``: ValueError
    naming row and turn where a row's states do not match its turns."""
    if isinstance(turn_states, (list, tuple)):
        flat = number_keys([key for keys in turn_states for key in keys], "turn_states")
        widths = [len(keys) for keys in turn_states]
        states = torch.full((len(turn_states), max(widths, default=0)), -1, dtype=torch.long)
        states[torch.arange(states.shape[1]) < torch.tensor(widths).unsqueeze(1)] = torch.tensor(flat, dtype=torch.long)
    else:
        states = turn_states
    if validate:
        count = join.turn_count.to(states.device)
        m = max(states.shape[1], int(count.max()) if len(count) else 0)
        padded = torch.nn.functional.pad(states.long(), (0, m - states.shape[1]), value=-1)
        exists = torch.arange(m, device=states.device) < count.unsqueeze(1)
        bad = torch.nonzero(exists != (padded >= 0))
        if len(bad):
            row, turn = bad[0].tolist()
            raise ValueError(f"turn_states: row {row}, turn {turn}: the row has {int(count[row])} turns; states are given "
                             f"for exactly those (-1 past them)")
    return join_turns(states, join)
