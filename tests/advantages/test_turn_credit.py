"""Turn-level estimators (advantages/turn_credit.py, issue 47) against the serial float64
references of tests/helpers/turn_credit_reference.py, their properties and their bad input.
The exact-gradient proofs are in test_turn_credit_enumeration.py."""

import pytest
import torch

import advantages
import advantages.turn_credit as turn_credit
from advantages import (
    get_estimator,
    gigpo,
    gigpo_anchor_groups,
    grpo,
    rloo,
    turn_gae,
    turn_ids_from_spans,
    turn_index_normalized,
    turn_returns,
    turn_rloo,
)
from advantages.native_turns import compiled_turns
from advantages.registry import BATCH_ARGUMENTS
from tests.helpers.host_syncs import HostSyncs
from tests.helpers.turn_credit_reference import (
    ASSISTANT,
    OBSERVATION,
    Episode,
    build_batch,
    per_turn,
    random_episodes,
    ref_gigpo,
    ref_turn_gae,
    ref_turn_index_normalized,
    ref_turn_returns,
    ref_turn_rloo,
)

TURN_ESTIMATORS = advantages.TURN_LEVEL


@pytest.fixture(autouse=True, params=["compiled", "torch"])
def turn_path(request, monkeypatch):
    """Every test on both CPU paths: the compiled token pass (advantages/native_turns.c) and the torch
    scatter/gather path (what CUDA and machines without a C compiler run)."""
    if request.param == "torch":
        monkeypatch.setattr(turn_credit, "native_turn_tables", lambda *args, **kwargs: None)
    else:
        assert compiled_turns() is not None
    return request.param


def _episodes(seed=0, n_groups=5, group_size=4, **kwargs):
    return random_episodes(torch.Generator().manual_seed(seed), n_groups, group_size, **kwargs)


def _call(name, batch, **kwargs):
    """Call a registered estimator with exactly the batch fields it takes (Estimator.batch_arguments)."""
    entry = get_estimator(name)
    fields = {k: batch[k] for k in entry.batch_arguments if k in batch and k not in ("token_level_rewards", "response_mask")}
    return entry(batch["token_level_rewards"], batch["response_mask"], **fields, **kwargs)


def _close(actual, expected, tol=1e-12):
    assert len(actual) == len(expected)
    for row, (a, e) in enumerate(zip(actual, expected)):
        assert a == pytest.approx(e, abs=tol, rel=tol), f"row {row}: {a} != {e}"


# ----------------------------------------------------------------------------- turn ids


def test_turn_ids_from_spans_match_the_loop_record():
    episodes = _episodes(1)
    batch = build_batch(episodes)
    derived = turn_ids_from_spans(batch["spans"])
    assert derived.dtype == torch.long
    assert torch.equal(derived, batch["turn_ids"].long())
    spans = torch.tensor([[OBSERVATION, ASSISTANT, OBSERVATION, OBSERVATION, ASSISTANT, ASSISTANT, 0]], dtype=torch.int8)
    assert turn_ids_from_spans(spans).tolist() == [[-1, 0, 0, 0, 1, 1, -1]]


# ----------------------------------------------------------------------------- against the references


@pytest.mark.parametrize("gamma", [1.0, 0.8])
@pytest.mark.parametrize("given_turn_ids", [True, False])
def test_turn_returns_match_reference(gamma, given_turn_ids):
    episodes = _episodes(2)
    batch = build_batch(episodes)
    if not given_turn_ids:
        del batch["turn_ids"]
    for whiten in (False, True):
        adv, returns = _call("turn_returns", batch, gamma=gamma, whiten=whiten)
        _close(per_turn(adv, build_batch(episodes), episodes), ref_turn_returns(episodes, gamma, whiten))
        _close(per_turn(returns, build_batch(episodes), episodes), ref_turn_returns(episodes, gamma, False))


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_turn_rloo_and_turn_index_normalized_match_reference(gamma):
    episodes = _episodes(3)
    batch = build_batch(episodes)
    adv, returns = _call("turn_rloo", batch, gamma=gamma)
    _close(per_turn(adv, batch, episodes), ref_turn_rloo(episodes, gamma))
    _close(per_turn(returns, batch, episodes), ref_turn_returns(episodes, gamma, False))
    adv, _ = _call("turn_index_normalized", batch, gamma=gamma, epsilon=1e-6)
    _close(per_turn(adv, batch, episodes), ref_turn_index_normalized(episodes, gamma, 1e-6), tol=1e-10)


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("w", [0.0, 1.0, 0.4])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gigpo_matches_reference_with_observation_states(mode, w, gamma):
    episodes = _episodes(4, n_groups=6, group_size=5)
    batch = build_batch(episodes)
    del batch["values"]
    adv, returns = _call("gigpo", batch, step_advantage_w=w, gigpo_mode=mode, gamma=gamma)
    _close(per_turn(adv, batch, episodes), ref_gigpo(episodes, w, mode, gamma), tol=1e-10)
    _close(per_turn(returns, batch, episodes), ref_turn_returns(episodes, gamma, False))


def test_gigpo_observation_states_recur_and_some_fall_back():
    """The random episodes exercise every branch: shared states, revisits within an episode, fallbacks."""
    episodes = _episodes(4, n_groups=6, group_size=5)
    batch = build_batch(episodes)
    sets, others = gigpo_anchor_groups(batch["response_mask"], batch["index"], spans=batch["spans"],
                                       turn_ids=batch["turn_ids"], responses=batch["responses"])
    exists = sets >= 0
    assert bool((others[exists] > 0).any()) and bool((others[exists] == 0).any())
    revisits = [len(e.state_keys()) != len(set(e.state_keys())) for e in episodes]
    assert any(revisits)
    for row, e in enumerate(episodes):  # equal ids exactly for equal (group, state)
        for row2, f in enumerate(episodes):
            for k, s in enumerate(e.state_keys()):
                for m, s2 in enumerate(f.state_keys()):
                    same = e.group == f.group and s == s2
                    assert (int(sets[row, k]) == int(sets[row2, m])) == same


@pytest.mark.parametrize("as_list", [True, False])
def test_gigpo_with_turn_states(as_list):
    episodes = _episodes(5, n_groups=4, group_size=4)
    gen = torch.Generator().manual_seed(9)
    for e in episodes:  # task-given states: coarser than the observations, recurring
        e.states = [("s", int(torch.randint(0, 3, (1,), generator=gen))) for _ in e.assistant]
    batch = build_batch(episodes)
    if as_list:
        states = [e.states for e in episodes]
    else:
        n = max(len(e.states) for e in episodes)
        states = torch.tensor([[s[1] for s in e.states] + [-1] * (n - len(e.states)) for e in episodes])
    for mode in ("mean_norm", "mean_std_norm"):
        adv, _ = gigpo(batch["token_level_rewards"], batch["response_mask"], batch["index"], 0.7, mode,
                       spans=batch["spans"], turn_states=states)
        _close(per_turn(adv, batch, episodes), ref_gigpo(episodes, 0.7, mode), tol=1e-10)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (1.0, 0.0), (0.7, 0.3)])
def test_turn_gae_matches_reference(gamma, lam):
    episodes = _episodes(6)
    batch = build_batch(episodes)
    adv, returns = _call("turn_gae", batch, gamma=gamma, lam=lam)
    expected = ref_turn_gae(episodes, gamma, lam)
    _close(per_turn(adv, batch, episodes), expected)
    _close(per_turn(returns, batch, episodes), [[a + v for a, v in zip(row, e.values)] for row, e in zip(expected, episodes)])


def test_values_off_the_first_assistant_token_are_never_read():
    episodes = _episodes(6)
    batch = build_batch(episodes)
    first = batch["values"].clone()
    noisy = batch["values"].clone()
    is_first = (batch["spans"] == ASSISTANT) & (batch["turn_ids"] != torch.nn.functional.pad(batch["turn_ids"][:, :-1], (1, 0), value=-1))
    noisy[~is_first] = float("nan")
    for values in (first, noisy):
        adv, _ = turn_gae(batch["token_level_rewards"], values, batch["response_mask"], 0.9, 0.8, spans=batch["spans"])
        _close(per_turn(adv, batch, episodes), ref_turn_gae(episodes, 0.9, 0.8))


def test_unvalidated_and_float32_paths_agree():
    episodes = _episodes(7)
    batch = build_batch(episodes)
    batch32 = build_batch(episodes, dtype=torch.float32)
    for name in TURN_ESTIMATORS:
        checked = _call(name, batch)[0]
        assert torch.equal(_call(name, batch, validate=False)[0], checked), name
        single = _call(name, batch32)[0]
        assert single.dtype == torch.float32
        torch.testing.assert_close(single.double(), checked, atol=1e-5, rtol=1e-5)


def test_mask_only_input_equals_spans_input():
    """Mask-only batches (every 0 an OBSERVATION, the trailing ones joining no turn), with the loop's
    turn ids (-1 on the padding) or without."""
    episodes = _episodes(8)
    batch = build_batch(episodes)
    with_turn_ids = dict(batch)
    del with_turn_ids["spans"]
    mask_only = dict(with_turn_ids)
    del mask_only["turn_ids"]
    for name in TURN_ESTIMATORS:
        expected = _call(name, batch)[0]
        assert torch.equal(_call(name, mask_only)[0], expected), name
        assert torch.equal(_call(name, with_turn_ids)[0], expected), name


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("name", TURN_ESTIMATORS)
def test_exactly_zero_off_assistant(name):
    episodes = _episodes(10)
    batch = build_batch(episodes, width=40)
    adv, returns = _call(name, batch)
    off = batch["spans"] != ASSISTANT
    assert bool((adv[off] == 0).all()) and bool((returns[off] == 0).all())
    assert bool((adv[~off] != 0).any())


def _widen(episodes, seed):
    """The same episodes with more OBSERVATION tokens (the tool results' content kept: the extra
    tokens are template tokens on every observation of a given content alike), more ASSISTANT
    tokens on turns (so observations move to other offsets) and more PAD."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for e in episodes:
        out.append(Episode(
            group=e.group,
            assistant=[a * 2 for a in e.assistant],
            observations=[o if not o else [1, 2] + o + [2, 1] for o in e.observations],
            turn_rewards=e.turn_rewards, outcome=e.outcome,
            pad=e.pad + int(torch.randint(0, 5, (1,), generator=gen)),
            values=e.values, states=e.states,
        ))
    return out


@pytest.mark.parametrize("name", ["turn_rloo", "turn_index_normalized", "gigpo", "turn_gae"])
def test_inserting_observation_and_padding_tokens_keeps_assistant_advantages(name):
    episodes = _episodes(11)
    widened = _widen(episodes, 0)
    a = per_turn(_call(name, build_batch(episodes))[0], build_batch(episodes), episodes)
    b = per_turn(_call(name, build_batch(widened, width=80))[0], build_batch(widened, width=80), widened)
    _close(b, a)


def test_inserting_observation_tokens_keeps_turn_returns():
    """turn_returns whitens over tokens, so compare it unwhitened (the whitening weights tokens by design)."""
    episodes = _episodes(12)
    batch = build_batch(episodes)
    extra = build_batch([Episode(e.group, e.assistant, [o and [4] * 5 + o for o in e.observations], e.turn_rewards,
                                 e.outcome, e.pad + 3, e.values) for e in episodes])
    _close(per_turn(_call("turn_returns", extra, whiten=False)[0], extra, episodes),
           per_turn(_call("turn_returns", batch, whiten=False)[0], batch, episodes))


def _one_turn(seed):
    gen = torch.Generator().manual_seed(seed)
    episodes = []
    for group in range(6):
        for _ in range(1 + group % 4):  # groups of 1 to 4
            n = 1 + int(torch.randint(0, 4, (1,), generator=gen))
            episodes.append(Episode(group, [[11] * n], [[]], [float(torch.randn(1, generator=gen))],
                                    float(torch.randint(0, 2, (1,), generator=gen)), pad=int(torch.randint(0, 3, (1,), generator=gen))))
    return episodes


def test_one_turn_turn_rloo_is_rloo_and_gigpo_without_steps_is_grpo():
    episodes = _one_turn(13)
    batch = build_batch(episodes)
    r, m, index, spans = batch["token_level_rewards"], batch["response_mask"], batch["index"], batch["spans"]
    # equal up to rounding: rloo computes (R - mean) n / (n - 1), turn_rloo R - (sum - R) / (n - 1)
    torch.testing.assert_close(turn_rloo(r, m, index, spans=spans)[0], rloo(r, m, index, spans=spans)[0], rtol=0, atol=1e-14)
    mean_only = grpo(r, m, index, norm_adv_by_std_in_grpo=False, spans=spans)[0]
    torch.testing.assert_close(gigpo(r, m, index, 0.0, spans=spans, responses=batch["responses"])[0], mean_only, rtol=0, atol=1e-15)
    with_std = grpo(r, m, index, spans=spans)[0]
    torch.testing.assert_close(gigpo(r, m, index, 0.0, "mean_std_norm", spans=spans, responses=batch["responses"])[0],
                               with_std, rtol=0, atol=1e-15)
    # multi-turn too: gigpo at w = 0 is mean-only GRPO over the episodes' reward sums
    multi = _episodes(14)
    mb = build_batch(multi)
    torch.testing.assert_close(
        gigpo(mb["token_level_rewards"], mb["response_mask"], mb["index"], 0.0, responses=mb["responses"], spans=mb["spans"])[0],
        grpo(mb["token_level_rewards"], mb["response_mask"], mb["index"], norm_adv_by_std_in_grpo=False, spans=mb["spans"])[0],
        rtol=0, atol=1e-14)


def test_singleton_anchors_fall_back_to_the_turn_index_baseline():
    """Two episodes of one group: turn 1 sees different observations (singleton anchors: the turn
    index baseline, i.e. turn_rloo's), turn 2 the same one (leave-one-out over it), and episode 0
    revisits its turn-1 state at turn 3 (its own revisit is not its baseline)."""
    e0 = Episode(0, [[10], [11], [12], [13]], [[], [3], [5], [3]], [0.0, 1.0, 0.0, 2.0])
    e1 = Episode(0, [[10], [11], [12]], [[], [4], [5]], [1.0, 0.0, 0.5])
    episodes = [e0, e1]
    batch = build_batch(episodes)
    sets, others = gigpo_anchor_groups(batch["response_mask"], batch["index"], spans=batch["spans"], responses=batch["responses"])
    assert others.tolist() == [[1, 0, 1, 0], [1, 0, 1, 0]]
    assert sets[0, 1] == sets[0, 3] and sets[0, 1] != sets[1, 1]
    got = per_turn(gigpo(batch["token_level_rewards"], batch["response_mask"], batch["index"], 1.0,
                         spans=batch["spans"], responses=batch["responses"])[0], batch, episodes)
    G0, G1 = [3.0, 3.0, 2.0, 2.0], [1.5, 0.5, 0.5]
    episode = [(3.0 - 1.5) / 2 * 1, (1.5 - 3.0) / 2]  # R - mean over the two
    expected0 = [episode[0] + G0[0] - G1[0], episode[0] + G0[1] - G1[1], episode[0] + G0[2] - G1[2], episode[0] + G0[3] - 0.0]
    expected1 = [episode[1] + G1[0] - G0[0], episode[1] + G1[1] - G0[1], episode[1] + G1[2] - G0[2]]
    _close(got, [expected0, expected1])
    _close(got, ref_gigpo(episodes))


def test_group_of_one_keeps_its_returns():
    e = Episode(0, [[10], [11]], [[], [3]], [1.0, 2.0], outcome=1.0)
    batch = build_batch([e])
    _close(per_turn(_call("turn_rloo", batch)[0], batch, [e]), [[4.0, 3.0]])
    _close(per_turn(_call("gigpo", batch)[0], batch, [e]), [[4.0 + 4.0, 4.0 + 3.0]])  # episode part: R - 0
    _close(per_turn(_call("turn_index_normalized", batch)[0], batch, [e]), [[4.0 / (1 + 1e-6), 3.0 / (1 + 1e-6)]], tol=1e-12)


def test_turn_split_over_two_assistant_runs_by_given_turn_ids():
    """Given turn ids are trusted: one turn may span two ASSISTANT runs (a template token between)."""
    spans = torch.tensor([[1, 2, 1, 2, 1, 0]], dtype=torch.int8)
    turn_ids = torch.tensor([[0, 0, 0, 0, 1, -1]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    adv, _ = turn_returns(rewards, (spans == 1).double(), spans=spans, turn_ids=turn_ids, whiten=False)
    assert adv.tolist() == [[3.0, 0.0, 3.0, 0.0, 2.0, 0.0]]


# ----------------------------------------------------------------------------- registry


def test_registry_entries_and_batch_arguments():
    for name in TURN_ESTIMATORS:
        assert name in advantages.ESTIMATORS
    assert {"turn_ids", "responses", "turn_states"} <= set(BATCH_ARGUMENTS)
    assert get_estimator("gigpo").batch_arguments == (
        "token_level_rewards", "response_mask", "index", "spans", "turn_ids", "responses", "turn_states", "validate")
    assert get_estimator("gigpo").hyperparameters == ("step_advantage_w", "gigpo_mode", "gamma", "epsilon")
    assert get_estimator("turn_gae").batch_arguments[:3] == ("token_level_rewards", "values", "response_mask")
    assert get_estimator("turn_gae").needs_values and get_estimator("turn_rloo").needs_index
    assert get_estimator("gigpo").needs_index and get_estimator("turn_index_normalized").needs_index
    assert not get_estimator("turn_returns").needs_index
    assert get_estimator("grpo").batch_arguments == ("token_level_rewards", "response_mask", "index", "spans", "validate")
    assert get_estimator("gae").batch_arguments == ("token_level_rewards", "values", "response_mask", "spans", "validate")
    assert get_estimator("reinforce_plus_plus").hyperparameters == ("gamma", "whiten")


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def batch():
    return build_batch(_episodes(20, n_groups=2, group_size=3, singleton_group=False))


def test_non_consecutive_turn_ids_name_row_and_position(batch):
    r, m, spans = batch["token_level_rewards"], batch["response_mask"], batch["spans"]
    skipped = batch["turn_ids"].clone()
    row = 2
    second = int(((spans[row] == ASSISTANT) & (skipped[row] == 1)).nonzero()[0])
    if second:
        skipped[row][skipped[row] >= 1] += 1  # turn 1 becomes 2: a gap
    else:
        pytest.skip("row has one turn")
    with pytest.raises(ValueError, match=rf"turn_ids: row {row}, position {second}: ASSISTANT token in turn 2 after turn 0"):
        turn_rloo(r, m, batch["index"], spans=spans, turn_ids=skipped)
    starts_at_one = batch["turn_ids"].clone()
    starts_at_one[0][spans[0] != 0] += 1
    with pytest.raises(ValueError, match=r"turn_ids: row 0, position 0: ASSISTANT token in turn 1 after turn -1"):
        turn_returns(r, m, spans=spans, turn_ids=starts_at_one)
    wrong_obs = batch["turn_ids"].clone()
    pos = int((spans[row] == OBSERVATION).nonzero()[0])
    wrong_obs[row, pos] += 1
    with pytest.raises(ValueError, match=rf"turn_ids: row {row}, position {pos}: OBSERVATION token"):
        gigpo(r, m, batch["index"], spans=spans, turn_ids=wrong_obs, responses=batch["responses"])
    with pytest.raises(ValueError, match="turn_ids must hold integers"):
        turn_returns(r, m, spans=spans, turn_ids=batch["turn_ids"].float())
    with pytest.raises(ValueError, match="turn_ids must be a"):
        turn_returns(r, m, spans=spans, turn_ids=batch["turn_ids"][:, :-1])


@pytest.mark.parametrize("name", ["turn_rloo", "turn_index_normalized", "gigpo"])
def test_group_estimator_without_index(batch, name):
    with pytest.raises(ValueError, match=f"{name} estimator needs index"):
        getattr(turn_credit, name)(batch["token_level_rewards"], batch["response_mask"], None, spans=batch["spans"])
    with pytest.raises(ValueError, match="needs index"):
        get_estimator(name)(batch["token_level_rewards"], batch["response_mask"], spans=batch["spans"])


def test_gigpo_needs_states(batch):
    with pytest.raises(ValueError, match="gigpo needs responses"):
        gigpo(batch["token_level_rewards"], batch["response_mask"], batch["index"], spans=batch["spans"])
    with pytest.raises(ValueError, match="responses must be a"):
        gigpo(batch["token_level_rewards"], batch["response_mask"], batch["index"], spans=batch["spans"],
              responses=batch["responses"].float())
    with pytest.raises(ValueError, match="gigpo_mode"):
        gigpo(batch["token_level_rewards"], batch["response_mask"], batch["index"], 1.0, "std", responses=batch["responses"])


def test_bad_turn_states_name_row_and_turn(batch):
    r, m, index, spans = batch["token_level_rewards"], batch["response_mask"], batch["index"], batch["spans"]
    turns = (batch["turn_ids"].long().amax(1) + 1).tolist()
    n = max(turns)
    good = torch.tensor([[k if k < c else -1 for k in range(n)] for c in turns])
    gigpo(r, m, index, spans=spans, turn_states=good)  # accepted
    row = next(i for i, c in enumerate(turns) if c > 1)

    def call(states):
        return gigpo(r, m, index, spans=spans, turn_states=states)

    with pytest.raises(ValueError, match="turn_states must be a"):
        call(good.float())
    with pytest.raises(ValueError, match="turn_states must be a"):
        call(good[:-1])
    with pytest.raises(ValueError, match="turn_states must be a"):
        call(good[0])
    with pytest.raises(ValueError, match="turn_states must be a"):
        call("abc")
    absent = good.clone()
    absent[row, 1] = -1
    with pytest.raises(ValueError, match=rf"turn_states: row {row}, turn 1: the turn exists but its state is -1"):
        call(absent)
    with pytest.raises(ValueError, match=r"turn_states: row \d+, turn \d+: a state for a turn the row does not have"):
        call(torch.nn.functional.pad(good, (0, 1), value=3))
    narrow = good[:, :1]
    with pytest.raises(ValueError, match=rf"turn_states: row {row}, turn 1: the turn exists but its state is -1"):
        call(narrow)
    lists = [[f"s{k}" for k in range(c)] for c in turns]
    call(lists)
    lists[row] = lists[row][:-1]
    with pytest.raises(ValueError, match=rf"turn_states: row {row} has {turns[row]} turns but {turns[row] - 1} keys"):
        call(lists)
    lists[row] = [["unhashable"]] * turns[row]
    with pytest.raises(ValueError, match=rf"turn_states: row {row}, turn 0: key \['unhashable'\] is not hashable"):
        call(lists)
    with pytest.raises(ValueError, match="turn_states has 1 rows"):
        call([["a"]])


def test_hash_collision_is_found_by_the_check(monkeypatch):
    """With a degenerate hash (mod 2, base 1: the parity of the token sum) observations [3] and [5]
    collide; the check compares the tokens and names the rows and turns."""
    monkeypatch.setattr(turn_credit, "_HASHES", ((2, 1), (2, 1)))  # the torch path's hashes
    compiled = turn_credit.native_turn_tables

    def parity(*args, **kwargs):  # the compiled path's hashes, cut to the same parity
        out = compiled(*args, **kwargs)
        return out if out is None or out[3] is None else (*out[:3], (out[3][0] % 2, out[3][1] % 2, *out[3][2:]), out[4])

    if compiled(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.int8), None) is not None:
        monkeypatch.setattr(turn_credit, "native_turn_tables", parity)
    episodes = [Episode(0, [[10], [11]], [[], [3]], [0.0, 1.0]), Episode(0, [[10], [11]], [[], [5]], [0.0, 0.0])]
    batch = build_batch(episodes)
    with pytest.raises(ValueError, match=r"hash collision: the observation before row 1, turn 1 and the one before row 0, turn 1"):
        gigpo(batch["token_level_rewards"], batch["response_mask"], batch["index"], spans=batch["spans"], responses=batch["responses"])
    # equal observations are no collision, and without validate the merge goes unnoticed (documented)
    same = build_batch([episodes[0], Episode(0, [[10], [11]], [[], [3]], [0.0, 0.0])])
    gigpo(same["token_level_rewards"], same["response_mask"], same["index"], spans=same["spans"], responses=same["responses"])
    merged = gigpo(batch["token_level_rewards"], batch["response_mask"], batch["index"], spans=batch["spans"],
                   responses=batch["responses"], validate=False)[0]
    assert merged.isfinite().all()


def test_bad_values_and_discounts(batch):
    r, m = batch["token_level_rewards"], batch["response_mask"]
    with pytest.raises(ValueError, match="values must be a"):
        turn_gae(r, batch["values"][:, :-1], m)
    with pytest.raises(ValueError, match="gamma must be"):
        turn_rloo(r, m, batch["index"], 1.5)
    with pytest.raises(ValueError, match="lam must be"):
        turn_gae(r, batch["values"], m, 1.0, -0.1)


def test_rewards_off_assistant_rejected_before_work(batch):
    r = batch["token_level_rewards"].clone()
    pos = int((batch["spans"][1] == OBSERVATION).nonzero()[0])
    r[1, pos] = 1.0
    with pytest.raises(ValueError, match=f"row 1, position {pos}"):
        turn_index_normalized(r, batch["response_mask"], batch["index"], spans=batch["spans"])


def test_many_turns_and_int64_turn_ids():
    """Rows with more turns than the compiled pass's first try (64 columns: it runs again with
    enough), given as int64 turn ids as well as the loop's int16 ones."""
    gen = torch.Generator().manual_seed(21)
    episodes = [Episode(g // 2, [[10 + k % 3] for k in range(turns)], [[]] + [[3 + k % 2] * (1 + k % 3) for k in range(turns - 1)],
                        [float(torch.randn(1, generator=gen)) for _ in range(turns)], 1.0, pad=2)
                for g, turns in enumerate((70, 66, 5, 90))]
    batch = build_batch(episodes)
    wide = dict(batch, turn_ids=batch["turn_ids"].long())
    for b in (batch, wide):
        _close(per_turn(_call("turn_rloo", b)[0], b, episodes), ref_turn_rloo(episodes, 1.0))
        _close(per_turn(_call("gigpo", b)[0], b, episodes), ref_gigpo(episodes), tol=1e-10)


@pytest.mark.parametrize("name", TURN_ESTIMATORS)
def test_the_accelerator_layout_without_host_sync(name, monkeypatch):
    """On CUDA without validation the tables have n = t columns (the turn count would need a host
    sync): the same advantages, here on the CPU's torch path with that layout forced."""
    episodes = _episodes(22)
    batch = build_batch(episodes)
    expected = _call(name, batch, validate=False)
    monkeypatch.setattr(turn_credit, "native_turn_tables", lambda *args, **kwargs: None)
    monkeypatch.setattr(turn_credit, "_sync_free", lambda x: True)
    with HostSyncs() as recorder:
        got = _call(name, batch, validate=False)
    assert recorder.seen == [], recorder.seen  # no .item(), .tolist(), bool(tensor), ... on the way
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)
