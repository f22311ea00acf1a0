"""Sessions (issue 54): an episode cut into segments is one sample with one return.

The defining property, for every registered estimator: cutting an episode into segments at any turn
boundary (with and without OBSERVATION tokens opening a later segment, as a summary or a re-rendered
header does) leaves every ASSISTANT token's advantage and return equal to the unsplit run's, to 1e-12
in float64. The unsplit run is the reference: the estimators themselves are checked against serial
references in their own tests. Also: the row-per-segment ablation is measurably different (the
issue's RLOO example, by hand), collate's session rules, and the seq-mean loss by session against a
serial reference.
"""

import random

import pytest
import torch

import advantages.turn_credit as turn_credit
import masking.sessions as masking_sessions
from advantages import ESTIMATORS, aggregate_loss, get_estimator, ppo_clip_policy_loss
from masking.batch import collate
from masking.kinds import SpanKind
from tests.helpers.host_syncs import HostSyncs

A, O = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION)
SETTINGS = {"gamma": 0.9, "lam": 0.8}  # a discount and a GAE lambda: returns carry across the cut


def _episode(rng: random.Random, n_turns: int) -> dict:
    """One episode's unpadded lists: spans, turn ids, token ids, values, per-turn rewards, turn states
    and the outcome; ``starts[k]`` is turn k's first ASSISTANT position, ``ends[k]`` one past its last."""
    spans, turns, starts, ends = [], [], [], []
    for k in range(n_turns):
        if k or rng.random() < 0.3:
            spans += [O] * rng.randint(1, 3)
            turns += [k - 1] * (len(spans) - len(turns))
        starts.append(len(spans))
        spans += [A] * rng.randint(1, 3)
        turns += [k] * (len(spans) - len(turns))
        ends.append(len(spans))
    if rng.random() < 0.5:
        spans += [O] * rng.randint(1, 2)
        turns += [n_turns - 1] * (len(spans) - len(turns))
    return {
        "spans": spans, "turns": turns, "starts": starts, "ends": ends,
        "ids": [rng.randint(3, 6) for _ in spans], "values": [rng.uniform(-1, 1) for _ in spans],
        "turn_rewards": [rng.choice([0.0, 0.0, rng.uniform(-1, 1)]) for _ in range(n_turns)],
        "states": [rng.randint(0, 2) for _ in range(n_turns)], "reward": rng.uniform(-1, 1),
    }


def _cut(rng: random.Random, ep: dict, header: bool) -> list[dict]:
    """The episode's segments: cut at up to 2 random turn boundaries (anywhere in the OBSERVATION run
    between two turns, its ends included); with ``header`` each later segment opens with 1-3 extra
    OBSERVATION tokens. Each segment knows the unsplit column of each of its tokens (-1: header)."""
    n = len(ep["starts"])
    cut_turns = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 2))))
    cuts = [rng.randint(ep["ends"][k - 1], ep["starts"][k]) for k in cut_turns]
    bounds, turn_bounds = [0, *cuts, len(ep["spans"])], [0, *cut_turns, n]
    segments = []
    for i in range(len(bounds) - 1):
        a, b, first_turn = bounds[i], bounds[i + 1], turn_bounds[i]
        h = rng.randint(1, 3) if header and i else 0
        segments.append({
            "spans": [O] * h + ep["spans"][a:b],
            "turns": [-1] * h + [turn - first_turn for turn in ep["turns"][a:b]],
            "ids": [rng.randint(3, 6) for _ in range(h)] + ep["ids"][a:b],
            "values": [rng.uniform(-1, 1) for _ in range(h)] + ep["values"][a:b],
            "turn_rewards": ep["turn_rewards"][first_turn:turn_bounds[i + 1]],
            "states": ep["states"][first_turn:turn_bounds[i + 1]],
            "reward": ep["reward"], "columns": [-1] * h + list(range(a, b)),
        })
    return segments


def _batch(rows: list[dict], index: list[int], sessions=None, segments=None):
    """Collate rows (episodes or segments) in float64 and add values and turn states."""
    batch = collate(
        [[1, 2]] * len(rows), [r["ids"] for r in rows], [r["spans"] for r in rows], [r["turns"] for r in rows],
        [[0.0] * len(r["spans"]) for r in rows], [r["reward"] for r in rows], [r["turn_rewards"] for r in rows],
        dtype=torch.float64, sessions=sessions, segments=segments, index=index,
    )
    batch.values = torch.nn.utils.rnn.pad_sequence([torch.tensor(r["values"], dtype=torch.float64) for r in rows],
                                                   batch_first=True)
    width = max(len(r["states"]) for r in rows)
    batch.turn_states = torch.tensor([r["states"] + [-1] * (width - len(r["states"])) for r in rows])
    return batch


def _call(name: str, batch, session=None, segment=None, drop=(), **settings):
    entry = get_estimator(name)
    fields = {k: batch[k] for k in entry.batch_arguments
              if k in batch and k not in ("token_level_rewards", "response_mask", *drop)}
    settings = {k: v for k, v in {**SETTINGS, **settings}.items() if k in entry.hyperparameters or k == "validate"}
    return entry(batch.token_level_rewards, batch.response_mask, **fields, **settings, session=session, segment=segment)


def _split_and_whole(seed: int, header: bool):
    rng = random.Random(seed)
    episodes, index = [], []
    for group in range(3):
        for _ in range(rng.randint(2, 4)):
            episodes.append(_episode(rng, rng.randint(1, 5)))
            index.append(group)
    rows, sessions, segments, seg_index = [], [], [], []
    for e, ep in enumerate(episodes):
        for k, seg in enumerate(_cut(rng, ep, header)):
            rows.append(seg)
            sessions.append(f"episode-{e}")
            segments.append(k)
            seg_index.append(index[e])
    order = list(range(len(rows)))
    rng.shuffle(order)  # the segments of a session need not be adjacent nor in order
    rows = [rows[i] for i in order]
    split = _batch(rows, [seg_index[i] for i in order], [sessions[i] for i in order], [segments[i] for i in order])
    whole = _batch(episodes, index)
    # (row, column) in the split batch -> (episode, column) in the whole batch, on the ASSISTANT tokens
    rows_, cols_, eps_, whole_cols = [], [], [], []
    for row, seg in enumerate(rows):
        episode = int(sessions[order[row]].split("-")[1])
        for col, (kind, unsplit) in enumerate(zip(seg["spans"], seg["columns"])):
            if kind == A:
                rows_.append(row), cols_.append(col), eps_.append(episode), whole_cols.append(unsplit)
    where = (torch.tensor(rows_), torch.tensor(cols_)), (torch.tensor(eps_), torch.tensor(whole_cols))
    return split, whole, where


CASES = [(name, header) for name in sorted(ESTIMATORS) for header in (False, True)]


@pytest.mark.parametrize("name,header", CASES)
@pytest.mark.parametrize("seed", range(4))
def test_segmentation_invariance(name, header, seed):
    split, whole, (split_at, whole_at) = _split_and_whole(seed, header)
    assert split.batch_size > whole.batch_size  # some episodes were cut
    settings = {}
    if name == "reinforce_plus_plus_ignore_mask" and header:
        settings["gamma"] = 1.0  # the ablation costs a discount step per OBSERVATION token: a header changes it
    want = _call(name, whole, **settings)
    got = _call(name, split, session=split.session, segment=split.segment, **settings)
    for w, g in zip(want, got):
        torch.testing.assert_close(g[split_at], w[whole_at], rtol=0, atol=1e-12)
        assert torch.all(g[split.spans == SpanKind.PAD] == 0)
    assert want[0][whole_at].abs().sum() > 0  # nothing trivially zero


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("name", ["turn_rloo", "gigpo", "turn_gae"])
def test_segmentation_invariance_on_both_turn_paths(name, path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(turn_credit, "native_turn_tables", lambda *args, **kwargs: None)
    split, whole, (split_at, whole_at) = _split_and_whole(7, True)
    for validate in (True, False):
        want = _call(name, whole, validate=validate)
        got = _call(name, split, session=split.session, segment=split.segment, validate=validate)
        for w, g in zip(want, got):
            torch.testing.assert_close(g[split_at], w[whole_at], rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_gigpo_observation_anchors_are_invariant_without_a_header(seed):
    """GiGPO keyed by the observations' token ids (no turn_states): the joined observation before a
    later segment's first turn is the unsplit one when no header opens the segment."""
    split, whole, (split_at, whole_at) = _split_and_whole(seed, False)
    want = _call("gigpo", whole, drop=("turn_states",))
    got = _call("gigpo", split, session=split.session, segment=split.segment, drop=("turn_states",))
    for w, g in zip(want, got):
        torch.testing.assert_close(g[split_at], w[whole_at], rtol=0, atol=1e-12)


def _issue_example(sessions: bool):
    """The issue's group of G=2: a 2-segment session with R=0.884 and a plain session with R=0.191."""
    rows = {"ids": [[5, 6, 4], [7, 8, 9], [3, 4]], "spans": [[A, A, O], [O, A, A], [A, A]],
            "turns": [[0, 0, 0], [-1, 0, 0], [0, 0]], "rewards": [0.884, 0.884, 0.191]}
    return collate([[1]] * 3, rows["ids"], rows["spans"], rows["turns"], [[0.0] * len(s) for s in rows["spans"]],
                   rows["rewards"], dtype=torch.float64, index=[0, 0, 0],
                   sessions=["a", "a", "b"] if sessions else None, segments=[0, 1, 0] if sessions else None)


def test_rloo_counts_a_session_once_and_the_row_per_segment_ablation_does_not():
    aware = _issue_example(True)
    adv, _ = _call("rloo", aware, session=aware.session, segment=aware.segment)
    assert adv[aware.response_mask.bool()].tolist() == pytest.approx([0.693] * 4 + [-0.693] * 2, abs=1e-12)
    ablation = _issue_example(False)  # today's: every segment its own episode, carrying the session's reward
    adv, _ = _call("rloo", ablation)
    # a segment's baseline holds its own session's other segment: 0.884 - (0.884 + 0.191) / 2 (G=3 rows)
    assert adv[ablation.response_mask.bool()].tolist() == pytest.approx([0.3465] * 4 + [-0.693] * 2, abs=1e-12)


def test_grpo_takes_the_group_statistics_over_sessions():
    aware = _issue_example(True)
    adv, _ = _call("grpo", aware, session=aware.session, segment=aware.segment)
    scores = torch.tensor([0.884, 0.191], dtype=torch.float64)  # per session: mean and Bessel std over 2
    want = (scores - scores.mean()) / (scores.std() + 1e-6)
    assert adv[aware.response_mask.bool()].tolist() == pytest.approx([float(want[0])] * 4 + [float(want[1])] * 2, abs=1e-12)
    ablation = _issue_example(False)
    adv, _ = _call("grpo", ablation)
    assert adv[0, 0] != pytest.approx(float(want[0]), abs=1e-3)


def test_the_outcome_sits_on_the_last_segment_only_and_per_turn_rewards_on_their_turns():
    batch = collate([[1]] * 3, [[5, 6], [7, 8, 9], [3]], [[A, O], [O, A, A], [A]], [[0, 0], [-1, 0, 0], [0]],
                    [[0.0] * 2, [0.0] * 3, [0.0]], [2.0, 2.0, 1.0], [[0.5], [0.25], None], dtype=torch.float64,
                    sessions=[7, 7, 3], segments=[0, 1, 0])
    assert batch.token_level_rewards.tolist() == [[0.5, 0, 0], [0, 0, 2.25], [1.0, 0, 0]]
    assert batch.session.tolist() == [0, 0, 1] and batch.segment.tolist() == [0, 1, 0]


def test_without_sessions_every_row_is_its_own_session():
    """``session=None`` is the plain call (bit-exact); one session per row gives the same to 1e-12 (the
    joined batch is trimmed to the longest row, so whitening sums in another order)."""
    split, _, _ = _split_and_whole(3, True)
    rows = torch.arange(split.batch_size)
    for name in sorted(ESTIMATORS):
        entry = get_estimator(name)
        want = _call(name, split)  # on a batch of segments: the row-per-segment ablation
        fields = {k: split[k] for k in entry.batch_arguments if k in split}
        plain = entry.fn(**fields, **{k: v for k, v in SETTINGS.items() if k in entry.hyperparameters})
        got = _call(name, split, session=rows, segment=torch.zeros_like(rows))
        for w, p, g in zip(want, plain, got):
            assert torch.equal(w, p), name
            torch.testing.assert_close(torch.where(split.spans == SpanKind.PAD, 0.0, w), g, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- bad input


def _collate(**kwargs):
    spans = [[A], [O, A], [A], [A, A]]
    return collate([[1]] * 4, [[5]] * 1 + [[5, 6]] + [[5]] + [[5, 6]], spans, [[0], [-1, 0], [0], [0, 0]],
                   [[0.0] * len(s) for s in spans], kwargs.pop("rewards", [1.0, 1.0, 0.0, 0.5]), **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"sessions": [0, 0, 1, 2], "segments": [0, 0, 0, 0]}, r"session of rows \[0, 1\]: rows 0 and 1 are both segment 0"),
    ({"sessions": [0, 0, 1, 2], "segments": [0, 2, 0, 0]}, r"session of rows \[0, 1\]: segments \[0, 2\], expected 0..1"),
    ({"sessions": [0, 0, 1, 2], "segments": [1, 2, 0, 0]}, r"segments \[1, 2\], expected 0..1"),
    ({"sessions": [0, 0, 1, 2], "segments": [0, -1, 0, 0]}, r"row 1 has segment number -1"),
    ({"sessions": [0, 0, 0, 2], "segments": [0, 1, 2, 0]}, r"rows 0 and 2 are segments of one session but differ in outcome "
                                                           r"reward: 1.0 vs 0.0"),
    ({"sessions": [0, 0, 1, 2], "segments": [0, 1, 0, 0], "index": ["g", "h", "g", "h"]},
     r"rows 0 and 1 are segments of one session but differ in index"),
    ({"sessions": [0, 0, 1, 2], "segments": [0, 1, 0, 0], "tasks": ["t1", "t2", "t1", "t3"]},
     r"rows 0 and 1 are segments of one session but differ in tasks"),
    ({"sessions": [0, 0, 1, 2]}, r"sessions and segments come together"),
    ({"sessions": [0, 0, 1], "segments": [0, 1, 0]}, r"sessions has 3 rows, rewards has 4"),
    ({"sessions": [0, 0.5, 1, 2], "segments": [0, 1, 0, 0]}, r"sessions\[1\] is 0.5; session ids are ints or strings"),
])
def test_collate_rejects_broken_sessions(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _collate(**kwargs)


def test_collate_accepts_good_sessions():
    batch = _collate(sessions=["x", "x", "y", "z"], segments=[1, 0, 0, 0], index=["g", "g", "g", "h"], tasks=[4, 4, 5, 6])
    assert batch.session.tolist() == [0, 0, 1, 2] and batch.segment.tolist() == [1, 0, 0, 0]
    assert batch.index.tolist() == [0, 0, 0, 1]
    assert batch.token_level_rewards[0].tolist() == [1.0, 0.0] and batch.token_level_rewards[1].tolist() == [0.0, 0.0]


def test_estimator_rejects_broken_sessions():
    aware = _issue_example(True)
    rloo = get_estimator("rloo")
    args = (aware.token_level_rewards, aware.response_mask)
    with pytest.raises(ValueError, match=r"index: rows 0 and 1 are segments of one session but in groups 0 and 1"):
        rloo(*args, index=torch.tensor([0, 1, 1]), spans=aware.spans, session=aware.session, segment=aware.segment)
    with pytest.raises(ValueError, match=r"rows 0 and 1 are both segment 0"):
        rloo(*args, index=aware.index, spans=aware.spans, session=aware.session, segment=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"needs spans=\(b, t\)"):
        rloo(*args, index=aware.index, session=aware.session, segment=aware.segment)
    with pytest.raises(ValueError, match=r"session and segment come together"):
        rloo(*args, index=aware.index, spans=aware.spans, session=aware.session)
    with pytest.raises(ValueError, match=r"session must hold one integer session id per row, shape \(3,\)"):
        rloo(*args, index=aware.index, spans=aware.spans, session=torch.zeros(2), segment=aware.segment)
    gigpo = get_estimator("gigpo")
    with pytest.raises(ValueError, match=r"turn_states: row 2, turn 1: the row has 1 turns"):
        gigpo(*args, index=aware.index, spans=aware.spans, turn_states=torch.tensor([[0, -1], [1, -1], [0, 2]]),
              session=aware.session, segment=aware.segment)


def test_gigpo_turn_states_as_lists_of_keys():
    split, _, _ = _split_and_whole(2, True)
    lists = [[f"s{int(x)}" for x in row if x >= 0] for row in split.turn_states]
    want = _call("gigpo", split, session=split.session, segment=split.segment)
    split.turn_states = lists
    got = _call("gigpo", split, session=split.session, segment=split.segment)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ----------------------------------------------------------------------------- seq-mean loss by session


def _serial_seq_mean(loss, mask, session, mode):
    """Serial reference: one sequence per session, its segments' tokens together."""
    per_session: dict = {}
    for row in range(loss.shape[0]):
        total, count = per_session.get(int(session[row]), (0.0, 0))
        for col in range(loss.shape[1]):
            if mask[row, col]:
                total, count = total + float(loss[row, col]), count + 1
        per_session[int(session[row])] = (total, count)
    kept = [(total, count) for total, count in per_session.values() if count]
    values = [total / count if mode == "seq-mean-token-mean" else total for total, count in kept]
    result = sum(values) / len(kept)
    return result / loss.shape[1] if mode == "seq-mean-token-sum-norm" else result


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_seq_mean_loss_treats_a_session_as_one_sequence(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(7, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(7, 6, generator=g) < 0.6
    mask[4] = False  # a session of one row without tokens is not counted
    session = torch.tensor([3, 0, 3, 5, 9, 0, 3])
    got = aggregate_loss(loss, mask, mode, session=session)
    assert float(got) == pytest.approx(_serial_seq_mean(loss, mask, session, mode), abs=1e-12)
    rows = aggregate_loss(loss, mask, mode)
    assert float(rows) != pytest.approx(float(got), abs=1e-6)  # by row, a 3-segment session weighs 3 times
    assert float(aggregate_loss(loss, mask, mode, session=torch.arange(7))) == pytest.approx(float(rows), abs=1e-12)
    with pytest.raises(ValueError, match=r"session must hold one session id per row, shape \(7,\)"):
        aggregate_loss(loss, mask, mode, session=session[:3])


@pytest.mark.parametrize("name", ["gae", "grpo", "turn_rloo", "gigpo", "reinforce_plus_plus"])
def test_the_torch_join_without_a_compiler(name, monkeypatch):
    """The scatter/gather join (CUDA, no C compiler) gives what the compiled copies give."""
    split, whole, (split_at, whole_at) = _split_and_whole(5, True)
    want = _call(name, whole)
    native = _call(name, split, session=split.session, segment=split.segment)
    monkeypatch.setattr(masking_sessions, "_compiled", lambda: None)
    got = _call(name, split, session=split.session, segment=split.segment)
    for w, n, g in zip(want, native, got):
        torch.testing.assert_close(g[split_at], w[whole_at], rtol=0, atol=1e-12)
        torch.testing.assert_close(g, n, rtol=0, atol=1e-12)


def test_a_policy_loss_aggregates_by_session_through_global_batch_info():
    """The trainer's PPO loss reaches the session-aware seq-mean through ``global_batch_info``."""
    g = torch.Generator().manual_seed(1)
    old, new, adv = (torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[:, 3] = False
    session = torch.tensor([0, 0, 1, 2, 2])
    loss, _ = ppo_clip_policy_loss(old, new, adv, mask, "seq-mean-token-mean", global_batch_info={"session": session})
    per_token, _ = ppo_clip_policy_loss(old, new, adv, mask, "token-sum")  # the per-token losses, summed
    ratio = (new - old).exp()
    token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    token = torch.where(adv < 0, torch.minimum(token, -adv * 3.0), token)
    assert float(per_token) == pytest.approx(float(token[mask].sum()), abs=1e-12)
    assert float(loss) == pytest.approx(_serial_seq_mean(token, mask, session, "seq-mean-token-mean"), abs=1e-12)


@pytest.mark.parametrize("name", ["grpo", "rloo", "turn_rloo", "gigpo", "turn_gae", "turn_returns"])
def test_the_accelerator_path_reads_only_the_session_ids_on_the_host(name, monkeypatch):
    """On an accelerator without validation, the only host read is of the (b,) session and segment ids
    (free where they are CPU tensors): the rest of the join, the estimate and the split record no host sync.
    Here on the CPU's torch paths with the accelerator's layout forced (widths from shapes, not values)."""
    split, whole, (split_at, whole_at) = _split_and_whole(6, True)
    want = _call(name, whole, validate=False)
    layout = masking_sessions.host_layout(split.session, split.segment, split.batch_size, False)
    monkeypatch.setattr(masking_sessions, "host_layout", lambda *args: layout)
    monkeypatch.setattr(masking_sessions, "_compiled", lambda: None)
    monkeypatch.setattr(masking_sessions, "_sync_free", lambda x: True)
    monkeypatch.setattr(turn_credit, "native_turn_tables", lambda *args, **kwargs: None)
    monkeypatch.setattr(turn_credit, "_sync_free", lambda x: True)
    with HostSyncs() as recorder:
        got = _call(name, split, session=split.session, segment=split.segment, validate=False)
    assert recorder.seen == [], recorder.seen
    for w, g in zip(want, got):
        torch.testing.assert_close(g[split_at], w[whole_at], rtol=0, atol=1e-12)
