"""Turn-level credit on the span tensor: one row per episode, advantages per assistant turn
(docs/design.md section 3, "Turn-level credit"; issue 47).

A row holds a whole episode: ASSISTANT runs (turns 0, 1, ..), the OBSERVATION tokens between them
(tool results, template tokens) and trailing PAD. ``turn_ids`` ``(b, t)`` numbers the turns: ``k``
on the k-th ASSISTANT run, on an OBSERVATION token the id of the assistant turn before it (-1
before the first), -1 on PAD (as ``agent_loop/episode/loop.py`` records them;
:func:`turn_ids_from_spans` derives them). Every estimator here works on per-turn quantities:

* ``r_k`` = the sum of ``token_level_rewards`` over turn k's ASSISTANT tokens (the loop puts a
  turn's reward, and the outcome, on the turn's / the episode's last ASSISTANT token);
* ``G_k = r_k + gamma * G_{k+1}`` (``G_L = 0`` after the last turn ``L - 1``): gamma once per turn;
  OBSERVATION tokens and the tokens inside a turn cost no discount step;

and broadcasts turn k's advantage to turn k's ASSISTANT tokens; every other position is exactly 0.
Each returns ``(advantages, returns)`` ``(b, t)`` in the rewards' dtype, ``returns`` being ``G_k``
broadcast the same way (``A_k + V_k`` for :func:`turn_gae`). Per-turn tensors are ``(b, n)`` with
``n`` the largest turn count of the batch (read on the host: free on CPU and done anyway when
validating), or ``n = t`` on an accelerator without ``validate``, so that path never syncs.

Groups (the episodes of one prompt) come as ``index`` ``(b,)`` (:func:`~advantages.estimators.group_ids`).
A group of one member is defined behaviour, not an error: it has no other member, so every
leave-one-out baseline is 0 and its advantages are the returns themselves (and its episode-level
GRPO part is verl's: mean 0, std 1).

No Python loop over rows, tokens, turns or groups: scatter/gather, ``index_add`` and sorts
(:func:`_dense_ids`), as :func:`advantages.estimators._group_moments`. Bias, in brief (docs/design.md
has the table and the proofs, tests/advantages/test_turn_credit_enumeration.py checks them
exactly): :func:`turn_rloo`, :func:`turn_returns` (``whiten=False``), :func:`turn_gae`
(``lam=1`` for any values, any ``lam`` for the true values) and :func:`gigpo` (``mean_norm``: the
expected gradient is ``(1 - 1/G + step_advantage_w)`` times the true one) are unbiased;
:func:`turn_index_normalized` is biased (RFC verl#7244).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from advantages.estimators import GRPO_EPS, group_ids
from advantages.native_turns import native_broadcast, native_check_turn_ids, native_turn_tables
from advantages.registry import AdvantageEstimator, register_adv_est
from advantages.returns import check_batch, check_discount, discounted_returns
from advantages.sessions import FAST_PATHS, fast_path_key, turns_by_session
from advantages.settings import DiscountSettings, GAESettings, GiGPOSettings
from advantages.stats import accumulation_dtype, masked_whiten
from masking.spans import SPAN_DTYPE, SpanKind
from masking.validate import as_dtype

# The torch path's two polynomial hashes of an observation's token ids (mod two primes below 2**31):
# a false merge of two different observations needs both to agree (the compiled path has its own,
# advantages/native_turns.c).
_HASHES = ((2_147_483_647, 1_000_003), (2_147_483_629, 911_382_323))


# ----------------------------------------------------------------------------- turn structure


def turn_ids_from_spans(spans: torch.Tensor) -> torch.Tensor:
    """``(b, t)`` SpanKind -> ``(b, t)`` long turn ids: ``k`` on the k-th ASSISTANT run of a row,
    on an OBSERVATION token the id of the assistant turn before it (-1 before the first), -1 on
    PAD (``agent_loop/episode/loop.py``'s ``turn_ids``). ``turn = cumsum(run starts) - 1``."""
    assistant = spans == SpanKind.ASSISTANT
    starts = assistant.clone()
    starts[:, 1:] &= ~assistant[:, :-1]
    turns = starts.long().cumsum(1) - 1
    return torch.where(spans == SpanKind.PAD, -1, turns)


def _first_bad(bad: torch.Tensor) -> tuple[int, int] | None:
    if not bool(bad.any()):
        return None
    row, col = torch.nonzero(bad)[0].tolist()
    return row, col


def _check_turn_ids(turn_ids: torch.Tensor, assistant: torch.Tensor, observation: torch.Tensor) -> None:
    """ValueError naming row and position unless the ASSISTANT tokens' turn ids run 0, 1, .. without
    a gap (each equal to the previous ASSISTANT token's id or one more) and every OBSERVATION
    token carries the id of the assistant turn before it (-1 before the first)."""
    previous_max = torch.where(assistant, turn_ids, -1).cummax(1).values  # last ASSISTANT id up to t
    before = torch.nn.functional.pad(previous_max[:, :-1], (1, 0), value=-1)
    bad = assistant & (turn_ids != before) & (turn_ids != before + 1)
    where = _first_bad(bad)
    if where is not None:
        row, pos = where
        raise ValueError(
            f"turn_ids: row {row}, position {pos}: ASSISTANT token in turn {int(turn_ids[row, pos])} after turn "
            f"{int(before[row, pos])}; turn ids must be consecutive (0, 1, ..) along a row"
        )
    where = _first_bad(observation & (turn_ids != previous_max))
    if where is not None:
        row, pos = where
        raise ValueError(
            f"turn_ids: row {row}, position {pos}: OBSERVATION token in turn {int(turn_ids[row, pos])}, but the "
            f"assistant turn before it is {int(previous_max[row, pos])} (-1: none)"
        )


def _check_turn_ids_type(turn_ids, token_level_rewards: torch.Tensor) -> None:
    """ValueError unless ``turn_ids`` is an integer tensor of the rewards' ``(b, t)`` shape."""
    if not isinstance(turn_ids, torch.Tensor) or turn_ids.shape != token_level_rewards.shape:
        raise ValueError(
            f"turn_ids must be a (b, t) integer tensor of shape {tuple(token_level_rewards.shape)}, got "
            f"{type(turn_ids).__name__} of shape {tuple(getattr(turn_ids, 'shape', ()))}"
        )
    if turn_ids.dtype.is_floating_point or turn_ids.dtype.is_complex or turn_ids.dtype == torch.bool:
        raise ValueError(f"turn_ids must hold integers, got {turn_ids.dtype}")


class _Turns(NamedTuple):
    """A batch's turn structure: ``(b, t)`` bool ``assistant`` and ``observation`` masks, ``(b, t)``
    long ``turns`` (the turn ids), the number of turn columns ``n``, ``(b, t)`` long ``column``
    (the turn of an ASSISTANT token, ``n`` elsewhere: scattered into and gathered from a spare
    column ``n``, so nothing else needs masking) and ``(b, n)`` bool ``exists`` (the row has turn k)."""

    assistant: torch.Tensor
    observation: torch.Tensor
    turns: torch.Tensor
    n: int
    column: torch.Tensor
    exists: torch.Tensor


def _sync_free(x: torch.Tensor) -> bool:
    """Whether the hot path must not synchronise with the host for ``x`` (an accelerator): then the
    tables get ``n = t`` columns instead of the batch's turn count (which would need a sync)."""
    return not x.is_cpu


def _mask_only_spans(response_mask: torch.Tensor) -> torch.Tensor:
    """int8 spans of a mask-only batch: ASSISTANT where the mask is 1, OBSERVATION where it is 0 with
    an ASSISTANT token later in the row, PAD after a row's last ASSISTANT token (those tokens join no
    turn; the loop's turn ids there are -1)."""
    assistant = response_mask.bool()
    later = assistant.flip(1).cumsum(1, dtype=torch.int32).flip(1) > 0
    return torch.where(assistant, SpanKind.ASSISTANT, torch.where(later, SpanKind.OBSERVATION, SpanKind.PAD)).to(SPAN_DTYPE)


def _structure(token_level_rewards, response_mask, spans, turn_ids, validate) -> _Turns:
    """Resolve a batch's turns with torch ops (:class:`_Turns`); ``validate`` checks the turn ids
    (the caller has checked the batch) and reads the exact turn count."""
    assistant = response_mask.bool()
    spans_ = _mask_only_spans(response_mask) if spans is None else spans
    observation = spans_ == SpanKind.OBSERVATION
    if turn_ids is None:
        turns = turn_ids_from_spans(spans_)
    else:
        _check_turn_ids_type(turn_ids, token_level_rewards)
        turns = turn_ids.to(device=token_level_rewards.device, dtype=torch.long)
        if validate:
            _check_turn_ids(turns, assistant, observation)
    b, t = token_level_rewards.shape
    # consecutive ids (validated or derived): an OBSERVATION carries an earlier id, PAD -1, so a row's
    # largest id is its last turn
    count = turns.amax(1) + 1 if t else torch.zeros(b, dtype=torch.long, device=turns.device)
    if validate or not _sync_free(token_level_rewards):
        n = int(count.max()) if b else 0
    else:
        n = t  # no host sync: every turn has a token, so at most t turns
    n = max(n, 1)
    exists = torch.arange(n, device=turns.device) < count.unsqueeze(1)
    return _Turns(assistant, observation, turns, n, torch.where(assistant, turns, n), exists)


def _per_turn(token_level_rewards: torch.Tensor, s: _Turns) -> torch.Tensor:
    """``(b, n)`` per-turn rewards ``r_k`` (the sum over turn k's ASSISTANT tokens; one
    ``scatter_add``, other tokens land in the spare column), in the accumulation dtype."""
    dtype = accumulation_dtype(token_level_rewards.dtype)
    r = torch.zeros(token_level_rewards.shape[0], s.n + 1, dtype=dtype, device=token_level_rewards.device)
    return r.scatter_add_(1, s.column, token_level_rewards.to(dtype))[:, : s.n]


def _turn_returns(r: torch.Tensor, exists: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_k = r_k + gamma G_{k+1}`` over the existing turns (a prefix of each row), 0 elsewhere;
    the carry-through scan of :func:`~advantages.returns.discounted_returns` on ``(b, n)``."""
    return discounted_returns(r, exists.to(r.dtype), gamma, None, False)


def _broadcast(per_turn: torch.Tensor, dtype: torch.dtype, s: _Turns) -> torch.Tensor:
    """``(b, n)`` per-turn values -> ``(b, t)``: turn k's value on turn k's ASSISTANT tokens, exactly 0
    elsewhere (one gather from the values with a spare zero column)."""
    padded = torch.nn.functional.pad(torch.where(s.exists, per_turn, 0.0).to(dtype), (0, 1))
    return padded.gather(1, s.column)


class _Tables(NamedTuple):
    """What the estimators compute from: ``(b, n)`` per-turn rewards ``r`` (float64 from the compiled
    pass, else the accumulation dtype), ``exists``, ``n``, the observation ``keys`` ``(h1, h2)``
    (when asked for), the critic's value at each turn's first ASSISTANT token (when asked for),
    ``broadcast([per_turn, ..], dtype)`` back to ``(b, t)`` (one or two tables), and the torch :class:`_Turns` where built
    (validation, the torch path)."""

    r: torch.Tensor
    exists: torch.Tensor
    n: int
    keys: tuple | None
    first_values: torch.Tensor | None
    broadcast: Callable[[list, torch.dtype], list]
    turns: _Turns | None
    check_keys: tuple | None


def _tables(token_level_rewards, response_mask, spans, turn_ids, validate, responses=None, values=None) -> _Tables:
    """Check the batch and build its per-turn tables: on the CPU with the compiled pass of
    :mod:`advantages.native_turns` (one read of the tokens; one write for the outputs), elsewhere
    (CUDA, no compiler, other dtypes) with torch's scatter/gather (:func:`_structure`). With
    ``validate`` and ``responses`` the compiled pass also gives ``check_keys`` (a third hash and the
    length of each observation) for gigpo's collision check."""
    check_batch(token_level_rewards, response_mask, spans, validate)
    if turn_ids is not None:
        _check_turn_ids_type(turn_ids, token_level_rewards)
    if token_level_rewards.is_cpu:
        spans8 = _mask_only_spans(response_mask) if spans is None else spans
        if validate and turn_ids is not None and native_check_turn_ids(spans8, turn_ids) != -1:
            _structure(token_level_rewards, response_mask, spans, turn_ids, True)  # names the bad token (or cannot run)
        tokens = None if responses is None else as_dtype(responses, torch.long)
        native = native_turn_tables(token_level_rewards, spans8, turn_ids, tokens, values, check=validate)
        if native is not None:
            return _native_tables(native, spans8, turn_ids)
    s = _structure(token_level_rewards, response_mask, spans, turn_ids, validate)
    keys = None if responses is None else _observation_hashes(responses, s)
    return _Tables(_per_turn(token_level_rewards, s), s.exists, s.n, keys, None if values is None else _first_values(values, s),
                   lambda per_turn, dtype: [_broadcast(x, dtype, s) for x in per_turn], s, None)


def _native_tables(native, spans8, turn_ids) -> _Tables:
    r, count, n, hashes, first_values = native
    exists = torch.arange(n) < count.unsqueeze(1)
    keys = check_keys = None
    if hashes is not None:
        keys = (hashes[0], torch.where(torch.arange(n) == 0, -1 - hashes[1], hashes[1]))  # turn 0: the prompt
        check_keys = hashes[2:] or None

    def broadcast(per_turn, dtype):
        return native_broadcast(per_turn, spans8, turn_ids, dtype)  # absent turns have no token to read

    return _Tables(r, exists, n, keys, first_values, broadcast, None, check_keys)


def _first_values(values: torch.Tensor, s: _Turns) -> torch.Tensor:
    """``(b, n)`` ``values`` at each turn's first ASSISTANT token (0 on absent turns)."""
    b, t = values.shape
    first = torch.full((b, s.n + 1), t, dtype=torch.long, device=values.device)
    first.scatter_reduce_(1, s.column, torch.arange(t, device=values.device).expand(b, t), reduce="amin")
    first = first[:, : s.n].clamp_(max=max(t - 1, 0))
    dtype = accumulation_dtype(values.dtype) if values.dtype.is_floating_point else torch.float64
    return torch.where(s.exists, values.to(dtype).gather(1, first), 0.0) if t else torch.zeros(b, s.n, dtype=dtype)


def _dense_ids(*keys: torch.Tensor) -> torch.Tensor:
    """Equal key tuples -> equal dense ids in ``[0, N)``: lexicographic stable sorts of the 1-D
    int64 ``keys`` (the last key first), then a cumsum of the boundaries (no host sync)."""
    order = torch.arange(keys[0].shape[0], device=keys[0].device)
    for key in reversed(keys):
        order = order[torch.sort(key[order], stable=True).indices]
    starts = torch.zeros_like(order, dtype=torch.bool)
    for key in keys:
        k = key[order]
        starts[1:] |= k[1:] != k[:-1]
    dense_sorted = starts.long().cumsum(0)
    return torch.empty_like(order).scatter_(0, order, dense_sorted)


def _set_sums(ids: torch.Tensor, weight: torch.Tensor, values: torch.Tensor):
    """Per-entry count and sum over the entries sharing its dense id (``weight`` 0/1 selects the members)."""
    zeros = torch.zeros_like(values)
    count = zeros.index_add(0, ids, weight)[ids]
    total = zeros.index_add(0, ids, values * weight)[ids]
    return count, total


def _turn_index_sets(group: torch.Tensor, n: int) -> torch.Tensor:
    """``(b * n,)`` ids of the (group, turn index) sets: ``group * n + k``."""
    k = torch.arange(n, device=group.device)
    return (group.unsqueeze(1) * n + k).reshape(-1)


def _dense_group(index, b: int, device) -> torch.Tensor:
    """``(b,)`` dense group ids in ``[0, b)`` (sorted), from anything :func:`group_ids` takes."""
    return _dense_ids(group_ids(index, b, device))


def _needs_index(name: str, index) -> None:
    if index is None:
        raise ValueError(f"the {name} estimator needs index=(b,) group ids (the episodes of one prompt)")


def _loo_turn_index_baseline(G: torch.Tensor, exists: torch.Tensor, group: torch.Tensor):
    """``(b, n)`` turn_rloo baseline: the mean of the other group members' ``G_k`` over those that
    reached turn k (0 if none), plus the count of such others."""
    b, n = G.shape
    ids = _turn_index_sets(group, n)
    w = exists.reshape(-1).to(G.dtype)
    count, total = _set_sums(ids, w, G.reshape(-1))
    others = (count - w).reshape(b, n)
    baseline = torch.where(others > 0, (total.reshape(b, n) - G) / others.clamp(min=1), 0.0)
    return baseline, others


# ----------------------------------------------------------------------------- estimators


@register_adv_est(AdvantageEstimator.TURN_RETURNS, settings=DiscountSettings)
def turn_returns(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    *,
    spans: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    whiten: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-turn returns: ``A_k = G_k = sum_{j >= k} gamma^(j - k) r_j`` on turn k's ASSISTANT tokens.

    ``(b, t)`` rewards, mask, optional ``spans`` and ``turn_ids`` -> ``(advantages, returns)``
    ``(b, t)``. The discount is per turn (not per token, as REINFORCE++'s is); with
    ``whiten`` (default) the advantages are whitened over every ASSISTANT token of the batch as
    REINFORCE++ (arXiv:2501.03262) whitens its returns. ``whiten=False`` is REINFORCE with
    reward-to-go per turn: unbiased (Williams 1992; Sutton et al. 2000).
    """
    check_discount("gamma", gamma)
    tables = _tables(token_level_rewards, response_mask, spans, turn_ids, validate)
    G = _turn_returns(tables.r, tables.exists, gamma)
    (returns,) = tables.broadcast([G], token_level_rewards.dtype)
    advantages = masked_whiten(returns, response_mask, check=validate) if whiten else returns
    return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


@register_adv_est(AdvantageEstimator.TURN_RLOO, needs_index=True, settings=DiscountSettings)
def turn_rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    gamma: float = 1.0,
    *,
    spans: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level RLOO: ``A_{i,k} = G_{i,k} - mean{G_{j,k} : j != i in i's group, episode j reached turn k}``
    (0 baseline when no other member reached turn k; a group of one keeps ``G``).

    The unbiased fix proposed in RFC verl#7244: the baseline depends only on the other episodes of
    the group, never on episode i's own actions or length, so the expected policy gradient is
    exactly ``grad J`` (RLOO, arXiv:2402.14740, per turn index). With one turn it equals
    :func:`~advantages.estimators.rloo`. ``index`` ``(b,)`` group ids; other inputs as :func:`turn_returns`.
    """
    _needs_index("turn_rloo", index)
    check_discount("gamma", gamma)
    group = _dense_group(index, token_level_rewards.shape[0], token_level_rewards.device)
    tables = _tables(token_level_rewards, response_mask, spans, turn_ids, validate)
    G = _turn_returns(tables.r, tables.exists, gamma)
    baseline, _ = _loo_turn_index_baseline(G, tables.exists, group)
    dtype = token_level_rewards.dtype
    advantages, returns = tables.broadcast([G - baseline, G], dtype)
    return advantages, returns


@register_adv_est(AdvantageEstimator.TURN_INDEX_NORMALIZED, needs_index=True, settings=DiscountSettings)
def turn_index_normalized(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    gamma: float = 1.0,
    epsilon: float = GRPO_EPS,
    *,
    spans: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ablation, biased: RFC verl#7244's per-turn-index normalisation (MT-GRPO style), kept as the
    reference for ablations.

    ``rt_{i,j} = (r_{i,j} - mean_j) / (std_j + epsilon)`` over the group members that reached turn
    j (GRPO's statistics per turn index: Bessel std; a turn index reached by one member has mean 0
    and std 1), then ``A_{i,k} = sum_{j >= k} gamma^(j - k) rt_{i,j}`` over episode i's own turns.
    The number of subtracted means is set by the episode's own stopping turn, so the baseline
    depends on the action STOP: the gradient is biased whenever the policy decides the length
    (the mean-only part of the bias is ``-sum_j mean_j`` per extra turn: a hidden length bonus or
    penalty). Use :func:`turn_rloo` for the unbiased version.
    """
    _needs_index("turn_index_normalized", index)
    check_discount("gamma", gamma)
    group = _dense_group(index, token_level_rewards.shape[0], token_level_rewards.device)
    tables = _tables(token_level_rewards, response_mask, spans, turn_ids, validate)
    r, exists, n = tables.r, tables.exists, tables.n
    b = r.shape[0]
    ids = _turn_index_sets(group, n)
    w = exists.reshape(-1).to(r.dtype)
    count, total = _set_sums(ids, w, r.reshape(-1))
    mean = total / count.clamp(min=1)
    _, sq = _set_sums(ids, w, (r.reshape(-1) - mean).square())
    single = count < 2
    std = torch.where(single, 1.0, (sq / (count - 1).clamp(min=1)).sqrt())
    normalized = torch.where(exists, ((r.reshape(-1) - torch.where(single, 0.0, mean)) / (std + epsilon)).reshape(b, n), 0.0)
    A = _turn_returns(normalized, exists, gamma)
    G = _turn_returns(r, exists, gamma)
    dtype = token_level_rewards.dtype
    advantages, returns = tables.broadcast([A, G], dtype)
    return advantages, returns


@register_adv_est(AdvantageEstimator.TURN_GAE, needs_values=True, settings=GAESettings)
def turn_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    *,
    spans: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with one turn as one timestep (Schulman et al. 2015, arXiv:1506.02438; AReaL's
    ``gae_timestep_unit=turn``), carried through observations.

    ``V_k`` = ``values`` at turn k's first ASSISTANT token (the critic's value of the state the
    turn starts from); ``delta_k = r_k + gamma V_{k+1} - V_k`` (``V_L = 0`` after the last turn),
    ``A_k = delta_k + gamma lam A_{k+1}``, broadcast to turn k's ASSISTANT tokens; ``returns =
    A_k + V_k`` there. Not whitened. Unbiased for ``lam = 1`` with any values (``A_k = G_k - V_k``,
    a state baseline), and for any ``lam`` when ``V`` is the true value. ``values`` ``(b, t)``
    (read only at those tokens); verl's positional order (``compute_gae_advantage_return``).
    """
    check_discount("gamma", gamma)
    check_discount("lam", lam)
    if not isinstance(values, torch.Tensor) or values.shape != token_level_rewards.shape:
        raise ValueError(f"values must be a (b, t) tensor of shape {tuple(token_level_rewards.shape)}")
    tables = _tables(token_level_rewards, response_mask, spans, turn_ids, validate, values=values)
    r, exists = tables.r, tables.exists
    V = tables.first_values.to(r.dtype)
    V_next = torch.nn.functional.pad(V[:, 1:], (0, 1))
    delta = torch.where(exists, r + gamma * V_next - V, 0.0)
    A = _turn_returns(delta, exists, gamma * lam)
    dtype = token_level_rewards.dtype
    advantages, returns = tables.broadcast([A, A + V], dtype)
    return advantages, returns


# ----------------------------------------------------------------------------- GiGPO


@functools.lru_cache(maxsize=16)
def _powers(base: int, modulus: int, length: int, device: str) -> torch.Tensor:
    """``base ** p mod modulus`` for ``p < length`` (int64; products stay below 2**62), by doubling."""
    out = torch.ones(1, dtype=torch.long)
    step = base % modulus
    while out.shape[0] < length:
        out = torch.cat([out, out * step % modulus])
        step = step * step % modulus
    return out[:length].to(device)


def _observation_columns(s: _Turns) -> torch.Tensor:
    """``(b, t)``: the turn each OBSERVATION token precedes (``turn id + 1``: 0 before the first
    turn), ``n`` on every other token (the spare column)."""
    return torch.where(s.observation, s.turns + 1, s.n)


def _observation_hashes(responses: torch.Tensor, s: _Turns) -> tuple[torch.Tensor, torch.Tensor]:
    """Key of the observation before each turn, ``(b, n)`` int64 ``(h1, h2)``:
    ``h = sum_q (x_q + 1) B^(q - start) mod M`` over the OBSERVATION tokens q before turn k
    (``start``: the first of them), for the two ``(M, B)`` of ``_HASHES``; turn 0 (the prompt,
    shared by the group, plus any OBSERVATION before the first turn) gets ``h2 = -1 - h2``, a key
    no later turn has. Per token one fused multiply-add, one remainder and one ``scatter_add``
    of ``(x + 1) B^q`` per hash; then per turn a shift by ``B^-start`` makes it position-free."""
    b, t = responses.shape
    device, n = responses.device, s.n
    column = _observation_columns(s)
    start = torch.full((b, n + 1), t, dtype=torch.long, device=device)
    start = start.scatter_reduce_(1, column, torch.arange(t, device=device).expand(b, t), reduce="amin")[:, :n]
    start = start.clamp_(max=max(t - 1, 0))
    tokens = responses if responses.dtype == torch.long else responses.long()
    hashes = []
    for modulus, base in _HASHES:
        power = _powers(base, modulus, max(t, 1), str(device))[:t]
        term = torch.addcmul(power, tokens, power).remainder_(modulus)  # (x + 1) B^q mod M, below 2**31
        h = torch.zeros(b, n + 1, dtype=torch.long, device=device).scatter_add_(1, column, term)[:, :n]
        inverse = _powers(pow(base, modulus - 2, modulus), modulus, max(t, 1), str(device))
        hashes.append(h.remainder_(modulus).mul_(inverse[start]).remainder_(modulus))
    first_turn = torch.arange(n, device=device) == 0
    return hashes[0], torch.where(first_turn, -1 - hashes[1], hashes[1])


def _check_collisions(responses: torch.Tensor, s: _Turns, keys, group: torch.Tensor) -> None:
    """ValueError naming row and turn where two observations with equal keys differ.

    Each (group, key) set's first member is its representative; every member's length and
    OBSERVATION tokens are compared with the representative's at the same offset (gathers;
    validation only, one host sync)."""
    b, t = responses.shape
    n, device, exists = s.n, responses.device, s.exists
    present = exists.reshape(-1)
    column = _observation_columns(s)
    positions = torch.arange(t, device=device)
    start = torch.full((b, n + 1), t, dtype=torch.long, device=device)
    start = start.scatter_reduce_(1, column, positions.expand(b, t), reduce="amin")[:, :n].clamp_(max=max(t - 1, 0))
    length = torch.zeros(b, n + 1, dtype=torch.long, device=device).scatter_add_(1, column, s.observation.long())[:, :n]
    ids = _dense_ids(torch.where(exists, group.unsqueeze(1), b).reshape(-1), *(k.reshape(-1) for k in keys))
    flat = torch.arange(b * n, device=device)
    representative = torch.full_like(flat, b * n).scatter_reduce_(0, ids, torch.where(present, flat, b * n), "amin")[ids]
    representative = torch.where(present, representative, flat).clamp_(max=b * n - 1)
    start_, length_ = start.reshape(-1), length.reshape(-1)
    bad = present & (length_ != length_[representative])
    entry = torch.arange(b, device=device).unsqueeze(1) * n + column.clamp(max=n - 1)  # (b, t)
    offset = positions - start_[entry]
    rep = representative[entry]
    other = responses[rep // n, (start_[rep] + offset).clamp_(0, max(t - 1, 0))]
    differs = s.observation & (column < n) & present[entry] & (responses != other)
    _raise_collision(bad.index_put((entry[differs],), torch.tensor(True, device=device)), representative, n)


def _check_collisions_by_hash(keys, check_keys, exists: torch.Tensor, group: torch.Tensor) -> None:
    """The compiled path's collision check: within each (group, key) set every member's length and
    third hash must equal its first member's (ValueError naming row and turn otherwise)."""
    b, n = exists.shape
    present = exists.reshape(-1)
    ids = _dense_ids(torch.where(exists, group.unsqueeze(1), b).reshape(-1), *(k.reshape(-1) for k in keys))
    flat = torch.arange(b * n)
    representative = torch.full_like(flat, b * n).scatter_reduce_(0, ids, torch.where(present, flat, b * n), "amin")[ids]
    representative = torch.where(present, representative, flat).clamp_(max=b * n - 1)
    bad = present.clone()
    bad &= torch.stack([(c.reshape(-1) != c.reshape(-1)[representative]) for c in check_keys]).any(0)
    _raise_collision(bad, representative, n)


def _raise_collision(bad: torch.Tensor, representative: torch.Tensor, n: int) -> None:
    if bool(bad.any()):
        e = int(torch.nonzero(bad)[0, 0])
        r = int(representative[e])
        raise ValueError(
            f"gigpo: hash collision: the observation before row {e // n}, turn {e % n} and the one before row "
            f"{r // n}, turn {r % n} have equal hashes but differ; pass turn_states instead"
        )


def _turn_state_keys(turn_states, exists, validate):
    """``turn_states`` -> ``(b, n)`` int64 keys (-1 on absent turns): a ``(b, m)`` integer tensor, or a
    list per row of hashable keys (numbered by first appearance, as ``group_ids`` numbers uids)."""
    b, n = exists.shape
    device = exists.device
    if isinstance(turn_states, torch.Tensor):
        if turn_states.dim() != 2 or turn_states.shape[0] != b or turn_states.dtype.is_floating_point \
                or turn_states.dtype.is_complex or turn_states.dtype == torch.bool:
            raise ValueError(
                f"turn_states must be a (b={b}, n_turns) integer tensor (-1 on absent turns) or a list of b lists "
                f"of hashable keys; got a {turn_states.dtype} tensor of shape {tuple(turn_states.shape)}"
            )
        states = turn_states.to(device=device, dtype=torch.long)
    elif isinstance(turn_states, (list, tuple)):
        if len(turn_states) != b:
            raise ValueError(f"turn_states has {len(turn_states)} rows, expected one list of keys per row ({b})")
        dense: dict = {}
        rows = []
        for row, keys in enumerate(turn_states):
            if not isinstance(keys, (list, tuple)):
                raise ValueError(f"turn_states[{row}] is {type(keys).__name__}, expected a list of one key per turn")
            numbered = []
            for turn, key in enumerate(keys):
                try:
                    numbered.append(dense.setdefault(key, len(dense)))
                except TypeError:
                    raise ValueError(f"turn_states: row {row}, turn {turn}: key {key!r} is not hashable") from None
            rows.append(numbered)
        width = max((len(r) for r in rows), default=0)
        states = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long).reshape(b, width).to(device)
        if validate:
            counts = exists.sum(1).tolist()
            for row, (keys, count) in enumerate(zip(rows, counts)):  # host lists: the keys are host objects anyway
                if len(keys) != count:
                    raise ValueError(f"turn_states: row {row} has {count} turns but {len(keys)} keys (turn {min(len(keys), count)})")
    else:
        raise ValueError(f"turn_states must be a (b, n_turns) integer tensor or a list of b lists of keys, got {type(turn_states).__name__}")
    m = states.shape[1]
    states = torch.nn.functional.pad(states, (0, max(n - m, 0)), value=-1)
    if validate:
        if m > n and bool((states[:, n:] != -1).any()):
            row, col = torch.nonzero(states[:, n:] != -1)[0].tolist()
            raise ValueError(f"turn_states: row {row}, turn {n + col}: a state for a turn the row does not have")
        states = states[:, :n]
        where = _first_bad(exists & (states < 0))
        if where is not None:
            raise ValueError(f"turn_states: row {where[0]}, turn {where[1]}: the turn exists but its state is {int(states[where])} (absent)")
        where = _first_bad(~exists & (states >= 0))
        if where is not None:
            raise ValueError(f"turn_states: row {where[0]}, turn {where[1]}: a state for a turn the row does not have")
    return states[:, :n]


def gigpo_anchor_groups(
    response_mask: torch.Tensor,
    index,
    *,
    spans: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    responses: torch.Tensor | None = None,
    turn_states=None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchor-state group each turn joins in :func:`gigpo`: ``(b, n)`` long ids (equal id = same
    group and same state; -1 on absent turns) and ``(b, n)`` the number of *other* episodes' turns
    in it (0: :func:`gigpo` falls back to the turn-index baseline). For ``inspect``."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    sets, others, tables = _anchor_sets(rewards, response_mask, index, spans, turn_ids, responses, turn_states, validate)[:3]
    exists = tables.exists
    return torch.where(exists, sets, -1), torch.where(exists, others, 0)


def _anchor_sets(token_level_rewards, response_mask, index, spans, turn_ids, responses, turn_states, validate):
    """Everything gigpo groups by: ``(set ids, others per entry, the _Turns, group ids, own-entry set ids)``."""
    _needs_index("gigpo", index)
    if responses is None and turn_states is None:
        raise ValueError("gigpo needs responses=(b, t) token ids (the observations are the anchor states) or turn_states")
    b = token_level_rewards.shape[0]
    group = _dense_group(index, b, token_level_rewards.device)
    if turn_states is None and (not isinstance(responses, torch.Tensor) or responses.shape != token_level_rewards.shape
                                or responses.dtype.is_floating_point or responses.dtype == torch.bool):
        raise ValueError(f"responses must be a (b, t) integer tensor of token ids of shape {tuple(token_level_rewards.shape)}")
    tables = _tables(token_level_rewards, response_mask, spans, turn_ids, validate,
                     responses=responses if turn_states is None else None)
    exists, n = tables.exists, tables.n
    if turn_states is not None:
        keys = (_turn_state_keys(turn_states, exists, validate),)
    else:
        keys = tables.keys
        if validate and tables.check_keys is not None:
            _check_collisions_by_hash(keys, tables.check_keys, exists, group)
        elif validate:
            _check_collisions(responses, tables.turns, keys, group)
    members = torch.where(exists, group.unsqueeze(1), b).reshape(-1)  # absent turns: a group of their own
    sets = _dense_ids(members, *(k.reshape(-1) for k in keys))
    rows = torch.arange(b, device=sets.device).repeat_interleave(n)
    own = _dense_ids(sets, rows)
    w = exists.reshape(-1).long()
    zeros = torch.zeros_like(w)
    others = zeros.index_add(0, sets, w)[sets] - zeros.index_add(0, own, w)[own]
    return sets.reshape(b, n), others.reshape(b, n), tables, group, own.reshape(b, n)


def _episode_advantage(score: torch.Tensor, group: torch.Tensor, by_std: bool, epsilon: float) -> torch.Tensor:
    """``(b,)`` GRPO over the rows' reward sums: ``R - mean_group`` (``/ (std_group + epsilon)`` with
    ``by_std``; Bessel std; a group of one has mean 0 and std 1, as verl's GRPO)."""
    ones = torch.ones_like(score)
    count, total = _set_sums(group, ones, score)
    mean = total / count
    single = count < 2
    episode = score - torch.where(single, 0.0, mean)
    if by_std:
        _, sq = _set_sums(group, ones, (score - mean).square())
        episode = episode / (torch.where(single, 1.0, (sq / (count - 1).clamp(min=1)).sqrt()) + epsilon)
    return episode


def _step_advantage(G, exists, group, sets, own, others, by_std: bool, epsilon: float) -> torch.Tensor:
    """``(b, n)`` GiGPO step advantage: ``G`` minus the mean of ``G`` over the other episodes' turns
    in the anchor set (the turn-index leave-one-out baseline where there are none); with
    ``by_std`` divided by the Bessel std of ``G`` over the set used (1 below two members) + epsilon."""
    b, n = G.shape
    w = exists.reshape(-1).to(G.dtype)
    g = G.reshape(-1)
    set_count, set_total = _set_sums(sets.reshape(-1), w, g)
    _, own_total = _set_sums(own.reshape(-1), w, g)
    others_f = others.reshape(-1).to(G.dtype)
    anchored = others_f > 0
    fallback, _ = _loo_turn_index_baseline(G, exists, group)
    step = g - torch.where(anchored, (set_total - own_total) / others_f.clamp(min=1), fallback.reshape(-1))
    if by_std:
        ti = _turn_index_sets(group, n)
        ti_count, ti_total = _set_sums(ti, w, g)
        _, set_sq = _set_sums(sets.reshape(-1), w, (g - set_total / set_count.clamp(min=1)).square())
        _, ti_sq = _set_sums(ti, w, (g - ti_total / ti_count.clamp(min=1)).square())
        use_count, sq_sum = torch.where(anchored, set_count, ti_count), torch.where(anchored, set_sq, ti_sq)
        step = step / (torch.where(use_count < 2, 1.0, (sq_sum / (use_count - 1).clamp(min=1)).sqrt()) + epsilon)
    return step.reshape(b, n)


@register_adv_est(AdvantageEstimator.GIGPO, needs_index=True, settings=GiGPOSettings)
def gigpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    step_advantage_w: float = 1.0,
    gigpo_mode: str = "mean_norm",
    gamma: float = 1.0,
    epsilon: float = GRPO_EPS,
    *,
    spans: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    responses: torch.Tensor | None = None,
    turn_states=None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO (Feng et al., arXiv:2505.10978; verl-agent ``gigpo/core_gigpo.py``), span-native: one
    row per episode, no per-step rows.

    ``A_{i,k} = A^E_i + step_advantage_w * A^S_{i,k}`` on turn k's ASSISTANT tokens:

    * episode level ``A^E_i = R_i - mean_group(R)`` (``R_i`` = the row's reward sum; GRPO's
      statistics, a group of one has mean 0), divided by ``std_group(R) + epsilon`` in
      ``gigpo_mode="mean_std_norm"``: exactly :func:`~advantages.estimators.grpo`;
    * step level ``A^S_{i,k} = G_{i,k} - b_{i,k}``: ``b`` = the mean of ``G`` over the turns of the
      *other* episodes of the group that start from the same anchor state (leave-one-out, the
      episode's own revisits excluded, so ``b`` never depends on the episode's own actions); a
      state no other episode visited falls back to :func:`turn_rloo`'s turn-index baseline. In
      ``mean_std_norm`` it is divided by the Bessel std of ``G`` over the anchor set (the turn-index
      set in a fallback; 1 below two members) ``+ epsilon``.

    Anchor state of turn k: ``turn_states[i][k]`` (a ``(b, n_turns)`` integer tensor with -1 on
    absent turns, or a list per row of hashable keys: a task's hook) when given; else the token
    ids of the OBSERVATION span before turn k, from ``responses`` ``(b, t)`` (identical tool
    results = the same state; turn 0's state is the prompt, shared by the group), keyed by two
    polynomial hashes and the length; ``validate`` compares the tokens of every member with its
    set's first member and raises ValueError naming row and turn on a collision.

    Bias: ``mean_norm``'s expected gradient is ``(1 - 1/G + step_advantage_w) grad J`` for groups of
    G episodes (the episode part's mean includes the episode itself; the step part is unbiased);
    ``mean_std_norm`` is biased (as GRPO). verl-agent's own step baseline includes the episode
    itself and its revisits: biased (docs/design.md).
    """
    if gigpo_mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"gigpo_mode must be 'mean_norm' or 'mean_std_norm', got {gigpo_mode!r}")
    check_discount("gamma", gamma)
    sets, others, tables, group, own = _anchor_sets(
        token_level_rewards, response_mask, index, spans, turn_ids, responses, turn_states, validate
    )
    r, exists = tables.r, tables.exists
    G = _turn_returns(r, exists, gamma)
    episode = _episode_advantage(r.sum(1), group, gigpo_mode == "mean_std_norm", epsilon)
    step = _step_advantage(G, exists, group, sets, own, others, gigpo_mode == "mean_std_norm", epsilon)
    advantages = torch.where(exists, episode.unsqueeze(1) + step_advantage_w * step, 0.0)
    dtype = token_level_rewards.dtype
    advantages, returns = tables.broadcast([advantages, G], dtype)
    return advantages, returns


# Session-aware without joining the tokens (advantages/sessions.py): these read per-turn tables only, so a
# session's turns are laid out from its rows' tables (gigpo's observation keys hashed across each session's rows).
FAST_PATHS.update({fast_path_key(fn): functools.partial(turns_by_session, _tables)
                   for fn in (turn_returns, turn_rloo, turn_index_normalized, turn_gae)})
FAST_PATHS[fast_path_key(gigpo)] = functools.partial(turns_by_session, _tables, collisions=_check_collisions_by_hash)
