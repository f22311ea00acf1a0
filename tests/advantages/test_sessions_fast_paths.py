"""Session-aware estimators without joining (issue 54 item 6): each fast path of
:data:`advantages.sessions.FAST_PATHS` against the join path (:func:`advantages.sessions.estimate_by_joining`)
on random batches: sessions of 1 to 4 segments whose rows are shuffled (not adjacent, not in segment
order), later segments opening with OBSERVATION tokens or not, trailing PAD of any length. The chained
scans are bit for bit the joined scans before whitening; whitening and the outcome scores add in
another order (1e-12 in float64, float32 to its rounding). gigpo keyed by the observation tokens (no
turn_states) is bit for bit the join path's: its chained turn pass gives the joined rows' keys exactly.
"""

import functools
import random

import pytest
import torch

import advantages.native_turns as native_turns
import advantages.sessions as sessions
import advantages.turn_credit as turn_credit
from advantages import get_estimator
from advantages.native_turns import native_turn_tables
from advantages.turn_credit import turn_ids_from_spans
from masking.kinds import SpanKind
from masking.sessions import join_tokens, join_turn_ids, segment_chain, session_join, session_rows, turn_layout

A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)
FAST = {"grpo": "outcome_by_session", "rloo": "outcome_by_session",
        "reinforce_plus_plus": "returns_by_session", "gae": "gae_by_session",
        "turn_rloo": "turns_by_session", "turn_index_normalized": "turns_by_session", "turn_gae": "turns_by_session",
        "gigpo": "turns_by_session", "turn_returns": "turns_by_session"}
TURNS = ("turn_returns", "turn_rloo", "turn_index_normalized", "turn_gae", "gigpo")


def _path(name: str):
    return sessions.FAST_PATHS[sessions.fast_path_key(get_estimator(name).fn)]


def _random_batch(seed: int, dtype=torch.float64, n_sessions: int = 9, width: int = 24, opens: bool = False) -> dict:
    """``(b, t)`` rows that are segments of ``n_sessions`` sessions (1-4 segments each) in random row order;
    ``opens``: every later segment opens with an OBSERVATION (else some open with their first turn, which a
    turn-level estimator without turn ids would merge with the turn before)."""
    rng = random.Random(seed)
    rows, session, segment, group = [], [], [], []
    for s in range(n_sessions):
        for k in range(rng.randint(1, 4)):
            spans = [O] * (rng.randint(1, 3) if k and (opens or rng.random() < 0.6) else 0)
            while len(spans) < width - 6 and (not spans or rng.random() < 0.7):
                spans += [A] * rng.randint(1, 4) + [O] * rng.randint(0, 2)
            spans = spans[:width]
            rows.append(spans + [P] * (width - len(spans)))
            session.append(s)
            segment.append(k)
            group.append(s % 3)
    order = list(range(len(rows)))
    rng.shuffle(order)
    spans = torch.tensor([rows[i] for i in order], dtype=torch.int8)
    mask = (spans == A).to(dtype)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.where(spans == A, torch.randn(spans.shape, generator=g, dtype=torch.float64), 0.0)
    rewards = torch.where(torch.rand(spans.shape, generator=g) < 0.3, rewards, 0.0).to(dtype)
    values = torch.randn(spans.shape, generator=g, dtype=torch.float64).to(dtype)
    pick = torch.tensor(order)
    turn_ids = turn_ids_from_spans(spans)
    count = turn_ids.amax(1) + 1
    m = int(count.max()) + 1
    states = torch.randint(0, 3, (len(rows), m), generator=g)
    return {"turn_states": torch.where(torch.arange(m) < count.unsqueeze(1), states, -1),
            "responses": torch.randint(3, 6, spans.shape, generator=g),"token_level_rewards": rewards, "response_mask": mask, "spans": spans, "values": values,
            "turn_ids": turn_ids,
            "index": torch.tensor(group)[pick], "session": torch.tensor(session)[pick],
            "segment": torch.tensor(segment)[pick]}


def _kwargs(name: str, batch: dict, **settings) -> dict:
    entry = get_estimator(name)
    fields = {k: batch[k] for k in entry.batch_arguments if k in batch and k not in ("token_level_rewards", "response_mask")}
    return {**fields, **settings}


def _both(name: str, batch: dict, **settings):
    """(fast path, join path) outputs of ``name`` on ``batch``."""
    fn = get_estimator(name).fn
    args = (batch["token_level_rewards"], batch["response_mask"], batch["session"], batch["segment"])
    kwargs = _kwargs(name, batch, **settings)
    fast = _path(name)(fn, args[0], args[1], *args[2:], dict(kwargs))
    joined = sessions.estimate_by_joining(fn, args[0], args[1], *args[2:], dict(kwargs))
    return fast, joined


def test_every_fast_path_is_a_registered_estimator_and_is_dispatched():
    for name, path in FAST.items():
        assert getattr(_path(name), "func", _path(name)) is getattr(sessions, path)
    assert len(sessions.FAST_PATHS) == len(FAST)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name,settings", [
    ("grpo", {}), ("grpo", {"norm_adv_by_std_in_grpo": False}), ("rloo", {}),
    ("reinforce_plus_plus", {"gamma": 0.9}), ("reinforce_plus_plus", {"gamma": 1.0}),
    ("reinforce_plus_plus", {"gamma": 0.9, "whiten": False}), ("reinforce_plus_plus", {"gamma": 0.0, "whiten": False}),
    ("gae", {"gamma": 0.9, "lam": 0.8}), ("gae", {"gamma": 1.0, "lam": 0.95, "whiten": False}),
    ("gae", {"gamma": 0.7, "lam": 0.3, "whiten": False}),
])
def test_the_fast_path_equals_the_join_path_in_float64(name, settings, seed, validate):
    fast, joined = _both(name, _random_batch(seed), validate=validate, **settings)
    exact = name in ("reinforce_plus_plus", "gae") and settings.get("whiten") is False
    for f, j in zip(fast, joined):
        if exact:  # the same double recurrence in the same order
            assert torch.equal(f, j)
        else:
            torch.testing.assert_close(f, j, rtol=0, atol=1e-12)


@pytest.mark.parametrize("turn_ids", ["given", "int16", "derived"])
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name,settings", [
    ("turn_returns", {"gamma": 0.9}), ("turn_returns", {"gamma": 0.9, "whiten": False}), ("turn_returns", {}),
    ("turn_rloo", {"gamma": 0.9}), ("turn_rloo", {}), ("turn_index_normalized", {"gamma": 0.8}),
    ("turn_index_normalized", {"gamma": 1.0, "epsilon": 0.1}), ("turn_gae", {"gamma": 0.9, "lam": 0.7}), ("turn_gae", {}),
])
def test_the_turn_fast_path_equals_the_join_path_in_float64(name, settings, seed, validate, turn_ids):
    batch = _random_batch(seed, opens=True)
    if turn_ids == "derived":
        batch.pop("turn_ids")
    elif turn_ids == "int16":
        batch["turn_ids"] = batch["turn_ids"].to(torch.int16)
    fast, joined = _both(name, batch, validate=validate, **settings)
    for f, j in zip(fast, joined):
        torch.testing.assert_close(f, j, rtol=0, atol=1e-12)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("settings", [{}, {"gigpo_mode": "mean_std_norm", "gamma": 0.9, "step_advantage_w": 0.5}])
@pytest.mark.parametrize("states", ["tensor", "lists"])
def test_the_gigpo_fast_path_with_turn_states_equals_the_join_path(settings, seed, validate, states):
    batch = _random_batch(seed, opens=True)
    batch.pop("responses")
    if states == "lists":
        batch["turn_states"] = [[f"s{x}" for x in row if x >= 0] for row in batch["turn_states"].tolist()]
    fast, joined = _both("gigpo", batch, validate=validate, **settings)
    for f, j in zip(fast, joined):
        torch.testing.assert_close(f, j, rtol=0, atol=1e-12)


def _observation_batch(seed: int, dtype=torch.float64, opens: bool = False, turn_ids: str = "given", **more) -> dict:
    """:func:`_random_batch` without turn_states: gigpo keys each turn by the observation tokens before it."""
    batch = _random_batch(seed, dtype, opens=opens, **more)
    batch.pop("turn_states")
    if turn_ids == "derived":
        batch.pop("turn_ids")
    elif turn_ids == "int16":
        batch["turn_ids"] = batch["turn_ids"].to(torch.int16)
    return batch


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("turn_ids", ["given", "int16", "derived"])
@pytest.mark.parametrize("opens", [True, False])
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("settings", [{}, {"gigpo_mode": "mean_std_norm", "gamma": 0.9, "step_advantage_w": 0.5}])
def test_the_gigpo_fast_path_on_observation_keys_equals_the_join_path(settings, seed, validate, opens, turn_ids, dtype):
    """Shuffled rows, 1-4 segments, later segments opening with OBSERVATION tokens or not (without turn ids those
    join: the joined row may merge the turns), trailing PAD: bit for bit the join path's outputs."""
    fast, joined = _both("gigpo", _observation_batch(seed, dtype, opens, turn_ids), validate=validate, **settings)
    for f, j in zip(fast, joined):
        assert f.dtype == dtype
        assert torch.equal(f, j)


def _joined_tables(batch: dict, chained: bool):
    """The compiled turn tables (reward sums, the two keys, the check hash and length) of ``batch``'s sessions:
    ``chained``, the rows' own with hashes carried across each session's segments, laid out per session;
    else the joined rows'."""
    spans, rewards, tokens = batch["spans"], batch["token_level_rewards"], batch["responses"]
    if chained:
        kwargs = {"spans": spans, "turn_ids": batch["turn_ids"], "responses": tokens}
        r, count, n, hashes, _ = sessions._chained_observation_tables(
            rewards, batch["response_mask"], batch["session"], batch["segment"], kwargs, True)
        target, total, most = turn_layout(batch["session"], batch["segment"], count, n)
        sessions_ = len(total)
        return total, [sessions._join_per_turn(x, target, sessions_, most) for x in (r, *hashes)]
    join = session_join(spans, batch["session"], batch["segment"])
    r, count, n, hashes, _ = native_turn_tables(join_tokens(rewards, join), join_tokens(spans, join, SpanKind.PAD),
                                                join_turn_ids(batch["turn_ids"], join), join_tokens(tokens, join),
                                                check=True)
    return count, [torch.where(torch.arange(n) < count.unsqueeze(1), x, 0) for x in (r, *hashes)]


@pytest.mark.parametrize("opens", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_the_chained_turn_pass_gives_the_joined_rows_keys(seed, opens):
    """Every session turn's reward sum, both keys, check hash and observation length equal the joined row's, the
    first turn of a later segment hashing the previous segments' trailing observation and its own opening one."""
    batch = _observation_batch(seed, opens=opens, n_sessions=20)
    total, chained = _joined_tables(batch, True)
    count, joined = _joined_tables(batch, False)
    assert torch.equal(total, count)
    for c, j in zip(chained, joined):
        assert torch.equal(c, j)
    unchained = native_turn_tables(batch["token_level_rewards"], batch["spans"], batch["turn_ids"], batch["responses"],
                                   check=True)  # each row on its own: some keys differ (what the chain is for)
    target, _, most = turn_layout(batch["session"], batch["segment"], unchained[1], unchained[2])
    assert not torch.equal(sessions._join_per_turn(unchained[3][0], target, len(total), most), joined[1])


def test_the_chained_turn_pass_with_more_turns_than_its_first_columns(monkeypatch):
    """Rows with more turns than the first try's columns: the pass runs again, the chain from the start."""
    monkeypatch.setattr(native_turns, "FIRST_COLUMNS", 2)
    for seed in range(3):
        fast, joined = _both("gigpo", _observation_batch(seed), validate=True)
        for f, j in zip(fast, joined):
            assert torch.equal(f, j)


@pytest.mark.parametrize("turn_ids,opens", [("given", False), ("int16", False), ("derived", True)])
def test_gigpo_on_observation_keys_takes_the_fast_path(turn_ids, opens, monkeypatch):
    batch = _observation_batch(2, opens=opens, turn_ids=turn_ids)
    joined = sessions.estimate_by_joining(get_estimator("gigpo").fn, batch["token_level_rewards"], batch["response_mask"],
                                          batch["session"], batch["segment"], _kwargs("gigpo", batch))

    def refuse(*args, **kwargs):
        raise AssertionError("joined")

    monkeypatch.setattr(sessions, "estimate_by_joining", refuse)
    got = get_estimator("gigpo")(batch["token_level_rewards"], batch["response_mask"], **_kwargs("gigpo", batch),
                                 session=batch["session"], segment=batch["segment"])
    for f, j in zip(got, joined):
        assert torch.equal(f, j)


def test_gigpo_on_observation_keys_joins_where_the_chained_pass_cannot_run(monkeypatch):
    """Without turn ids a later segment opening with an ASSISTANT token joins (the joined row may merge it into the
    turn before); without the compiled pass it joins (torch's hashes, the same groups)."""
    joins = []
    join = sessions.estimate_by_joining
    monkeypatch.setattr(sessions, "estimate_by_joining", lambda *args: joins.append(1) or join(*args))
    batch = _observation_batch(3, opens=False, turn_ids="derived")
    assert bool(((batch["spans"][:, 0] == A) & (batch["segment"] > 0)).any())
    fast, joined = _both("gigpo", batch)
    assert len(joins) == 2 and all(torch.equal(f, j) for f, j in zip(fast, joined))
    batch = _observation_batch(3)
    want = _both("gigpo", batch)[1]
    monkeypatch.setattr(sessions, "native_turn_tables", lambda *args, **kwargs: None)
    fast, _ = _both("gigpo", batch)
    assert len(joins) == 5
    for f, w in zip(fast, want):
        torch.testing.assert_close(f, w, rtol=0, atol=1e-12)


def test_the_gigpo_fast_path_checks_observation_keys_and_turn_ids(monkeypatch):
    """validate: a hash collision (here: a perturbed check hash) is gigpo's ValueError on the per-session tables;
    a bad turn id is the join path's (which names it); unvalidated neither is checked."""
    batch = _observation_batch(4, opens=True)
    call = functools.partial(get_estimator("gigpo"), batch["token_level_rewards"], batch["response_mask"],
                             session=batch["session"], segment=batch["segment"])
    turn_ids = batch["turn_ids"].clone()
    turn_ids[batch["spans"] == A] += 1
    with pytest.raises(ValueError, match=r"turn_ids: row \d+, position \d+: .*joined by session"):
        call(**_kwargs("gigpo", {**batch, "turn_ids": turn_ids}))
    tables = sessions.native_turn_tables

    def perturbed(*args, **kwargs):
        r, count, n, hashes, values = tables(*args, **kwargs)
        if len(hashes) > 2:  # validating: the check hash differs in every turn
            hashes = (*hashes[:2], hashes[2] + torch.arange(hashes[2].numel()).reshape(hashes[2].shape), *hashes[3:])
        return r, count, n, hashes, values

    monkeypatch.setattr(sessions, "native_turn_tables", perturbed)
    with pytest.raises(ValueError, match=r"gigpo: hash collision: the observation before row \d+, turn \d+"):
        call(**_kwargs("gigpo", batch))
    call(**_kwargs("gigpo", batch), validate=False)


def test_the_gigpo_fast_path_checks_the_turn_states():
    batch = _random_batch(1, opens=True)
    states = batch["turn_states"].clone()
    row = int(torch.nonzero(states[:, 0] >= 0)[0, 0])
    turns = int((states[row] >= 0).sum())
    states[row, turns] = 1
    with pytest.raises(ValueError, match=rf"turn_states: row {row}, turn {turns}: the row has {turns} turns"):
        get_estimator("gigpo")(batch["token_level_rewards"], batch["response_mask"],
                               **_kwargs("gigpo", {**batch, "turn_states": states}),
                               session=batch["session"], segment=batch["segment"])


def test_the_turn_fast_path_without_the_compiled_pass(monkeypatch):
    """The torch turn tables (no compiler) give the same."""
    batch = _random_batch(7, opens=True)
    want = [_both(name, batch) for name in TURNS]
    monkeypatch.setattr(turn_credit, "native_turn_tables", lambda *args, **kwargs: None)
    for name, (native, _) in zip(TURNS, want):
        fast, joined = _both(name, batch)
        for f, j, n in zip(fast, joined, native):
            torch.testing.assert_close(f, j, rtol=0, atol=1e-12)
            torch.testing.assert_close(f, n, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,settings", [
    ("grpo", {}), ("rloo", {}), ("reinforce_plus_plus", {"gamma": 0.95}), ("gae", {"gamma": 1.0, "lam": 0.95}),
    ("turn_rloo", {}), ("turn_index_normalized", {}), ("turn_gae", {"gamma": 1.0, "lam": 0.95}), ("turn_returns", {}),
])
def test_the_fast_path_equals_the_join_path_in_float32(name, settings):
    fast, joined = _both(name, _random_batch(11, torch.float32, n_sessions=40, opens=True), validate=False, **settings)
    for f, j in zip(fast, joined):
        assert f.dtype == torch.float32
        torch.testing.assert_close(f, j, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(FAST))
def test_the_registry_takes_the_fast_path_on_the_cpu(name, monkeypatch):
    batch = _random_batch(3, opens=name in TURNS)
    want = get_estimator(name)(batch["token_level_rewards"], batch["response_mask"],
                               **_kwargs(name, batch, **({"gamma": 0.9, "lam": 0.8} if name == "gae" else {})),
                               session=batch["session"], segment=batch["segment"])

    def refuse(*args, **kwargs):
        raise AssertionError("joined")

    monkeypatch.setattr(sessions, "estimate_by_joining", refuse)
    got = get_estimator(name)(batch["token_level_rewards"], batch["response_mask"],
                              **_kwargs(name, batch, **({"gamma": 0.9, "lam": 0.8} if name == "gae" else {})),
                              session=batch["session"], segment=batch["segment"])
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "gae"])
def test_the_scans_join_where_the_compiled_scan_does_not_run(name, monkeypatch):
    """No compiler (or not the CPU): the scans fall back to the join path; an unknown keyword is ``fn``'s TypeError."""
    batch = _random_batch(4)
    settings = {"gamma": 0.9, "lam": 0.8} if name == "gae" else {"gamma": 0.9}
    fast, joined = _both(name, batch, **settings)
    monkeypatch.setattr(sessions, "native_chained_returns", lambda *args, **kwargs: None)
    monkeypatch.setattr(sessions, "native_chained_gae", lambda *args, **kwargs: None)
    fallback, _ = _both(name, batch, **settings)
    for f, j in zip(fallback, joined):
        assert torch.equal(f, j)
    with pytest.raises(TypeError):
        get_estimator(name)(batch["token_level_rewards"], batch["response_mask"], **_kwargs(name, batch, **settings),
                            epsilon=1.0, session=batch["session"], segment=batch["segment"])


def test_fast_paths_check_what_the_join_path_checks():
    batch = _random_batch(5, opens=True)
    args = (batch["token_level_rewards"], batch["response_mask"])
    wrong_group = batch["index"].clone()
    row = int(torch.nonzero(batch["segment"] == 1)[0, 0])
    wrong_group[row] += 1
    with pytest.raises(ValueError, match=r"index: rows \d+ and \d+ are segments of one session but in groups"):
        get_estimator("grpo")(*args, index=wrong_group, spans=batch["spans"], session=batch["session"], segment=batch["segment"])
    for name in FAST:
        kwargs = _kwargs(name, batch, **({"gamma": 0.9, "lam": 0.8} if name == "gae" else {}))
        with pytest.raises(ValueError, match=r"are both segment 0"):
            get_estimator(name)(*args, **kwargs, session=batch["session"], segment=torch.zeros_like(batch["segment"]))
        bad = batch["token_level_rewards"].clone()
        bad[batch["spans"] == O] = 1.0
        with pytest.raises(ValueError, match=r"reward"):
            get_estimator(name)(bad, args[1], **kwargs, session=batch["session"], segment=batch["segment"])
    kwargs = _kwargs("gigpo", _observation_batch(5, opens=True))  # gigpo keyed by the observations
    with pytest.raises(ValueError, match=r"are both segment 0"):
        get_estimator("gigpo")(*args, **kwargs, session=batch["session"], segment=torch.zeros_like(batch["segment"]))
    with pytest.raises(ValueError, match=r"reward"):
        get_estimator("gigpo")(bad, args[1], **kwargs, session=batch["session"], segment=batch["segment"])


def test_segment_chain_session_rows_and_turn_layout():
    session, segment = torch.tensor([5, 7, 5, 5, 9]), torch.tensor([2, 0, 0, 1, 0])
    order, nxt, level = segment_chain(session, segment, 5, True)
    assert order.tolist() == [0, 3, 1, 2, 4] and level.tolist() == [2, 1, 0, 0, 0]
    assert nxt.tolist() == [-1, -1, 3, 0, -1]
    dense, first, n = session_rows(session, segment, 5, "cpu", True)
    assert dense.tolist() == [0, 1, 0, 0, 2] and first.tolist() == [2, 1, 4] and n == 3
    target, total, most = turn_layout(session, segment, torch.tensor([2, 1, 1, 0, 3]), 3)
    assert total.tolist() == [3, 1, 3] and most == 3
    assert target.tolist() == [[1, 2, 9], [3, 9, 9], [0, 9, 9], [9, 9, 9], [6, 7, 8]]
