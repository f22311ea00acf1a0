"""Every estimator, session-aware by one semantics: join each session's segments into one row, run the
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

That is the general path (:func:`estimate_by_joining`). Joining costs a copy of every ``(b, t)`` input
and output (2-3x the estimate itself on the CPU: BENCHMARKS.md, issue 54 item 6), so the estimators
that can carry a session across rows without copying do (:data:`FAST_PATHS`, by the registered
function): GRPO and RLOO sum each session's rows' scores (:func:`outcome_by_session`); REINFORCE++
and GAE scan the rows with each segment starting from the state its session's next segment ended
with (:func:`returns_by_session`, :func:`gae_by_session`: compiled, CPU); turn_returns, turn_rloo,
turn_index_normalized, turn_gae and gigpo lay the rows' per-turn tables out per session
(:func:`turns_by_session`, registered by ``advantages/turn_credit.py``; gigpo keyed by the observation
tokens hashes them across each session's rows, :func:`observation_turns_by_session`). Each equals the join
path (tests/advantages/test_sessions_fast_paths.py) and falls back to it where it cannot run.

The ablation, today's row-per-segment treatment, is ``session=None`` on a batch collated without
sessions (every segment its own episode, carrying the session's reward). It is biased: a segment
sits in the baseline of its own session's other segments (RLOO, GRPO, the turn-index sets), so the
baseline depends on the session's own reward, and a session that rewrites more counts more often.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

import masking.sessions as masking_sessions
from advantages.native_scans import native_chained_gae, native_chained_returns
from advantages.native_turns import native_broadcast, native_check_turn_ids, native_turn_tables
from advantages.returns import assistant_steps, check_batch, check_discount
from advantages.stats import WHITEN_EPS, accumulation_dtype, check_whitenable, masked_whiten
from masking.sessions import (
    SessionJoin,
    join_tokens,
    join_turn_ids,
    join_turns,
    number_keys,
    row_ids,
    segment_chain,
    segment_numbers,
    session_join,
    session_rows,
    split_tokens,
    turn_layout,
)
from masking.spans import SpanKind
from masking.validate import as_dtype, check_same_shape

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
    if kwargs.get("spans") is None:
        raise ValueError("session-aware estimation needs spans=(b, t): they mark where each segment's PAD starts")
    fast = FAST_PATHS.get(fast_path_key(fn))
    return (fast or estimate_by_joining)(fn, token_level_rewards, response_mask, session, segment, kwargs)


def estimate_by_joining(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    session,
    segment,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The general path of :func:`estimate_by_session` (any estimator): join each session's segments into
    one row (:func:`masking.sessions.session_join`), run ``fn`` there, split the results back. Arguments
    and outputs as :func:`estimate_by_session`'s."""
    spans = kwargs["spans"]
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
    return session_groups(index, join.session, join.first_row, validate)


def session_groups(index, session: torch.Tensor, first_row: torch.Tensor, validate: bool) -> torch.Tensor:
    """``(sessions,)`` the group of each session: ``index`` (``(b,)`` group ids: :func:`masking.sessions.row_ids`)
    at its ``first_row``; ``session`` ``(b,)`` dense session ids. ``validate``: ValueError naming the rows
    of a session whose segments are in different groups (one host sync)."""
    group = row_ids(index, session.shape[0], "index", session.device)
    per_session = group[first_row]
    if validate:
        differs = torch.nonzero(group != per_session[session])
        if len(differs):
            row = int(differs[0, 0])
            first = int(first_row[session[row]])
            raise ValueError(f"index: rows {first} and {row} are segments of one session but in groups "
                             f"{int(group[first])} and {int(group[row])}")
    return per_session


def outcome_by_session(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    session,
    segment,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`estimate_by_session` without joining, for an outcome estimator whose advantage is a function of
    the trajectory's score (its rewards' sum) and its group's scores only, broadcast over its ASSISTANT
    tokens (GRPO, RLOO: :data:`FAST_PATHS`).

    A session's score is the sum of its rows' scores (``(b,)`` sums added per session by ``index_add_``);
    ``fn`` runs on the ``(sessions, 1)`` batch of those scores, one group per session, and each row gets
    its session's advantage on its ASSISTANT tokens, exactly 0 elsewhere: ``(b, t)`` advantages (also the
    returns), in the rewards' dtype. Equal to the join path up to the order of the score's additions.
    ``validate`` checks the rows (:func:`advantages.returns.check_batch`), the segment numbers and one
    group per session, as the join path does. No host sync besides the session ids' read without it.
    """
    validate = kwargs.get("validate", True)
    b = token_level_rewards.shape[0]
    device = token_level_rewards.device
    check_batch(token_level_rewards, response_mask, kwargs["spans"], validate)
    dense, first_row, sessions = session_rows(session, segment, b, device, validate)
    group = session_groups(kwargs["index"], dense, first_row, validate)
    dtype = accumulation_dtype(token_level_rewards.dtype)
    scores = torch.zeros(sessions, dtype=dtype, device=device).index_add_(0, dense, token_level_rewards.sum(-1, dtype=dtype))
    one = torch.ones(sessions, 1, dtype=response_mask.dtype, device=device)
    per_session, _ = fn(token_level_rewards=scores.unsqueeze(1), response_mask=one,
                        **dict(kwargs, index=group, spans=None, validate=False))
    advantages = torch.where(response_mask.bool(), per_session[:, 0][dense].unsqueeze(1), 0.0).to(token_level_rewards.dtype)
    return advantages, advantages


def returns_by_session(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    session,
    segment,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`estimate_by_session` without joining for REINFORCE++ (carry-through returns, whitened unless
    ``whiten=False``): one compiled scan over the rows, each segment starting from the return its session's
    next segment ended with (:func:`~advantages.native_scans.native_chained_returns`), so the returns
    run across segment boundaries as on the joined row, bit for bit; the whitening's moments are merged in
    another order (equal to rounding). ``(advantages, returns)`` ``(b, t)``. Validation as ``fn``'s plus the
    segment numbers. Where the compiled scan does not run (not the CPU, other dtypes, no compiler, other
    keywords) it joins (:func:`estimate_by_joining`)."""
    gamma = kwargs.get("gamma", _default(fn, "gamma"))
    if not _compiled_scan_applies(token_level_rewards, response_mask, kwargs, {"gamma", "spans", "whiten", "validate"}):
        return estimate_by_joining(fn, token_level_rewards, response_mask, session, segment, kwargs)
    whiten, validate = kwargs.get("whiten", True), kwargs.get("validate", True)
    check_discount("gamma", gamma)
    _check_rows(token_level_rewards, response_mask, kwargs["spans"], validate, whiten)
    chain = segment_chain(session, segment, token_level_rewards.shape[0], validate)
    steps = assistant_steps(response_mask, token_level_rewards)
    scanned = native_chained_returns(token_level_rewards, steps, gamma, chain, WHITEN_EPS if whiten else None)
    if scanned is None:
        return estimate_by_joining(fn, token_level_rewards, response_mask, session, segment, kwargs)
    return scanned


def gae_by_session(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    session,
    segment,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`estimate_by_session` without joining for GAE: one compiled scan over the rows, each segment
    starting from the advantage and the value at its session's next segment's first ASSISTANT token
    (:func:`~advantages.native_scans.native_chained_gae`), so segment k's last ASSISTANT token bootstraps
    from segment k + 1's first, as on the joined row, bit for bit before whitening. Otherwise as
    :func:`returns_by_session` (``values`` ``(b, t)`` as ``fn`` takes them)."""
    if not _compiled_scan_applies(token_level_rewards, response_mask, kwargs,
                                  {"values", "gamma", "lam", "spans", "whiten", "validate"}, {"values", "gamma", "lam"}):
        return estimate_by_joining(fn, token_level_rewards, response_mask, session, segment, kwargs)
    gamma, lam, values = kwargs["gamma"], kwargs["lam"], kwargs["values"]
    whiten, validate = kwargs.get("whiten", True), kwargs.get("validate", True)
    check_discount("gamma", gamma)
    check_discount("lam", lam)
    check_same_shape("values", values, "token_level_rewards", token_level_rewards)
    _check_rows(token_level_rewards, response_mask, kwargs["spans"], validate, whiten)
    chain = segment_chain(session, segment, token_level_rewards.shape[0], validate)
    steps = assistant_steps(response_mask, token_level_rewards)
    scanned = native_chained_gae(token_level_rewards, as_dtype(values, token_level_rewards.dtype), steps, gamma, lam,
                                 chain, WHITEN_EPS if whiten else None)
    if scanned is None:
        return estimate_by_joining(fn, token_level_rewards, response_mask, session, segment, kwargs)
    return scanned


def turns_by_session(
    tables: Callable,
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    session,
    segment,
    kwargs: dict,
    collisions: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`estimate_by_session` without joining the tokens, for a turn-level estimator that reads per-turn
    tables only (turn_returns, turn_rloo, turn_index_normalized, turn_gae, and gigpo with ``turn_states``;
    ``advantages/turn_credit.py`` registers it with its ``tables`` builder, ``advantages.turn_credit._tables``).

    The rows' per-turn tables (``(b, n)`` rewards summed per turn, the value at each turn's first ASSISTANT
    token; one pass over the tokens, as without sessions) are laid out per session, each row's turns after
    its session's earlier segments' (:func:`masking.sessions.turn_layout`; ``(sessions, N)``, small); ``fn``
    runs on the *turn batch* of :func:`turn_batch` (one ASSISTANT token per turn), one group per session;
    its per-turn results go back to the rows' turns and are broadcast to their ASSISTANT tokens, as ``fn``
    broadcasts (``turn_states`` ``(b, m)`` are laid out per session the same way; turn_returns' ``whiten``
    then whitens over the rows' ASSISTANT tokens, as ``fn`` does). ``(advantages, returns)``
    ``(b, t)`` in the rewards' dtype, equal to the join path's. Validation as ``fn``'s plus the segments, one
    group per session and the turn states' turns. gigpo keyed by the observations (``responses`` without
    ``turn_states``; ``collisions`` is its hash check) takes :func:`observation_turns_by_session`. Joins
    instead (:func:`estimate_by_joining`) on an accelerator (``N`` would be a host read) and for other keywords.
    """
    values, states = kwargs.get("values"), kwargs.get("turn_states")
    if masking_sessions._sync_free(token_level_rewards) or not kwargs.keys() <= _TURN_KEYWORDS or (
            values is not None and (not isinstance(values, torch.Tensor) or values.shape != token_level_rewards.shape)):
        return estimate_by_joining(fn, token_level_rewards, response_mask, session, segment, kwargs)
    if states is None and kwargs.get("responses") is not None:  # gigpo's observation keys: hashed across the rows
        return observation_turns_by_session(fn, token_level_rewards, response_mask, session, segment, kwargs, collisions)
    validate = kwargs.get("validate", True)
    for name in ("gamma", "lam"):
        if name in kwargs:
            check_discount(name, kwargs[name])
    built = tables(token_level_rewards, response_mask, kwargs["spans"], kwargs.get("turn_ids"), validate, values=values)
    b = token_level_rewards.shape[0]
    dense, first_row, sessions = session_rows(session, segment, b, token_level_rewards.device, validate)
    count = built.exists.sum(1)
    target, total, most = turn_layout(session, segment, count, built.n)
    per_turn = [built.r] + ([] if values is None else [built.first_values.to(built.r.dtype)])
    joined = [_join_per_turn(x, target, sessions, most) for x in per_turn]
    batch = turn_batch(joined[0], total, joined[1] if values is not None else None)
    if "index" in kwargs:
        batch["index"] = session_groups(kwargs["index"], dense, first_row, validate)
    if states is not None:
        rows = turn_state_rows(states, count, validate)
        rows = torch.nn.functional.pad(rows.long(), (0, max(built.n - rows.shape[1], 0)), value=-1)[:, : built.n]
        batch["turn_states"] = _join_per_turn(rows, target, sessions, most, fill=-1)
    settings = {k: v for k, v in kwargs.items() if k not in _TURN_BATCH}
    whiten = settings.pop("whiten", _default(fn, "whiten"))  # turn_returns: whitened over the rows' tokens, below
    if whiten is not inspect.Parameter.empty:
        settings["whiten"] = False
    advantages, returns = fn(**batch, **settings, validate=False)
    rows = [_split_per_turn(x[:, 0::2], target) for x in (advantages, returns)]
    advantages, returns = built.broadcast(rows, token_level_rewards.dtype)
    if whiten is not inspect.Parameter.empty and whiten:
        advantages = masked_whiten(returns, response_mask, check=validate).to(token_level_rewards.dtype)
    return advantages, returns


def observation_turns_by_session(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    session,
    segment,
    kwargs: dict,
    collisions: Callable | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`turns_by_session` for gigpo keyed by the observation tokens (``responses``, no ``turn_states``).

    On the joined row the key of a later segment's first turn hashes the previous segments' trailing
    observation tokens followed by its own opening ones: it spans rows. The compiled turn pass reads the rows
    in segment order instead, each continuing the hash state its session's previous segment ended with
    (:func:`~advantages.native_turns.native_turn_tables` with ``chain``), so every row's turns get the keys the
    joined row's would. Laid out per session (turn 0 of each session marked as the prompt, as gigpo marks a
    row's), equal key pairs are numbered as ``turn_states`` of the per-session turn batch; ``validate`` also
    runs ``collisions`` (gigpo's third-hash check) on the per-session tables. Equal to the join path. Joins
    where the compiled pass does not run, where ``validate`` finds a bad turn id (the join path names it) and,
    without ``turn_ids``, where a later segment opens with an ASSISTANT token (the joined row may merge it into
    the turn before)."""
    validate = kwargs.get("validate", True)
    if kwargs.get("index") is None:  # gigpo's ValueError, on the join path
        return estimate_by_joining(fn, token_level_rewards, response_mask, session, segment, kwargs)
    b = token_level_rewards.shape[0]
    dense, first_row, sessions = session_rows(session, segment, b, token_level_rewards.device, validate)
    built = _chained_observation_tables(token_level_rewards, response_mask, session, segment, kwargs, validate)
    if built is None:
        return estimate_by_joining(fn, token_level_rewards, response_mask, session, segment, kwargs)
    r, count, n, hashes, _ = built
    target, total, most = turn_layout(session, segment, count, n)
    keys = [_join_per_turn(h, target, sessions, most) for h in hashes]
    keys[1] = torch.where(torch.arange(most) == 0, -1 - keys[1], keys[1])  # the joined row's turn 0: the prompt
    exists = torch.arange(most) < total.unsqueeze(1)
    group = session_groups(kwargs["index"], dense, first_row, validate)
    if validate and collisions is not None:
        collisions(tuple(keys[:2]), tuple(keys[2:]), exists, group)
    pairs = _pair_ids(keys[0].reshape(-1), keys[1].reshape(-1)).reshape(sessions, most)
    batch = turn_batch(_join_per_turn(r, target, sessions, most), total)
    batch.update(index=group, turn_states=torch.where(exists, pairs, -1))
    settings = {k: v for k, v in kwargs.items() if k not in _TURN_BATCH}
    advantages, returns = fn(**batch, **settings, validate=False)
    rows = [_split_per_turn(x[:, 0::2], target) for x in (advantages, returns)]
    return tuple(native_broadcast(rows, kwargs["spans"], kwargs.get("turn_ids"), token_level_rewards.dtype))


def _pair_ids(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Equal ``(first, second)`` int64 pairs -> equal ids in ``[0, N)`` (two stable sorts and a cumsum)."""
    order = torch.sort(second, stable=True).indices
    order = order[torch.sort(first[order], stable=True).indices]
    a, b = first[order], second[order]
    starts = torch.zeros_like(order, dtype=torch.bool)
    starts[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    return torch.empty_like(order).scatter_(0, order, starts.long().cumsum(0))


def _chained_observation_tables(rewards, response_mask, session, segment, kwargs: dict, validate: bool):
    """:func:`~advantages.native_turns.native_turn_tables` of the rows with their observation hashes chained
    across each session's segments (:func:`observation_turns_by_session`), after gigpo's checks of the rows;
    None where the join path must run instead."""
    spans, turn_ids, responses = kwargs["spans"], kwargs.get("turn_ids"), kwargs["responses"]
    for x in (responses, turn_ids):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != rewards.shape or x.dtype.is_floating_point
                              or x.dtype.is_complex or x.dtype == torch.bool):
            return None  # gigpo's ValueError, on the join path
    check_batch(rewards, response_mask, spans, validate)
    if validate and turn_ids is not None and native_check_turn_ids(spans, turn_ids) != -1:
        return None  # a bad turn id (named on the join path), or the loop cannot run
    b, t = rewards.shape
    if turn_ids is None and t and bool(((spans[:, 0] == SpanKind.ASSISTANT) & (segment_numbers(segment, b) > 0)).any()):
        return None
    order, following, _ = segment_chain(session, segment, b, False)
    previous = torch.full((b,), -1, dtype=torch.long)
    later = following >= 0
    previous[following[later]] = torch.arange(b)[later]
    return native_turn_tables(rewards, spans, turn_ids, as_dtype(responses, torch.long), check=validate,
                              chain=(order.flip(0).contiguous(), previous))


_TURN_BATCH = {"spans", "turn_ids", "values", "index", "validate", "responses", "turn_states"}  # the rest: settings
_TURN_KEYWORDS = _TURN_BATCH | {"gamma", "lam", "epsilon", "step_advantage_w", "gigpo_mode", "whiten"}


def turn_batch(rewards: torch.Tensor, turns: torch.Tensor, values: torch.Tensor | None = None) -> dict:
    """A ``(sessions, N)`` per-turn table as a token batch ``(sessions, 2 N)`` that a turn-level estimator reads
    back as the same turns: turn ``k`` is the ASSISTANT token at column ``2 k`` (its reward ``rewards[:, k]``,
    its value ``values[:, k]``), one OBSERVATION token after each turn, PAD past a session's ``turns``
    ``(sessions,)``. Keys ``token_level_rewards``, ``response_mask``, ``spans`` (and ``values``), in the table's dtype."""
    s, n = rewards.shape
    exists = (torch.arange(n, device=rewards.device) < turns.unsqueeze(1)).unsqueeze(2)
    kinds = torch.tensor([SpanKind.ASSISTANT, SpanKind.OBSERVATION], dtype=torch.int8, device=rewards.device)
    spans = torch.where(exists, kinds, torch.tensor(SpanKind.PAD, dtype=torch.int8)).reshape(s, 2 * n)

    def tokens(table):
        return torch.stack([torch.where(exists[..., 0], table, 0.0), torch.zeros_like(table)], 2).reshape(s, 2 * n)

    batch = {"token_level_rewards": tokens(rewards), "response_mask": (spans == SpanKind.ASSISTANT).to(rewards.dtype),
             "spans": spans}
    if values is not None:
        batch["values"] = tokens(values)
    return batch


def _join_per_turn(per_turn: torch.Tensor, target: torch.Tensor, sessions: int, most: int, fill=0) -> torch.Tensor:
    """``(b, n)`` per-row turns -> ``(sessions, most)`` per-session turns (:func:`masking.sessions.turn_layout`'s
    ``target``), ``fill`` past a session's turns: one scatter."""
    flat = per_turn.new_full((sessions * most + 1,), fill)
    return flat.scatter_(0, target.reshape(-1), per_turn.reshape(-1))[:-1].reshape(sessions, most)


def _split_per_turn(per_session: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``(sessions, most)`` per-session turns -> ``(b, n)`` per-row turns (0 past a row's turns): one gather."""
    return torch.cat([per_session.reshape(-1), per_session.new_zeros(1)])[target]


def _compiled_scan_applies(rewards: torch.Tensor, response_mask: torch.Tensor, kwargs: dict, known: set,
                           required: frozenset | set = frozenset()) -> bool:
    """Whether a chained compiled scan may take this call: CPU tensors, only ``known`` keywords (another is
    ``fn``'s TypeError, raised on the join path), the ``required`` ones given."""
    return rewards.is_cpu and response_mask.is_cpu and kwargs.keys() <= known and required <= kwargs.keys()


def _check_rows(rewards: torch.Tensor, response_mask: torch.Tensor, spans: torch.Tensor, validate: bool, whiten: bool) -> None:
    """The scans' checks on the rows (:func:`advantages.returns.check_batch`); with ``whiten`` and ``validate``
    also at least 2 ASSISTANT tokens (:func:`advantages.stats.check_whitenable`)."""
    count = check_batch(rewards, response_mask, spans, validate, count=whiten)
    if whiten and validate:
        check_whitenable(count)


def _default(fn: Callable, name: str):
    """The default of ``fn``'s keyword ``name`` (``inspect.Parameter.empty`` without one)."""
    parameter = inspect.signature(fn).parameters.get(name)
    return inspect.Parameter.empty if parameter is None else parameter.default


def fast_path_key(fn: Callable) -> str:
    """The key of ``fn`` in :data:`FAST_PATHS`: its module and qualified name."""
    return f"{fn.__module__}.{fn.__qualname__}"


# session-aware estimation without joining, by fast_path_key (the rest join; advantages/turn_credit.py adds its own)
FAST_PATHS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "advantages.estimators.grpo": outcome_by_session,
    "advantages.estimators.rloo": outcome_by_session,
    "advantages.estimators.reinforce_plus_plus": returns_by_session,
    "advantages.returns.gae": gae_by_session,
}


def _joined_turn_states(turn_states, join: SessionJoin, validate: bool) -> torch.Tensor:
    """``(b, m)`` turn states (an integer tensor with -1 past a row's turns, or lists of hashable keys)
    -> ``(sessions, n)``: each session's segments' states in turn order. ``validate``: ValueError
    naming row and turn where a row's states do not match its turns."""
    return join_turns(turn_state_rows(turn_states, join.turn_count, validate), join)


def turn_state_rows(turn_states, count: torch.Tensor, validate: bool) -> torch.Tensor:
    """``(b, m)`` turn states (an integer tensor with -1 past a row's turns, or lists of hashable keys, numbered
    by first appearance) as an integer tensor; ``validate``: ValueError naming row and turn where a row's
    states do not match its ``count`` ``(b,)`` turns (one host sync)."""
    if isinstance(turn_states, (list, tuple)):
        flat = number_keys([key for keys in turn_states for key in keys], "turn_states")
        widths = [len(keys) for keys in turn_states]
        states = torch.full((len(turn_states), max(widths, default=0)), -1, dtype=torch.long)
        states[torch.arange(states.shape[1]) < torch.tensor(widths).unsqueeze(1)] = torch.tensor(flat, dtype=torch.long)
    else:
        states = turn_states
    if validate:
        count = count.to(states.device)
        m = max(states.shape[1], int(count.max()) if len(count) else 0)
        padded = torch.nn.functional.pad(states.long(), (0, m - states.shape[1]), value=-1)
        exists = torch.arange(m, device=states.device) < count.unsqueeze(1)
        bad = torch.nonzero(exists != (padded >= 0))
        if len(bad):
            row, turn = bad[0].tolist()
            raise ValueError(f"turn_states: row {row}, turn {turn}: the row has {int(count[row])} turns; states are given "
                             f"for exactly those (-1 past them)")
    return states
