"""masking: spans, reward placement, collation round trip, validation errors."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masking import (
    SpanKind,
    collate,
    collate_rewards,
    last_assistant_index,
    last_assistant_index_per_turn,
    native,
    native_checks,
    place_rewards,
    response_mask_from_spans,
    spans_from_response_mask,
    uncollate,
    validate_response_mask,
    validate_spans,
    validate_token_level_rewards,
)
from masking.native_checks import native_check
from masking.validate import validate_batch, validate_mask_matches_spans
from tests.helpers.trajectories import collate_rows, random_trajectory

A, O, P = SpanKind.ASSISTANT, SpanKind.OBSERVATION, SpanKind.PAD


def test_mask_is_derived_from_spans():
    spans = torch.tensor([[A, A, O, O, A, P, P]], dtype=torch.int8)
    assert response_mask_from_spans(spans).tolist() == [[1, 1, 0, 0, 1, 0, 0]]
    assert spans_from_response_mask(torch.tensor([[1, 0, 0, 1]])).tolist() == [[A, O, O, A]]


def test_last_assistant_indices():
    spans = torch.tensor([[A, A, O, A, O, P], [O, O, P, P, P, P], [A, A, A, A, A, A]], dtype=torch.int8)
    turns = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, -1, -1, -1, -1], [0, 0, 1, 1, 2, 2]])
    assert last_assistant_index(spans).tolist() == [3, -1, 5]
    assert last_assistant_index_per_turn(spans, turns, 3).tolist() == [[1, 3, -1], [-1, -1, -1], [1, 3, 5]]


def test_batch_without_any_response_token():
    batch = collate([[1], [2, 3]], [[], []], [[], []], [[], []], [[], []], [0.0, 0.0])
    assert batch["responses"].shape == (2, 0) and last_assistant_index(batch["spans"]).tolist() == [-1, -1]
    with pytest.raises(ValueError, match="row 0"):
        collate([[1]], [[]], [[]], [[]], [[]], [1.0])


def test_place_rewards_outcome_and_turns():
    spans = torch.tensor([[A, A, O, A, P]], dtype=torch.int8)
    turns = torch.tensor([[0, 0, 0, 1, -1]])
    rewards = place_rewards(spans, torch.tensor([2.0]), turns, torch.tensor([[0.5, 0.25]]))
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 2.25, 0.0]]


def test_place_rewards_refuses_to_lose_a_reward():
    spans = torch.tensor([[A, A], [O, P]], dtype=torch.int8)
    with pytest.raises(ValueError, match="row 1"):
        place_rewards(spans, torch.tensor([1.0, 3.0]))


def test_collate_layout_and_round_trip():
    rng = random.Random(0)
    rows = [random_trajectory(rng) for _ in range(12)]
    batch = collate_rows(rows, turn_rewards=[r["turn_rewards"] for r in rows], pad_token_id=0)
    b, t = batch["responses"].shape
    assert t == max(len(r["response_ids"]) for r in rows)
    assert batch["spans"].dtype == torch.int8 and batch["turn_ids"].dtype == torch.int16
    assert torch.equal(batch["response_mask"], (batch["spans"] == A).float())
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], 1))
    for row, r in enumerate(rows):
        n = len(r["response_ids"])
        assert batch["spans"][row, n:].eq(P).all() and batch["turn_ids"][row, n:].eq(-1).all()
        assert batch["responses"][row, n:].eq(0).all() and batch["old_logprobs"][row, n:].eq(0).all()
        # prompts are left-padded: the real prompt ends at the last prompt column
        p = len(r["prompt_ids"])
        assert batch["prompts"][row, -p:].tolist() == r["prompt_ids"]
        assert batch["attention_mask"][row].sum() == p + n
        # the outcome reward plus the last turn's reward sit on the last ASSISTANT token
        last = max(i for i, s in enumerate(r["spans"]) if s == A)
        expected = r["reward"] + r["turn_rewards"][-1]
        assert batch["token_level_rewards"][row, last].item() == pytest.approx(expected)
        # every turn's reward lands on that turn's last assistant token, nothing anywhere else
        assert batch["token_level_rewards"][row].sum().item() == pytest.approx(r["reward"] + sum(r["turn_rewards"]))
        # position ids count only real tokens
        real = batch["attention_mask"][row].bool()
        assert batch["position_ids"][row][real].tolist() == list(range(p + n))
    for row, back in enumerate(uncollate(batch)):
        for key in ("prompt_ids", "response_ids", "spans", "turn_ids"):
            assert back[key] == rows[row][key]
        assert back["logprobs"] == pytest.approx(rows[row]["logprobs"])


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=6))
def test_collate_round_trip_property(seed, b):
    rng = random.Random(seed)
    rows = [random_trajectory(rng) for _ in range(b)]
    back = uncollate(collate_rows(rows))
    assert [x["response_ids"] for x in back] == [r["response_ids"] for r in rows]
    assert [x["spans"] for x in back] == [r["spans"] for r in rows]
    assert [x["prompt_ids"] for x in back] == [r["prompt_ids"] for r in rows]


def test_collate_rejects_mismatched_lengths():
    rows = [random_trajectory(random.Random(1))]
    rows[0]["turn_ids"] = rows[0]["turn_ids"][:-1]
    with pytest.raises(ValueError, match="row 0: turn_ids"):
        collate_rows(rows)


def test_collate_rejects_pad_inside_response():
    rows = [random_trajectory(random.Random(2))]
    rows[0]["spans"][0] = int(P)
    with pytest.raises(ValueError, match="row 0: position 0 is PAD"):
        collate_rows(rows)


def collate_rewards_rows(rows, turn_rewards=None, dtype=torch.float32):
    return collate_rewards(
        [r["spans"] for r in rows], [r["turn_ids"] for r in rows], [r["reward"] for r in rows], turn_rewards, dtype=dtype
    )


def test_collate_rewards_equals_the_fields_of_collate():
    """collate_rewards is collate's padding and reward placement, value for value and dtype for dtype:
    rows of different lengths, empty rows (in the middle and at the end, and batches of empty rows
    only), per-turn rewards on some rows only, float32 and float64."""
    rng = random.Random(3)
    rows = [random_trajectory(rng) for _ in range(6)]
    empty = {"prompt_ids": [7], "response_ids": [], "spans": [], "turn_ids": [], "logprobs": [], "reward": 0.0,
             "turn_rewards": None}
    rows.insert(2, empty)
    rows.append(dict(empty))
    rows[1]["turn_rewards"] = None
    assert len({len(r["spans"]) for r in rows}) > 3
    per_turn = [r["turn_rewards"] for r in rows]
    for rows_, turn_rewards in ((rows, None), (rows, per_turn), ([empty, empty], None), ([empty], [[]])):
        for dtype in (torch.float32, torch.float64):
            batch = collate_rows(rows_, turn_rewards=turn_rewards, dtype=dtype)
            spans, turn_ids, rewards = collate_rewards_rows(rows_, turn_rewards, dtype)
            for name, tensor in (("spans", spans), ("turn_ids", turn_ids), ("token_level_rewards", rewards)):
                assert tensor.dtype == batch[name].dtype and torch.equal(tensor, batch[name]), name
            assert (spans.dtype, turn_ids.dtype, rewards.dtype) == (torch.int8, torch.int16, dtype)
            assert spans.shape == (len(rows_), max(len(r["spans"]) for r in rows_))
    outcome_only = collate_rewards_rows(rows)[2]
    spans, turn_ids, with_turns = collate_rewards_rows(rows, per_turn)
    assert spans[2].eq(P).all() and turn_ids[2].eq(-1).all() and with_turns[2].eq(0).all()  # the empty row: padding
    assert not torch.equal(with_turns, outcome_only)  # the per-turn rewards landed
    assert torch.equal(with_turns[1], outcome_only[1])  # a row without them: its outcome reward only


def test_collate_rewards_rejects_what_collate_rejects():
    spans, turns = [[A, A], [O, A]], [[0, 0], [0, 0]]
    for args, message in (
        ((spans, turns[:1], [0.0, 0.0]), "turn_ids has 1 rows, spans has 2"),
        ((spans, turns, [0.0]), "rewards has 1 rows, spans has 2"),
        ((spans, [[0, 0], [0]], [0.0, 0.0]), "row 1: turn_ids has 1 entries, spans has 2"),
        (([[A, A], [P, A]], turns, [0.0, 0.0]), "row 1: position 0 is PAD inside an unpadded response"),
        (([[A, 7]], [[0, 0]], [0.0]), "spans: unknown span value 7 at row 0, position 1"),
        (([[A, A], []], [[0, 0], []], [0.0, 1.0]), "row 1: a nonzero reward has no ASSISTANT token"),
        ((spans, turns, [0.0, 0.0], [[0.5, 1.0], None]), "row 0: a nonzero reward has no ASSISTANT token"),
    ):
        with pytest.raises(ValueError, match=message):
            collate_rewards(*args)


@pytest.mark.parametrize(
    "spans, message",
    [
        ([[A, A, A], [A, P, A]], "PAD at row 1, position 1"),
        ([[A, 7, A]], "unknown span value 7 at row 0, position 1"),
        ([[A, -1]], "unknown span value -1 at row 0, position 1"),
    ],
)
def test_validate_spans_names_row_and_position(spans, message):
    with pytest.raises(ValueError, match=message):
        validate_spans(torch.tensor(spans, dtype=torch.int8))


def test_validate_spans_rejects_shape_and_dtype():
    with pytest.raises(ValueError, match="must be \\(b, t\\)"):
        validate_spans(torch.tensor([1, 1], dtype=torch.int8))
    with pytest.raises(ValueError, match="integer dtype"):
        validate_spans(torch.tensor([[1.0, 1.0]]))


def test_validate_response_mask():
    validate_response_mask(torch.tensor([[1.0, 0.0]]))
    with pytest.raises(ValueError, match="value 0.5 at row 0, position 1"):
        validate_response_mask(torch.tensor([[1.0, 0.5]]))


@pytest.mark.parametrize(
    "rewards, message",
    [
        ([[0.0, 1.0, 0.0]], "reward 1.0 at row 0, position 1 sits on an OBSERVATION token"),
        ([[0.0, 0.0, 1.0]], "reward 1.0 at row 0, position 2 sits on a PAD token"),
        ([[float("nan"), 0.0, 0.0]], "non-finite value nan at row 0, position 0"),
        ([[float("inf"), 0.0, 0.0]], "non-finite value inf at row 0, position 0"),
    ],
)
def test_validate_rewards(rewards, message):
    spans = torch.tensor([[A, O, P]], dtype=torch.int8)
    with pytest.raises(ValueError, match=message):
        validate_token_level_rewards(torch.tensor(rewards), spans)


def test_validate_rewards_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        validate_token_level_rewards(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.int8))


# --- the fused validation (masking.validate.validate_batch) against the single checks ---------------


def validate_one_by_one(rewards, mask, spans):
    """The single checks in their order (the reference for validate_batch's outcome and message)."""
    validate_response_mask(mask)
    if spans is None:
        spans = spans_from_response_mask(mask)
    else:
        validate_spans(spans)
        validate_mask_matches_spans(mask, spans)
    validate_token_level_rewards(rewards, spans)


def outcome(check, *args):
    try:
        check(*args)
    except ValueError as error:
        return str(error)
    return None


FAULTS = (
    "none", "mask_half", "mask_two", "mask_tiny", "mask_nan", "mask_negative_zero", "mask_disagrees",
    "span_unknown", "span_negative", "span_big", "pad_inside", "reward_nan", "reward_inf", "reward_off",
    "reward_tiny_off", "reward_negative_zero_off",
)


def faulty_batch(rng: random.Random, faults, spans_dtype, mask_dtype, rewards_dtype, t: int | None = None):
    """A random batch (1-4 rows of 1-9 tokens, or of ``t``) with ``faults`` at random places."""
    b, t = rng.randint(1, 4), t or rng.randint(1, 9)
    rows = []
    for _ in range(b):
        length, kind, row = rng.randint(0, t), A, []
        while len(row) < length:
            row += [kind] * rng.randint(1, 3)
            kind = O if kind == A else A
        rows.append(row[:length] + [P] * (t - length))
    spans = torch.tensor(rows, dtype=torch.int64).reshape(b, t)
    mask = (spans == A).double()
    rewards = torch.randn(b, t, dtype=torch.float64) * mask
    for fault in faults:
        row, pos = rng.randrange(b), rng.randrange(t)
        if fault == "mask_half":
            mask[row, pos] = 0.5
        elif fault == "mask_two":
            mask[row, pos] = 2.0
        elif fault == "mask_tiny":
            mask[row, pos] += 1e-30 if mask[row, pos] == 0 else 1e-6
        elif fault == "mask_nan":
            mask[row, pos] = float("nan")
        elif fault == "mask_negative_zero" and mask[row, pos] == 0:
            mask[row, pos] = -0.0
        elif fault == "mask_disagrees":
            mask[row, pos] = 1.0 - mask[row, pos]
        elif fault == "span_unknown":
            spans[row, pos] = 3
        elif fault == "span_negative":
            spans[row, pos] = -1
        elif fault == "span_big" and spans_dtype == torch.int64:
            spans[row, pos] = rng.choice((257, -(2**63)))  # 1 modulo 256, or a minimum that a negation would keep
        elif fault == "pad_inside":
            spans[row, pos] = P
        elif fault == "reward_nan":
            rewards[row, pos] = float("nan")
        elif fault == "reward_inf":
            rewards[row, pos] = float("-inf")
        elif fault == "reward_off" and mask[row, pos] == 0:
            rewards[row, pos] = 1.0
        elif fault == "reward_tiny_off" and mask[row, pos] == 0:
            rewards[row, pos] = 1e-38
        elif fault == "reward_negative_zero_off" and mask[row, pos] == 0:
            rewards[row, pos] = -0.0
    if mask_dtype == torch.bool:
        mask = mask != 0
    return rewards.to(rewards_dtype), mask.to(mask_dtype), spans.to(spans_dtype)


@pytest.mark.parametrize("with_spans", [True, False])
@pytest.mark.parametrize(
    "spans_dtype, mask_dtype, rewards_dtype",
    [
        (torch.int8, torch.float32, torch.float32),
        (torch.int64, torch.float64, torch.float64),
        (torch.uint8, torch.bool, torch.bfloat16),
        (torch.int32, torch.float32, torch.float16),
        (torch.int8, torch.int64, torch.float64),
        (torch.uint8, torch.bool, torch.float32),
        (torch.int8, torch.int32, torch.float32),
        (torch.uint8, torch.int8, torch.float64),
    ],
)
@pytest.mark.parametrize("path, block", [("compiled", None), ("torch", None), ("torch", 9)])
def test_fused_validation_raises_exactly_what_the_single_checks_raise(
    with_spans, spans_dtype, mask_dtype, rewards_dtype, path, block, monkeypatch
):
    """validate_batch, on its compiled path (masking/native_checks.c) or its torch path (in blocks
    of one row or two short ones, or not), against the single checks on random faulty batches."""
    took = []
    if path == "torch":
        monkeypatch.setattr("masking.validate.native_check", lambda *tensors: None)
    else:
        monkeypatch.setattr("masking.validate.native_check", lambda *tensors: took.append(native_check(*tensors)) or took[-1])
    if block:
        monkeypatch.setattr("masking.validate.CPU_BLOCK_ELEMENTS", block)
    rng = random.Random(f"{with_spans}{spans_dtype}{mask_dtype}{rewards_dtype}{path}{block}")
    raised = set()
    for case in range(400):
        faults = rng.sample(FAULTS, rng.choice((1, 1, 2)))
        rewards, mask, spans = faulty_batch(rng, faults, spans_dtype, mask_dtype, rewards_dtype)
        if spans_dtype == torch.uint8:
            spans = spans.to(torch.int64).clamp(min=0).to(torch.uint8)
        spans = spans if with_spans else None
        want = outcome(validate_one_by_one, rewards, mask, spans)
        got = outcome(validate_batch, rewards, mask, spans)
        assert got == want, (case, faults, rewards, mask, spans)
        if want is None:
            assert validate_batch(rewards, mask, spans, count=True) == int((mask != 0).sum())
        raised.add(want is not None)
    assert raised == {True, False}  # both outcomes were exercised
    if path == "compiled":  # the compiled loop took exactly the dtypes it has a function for
        compiled = rewards_dtype in (torch.float32, torch.float64) and (not with_spans or spans_dtype in (torch.int8, torch.uint8))
        assert took and all((result is not None) == compiled for result in took)


@pytest.mark.parametrize(
    "spans_dtype, mask_dtype, rewards_dtype, with_spans",
    [
        (torch.int8, torch.float32, torch.float32, True),
        (torch.int8, torch.float32, torch.float32, False),
        (torch.uint8, torch.bool, torch.float32, True),
        (torch.int8, torch.int64, torch.float64, True),
    ],
)
def test_compiled_checks_find_a_fault_anywhere_in_long_rows(spans_dtype, mask_dtype, rewards_dtype, with_spans):
    """Rows long enough for the compiled loop's vector body (16-64 tokens a step), not only its
    scalar tail: one fault at a random place gives the single checks' outcome and message."""
    rng = random.Random(f"{spans_dtype}{mask_dtype}{rewards_dtype}{with_spans}")
    took = []
    for case in range(150):
        faults = [rng.choice(FAULTS)]
        rewards, mask, spans = faulty_batch(rng, faults, spans_dtype, mask_dtype, rewards_dtype,
                                            t=rng.choice((16, 17, 63, 64, 65, 129, 1000)))
        if spans_dtype == torch.uint8:
            spans = spans.to(torch.int64).clamp(min=0).to(torch.uint8)
        spans = spans if with_spans else None
        took.append(native_check(rewards, mask, spans))
        want = outcome(validate_one_by_one, rewards, mask, spans)
        assert outcome(validate_batch, rewards, mask, spans) == want, (case, faults)
        assert took[-1] is not None and took[-1][0] == (want is None), (case, faults)
    assert sum(ok for ok, _ in took) not in (0, len(took))  # both outcomes


def test_fused_validation_of_empty_and_single_token_batches():
    assert validate_batch(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.int8), count=True) == 0
    assert validate_batch(torch.zeros(3, 0), torch.zeros(3, 0), count=True) == 0
    assert validate_batch(torch.ones(2, 1), torch.ones(2, 1), torch.ones(2, 1, dtype=torch.int8), count=True) == 2
    with pytest.raises(ValueError, match="integer dtype"):
        validate_batch(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))


def test_compiled_checks_leave_what_they_cannot_take_to_torch(monkeypatch):
    spans = torch.tensor([[A, O, A, P], [A, A, P, P]], dtype=torch.int8)
    mask = (spans == A).float()
    rewards = mask * torch.tensor([[0.5], [-1.0]])
    assert native_check(rewards, mask, spans) == (True, 4)
    assert native_check(rewards.t(), mask.t(), spans.t()) is None  # not contiguous
    assert native_check(rewards.half(), mask, spans) is None  # no function for half-precision rewards
    assert native_check(rewards, mask, spans.long()) is None  # spans must be SPAN_DTYPE bytes
    big = torch.zeros(3, 2**20)  # above 2^21 elements
    threads = torch.get_num_threads()
    try:  # a big batch with enough torch threads: torch's parallel ops
        torch.set_num_threads(native_checks.THREADS_TO_MATCH)
        assert native_check(big, big, None) is None and native_check(rewards, mask, spans) == (True, 4)
        torch.set_num_threads(native_checks.THREADS_TO_MATCH - 1)
        assert native_check(big, big, None) == (True, 0)
    finally:
        torch.set_num_threads(threads)
    rewards[0, 1] = 2.0  # on an OBSERVATION: the same message from either path
    with pytest.raises(ValueError, match="row 0, position 1 sits on an OBSERVATION token"):
        validate_batch(rewards.t().contiguous().t(), mask, spans)


def test_c_loops_compile_once_into_the_cache_and_fall_back_without_a_compiler(tmp_path, monkeypatch):
    """Two processes compiling at once into an empty cache both load a whole library (one file,
    no scratch left); a failing compiler gives a warning, leaves nothing, and the torch paths give
    the same results; AGENT_LOOP_NATIVE=0 turns the loops off."""
    import subprocess
    import sys

    from advantages import discounted_returns, native_scans

    monkeypatch.setenv("AGENT_LOOP_CACHE", str(tmp_path))
    script = "from masking.native_checks import compiled_checks; assert compiled_checks() is not None"
    workers = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [worker.wait(timeout=120) for worker in workers] == [0, 0]
    assert list((tmp_path / "native").iterdir()) == [native.library_path(native_checks.SOURCE)]

    with pytest.warns(UserWarning, match="could not compile or load missing.c"):  # e.g. an install without the C files
        assert native.load(tmp_path / "missing.c") is None

    spans = torch.tensor([[A, O, A, P], [A, P, A, P]], dtype=torch.int8)
    mask = (spans == A).float()
    rewards = mask * torch.tensor([[1.0], [2.0]])
    compiled = discounted_returns(rewards[:1], mask[:1], 0.9, spans[:1])

    def clear_caches():
        for cached in (native.load, native_checks.compiled_checks, native_scans.compiled_scans):
            cached.cache_clear()

    monkeypatch.setenv("AGENT_LOOP_CACHE", str(tmp_path / "broken"))
    monkeypatch.setenv("CC", "false")
    clear_caches()
    try:
        with pytest.warns(UserWarning, match="could not compile or load native_checks.c"):
            assert native_checks.compiled_checks() is None
        with pytest.warns(UserWarning, match="could not compile or load native_scans.c"):
            assert torch.equal(discounted_returns(rewards[:1], mask[:1], 0.9, spans[:1]), compiled)  # the torch scan
        assert list((tmp_path / "broken" / "native").iterdir()) == []
        with pytest.raises(ValueError, match="PAD at row 1, position 1 comes before a non-PAD token"):
            validate_batch(rewards, mask, spans)  # the torch path of the checks
        monkeypatch.setenv("AGENT_LOOP_NATIVE", "0")  # turned off: no compiler run, no warning
        clear_caches()
        assert native_checks.compiled_checks() is None and native_scans.compiled_scans() is None
    finally:
        monkeypatch.undo()
        clear_caches()
    assert native_checks.compiled_checks() is not None and native_scans.compiled_scans() is not None


def test_the_shared_header_is_compiled_in_and_an_edit_recompiles(tmp_path, monkeypatch):
    """Every C file includes ``native_simd.h`` (from ``native.HEADERS``): its text is part of each
    library's hash, so an edit compiles anew, and the compiler finds it there (the scans' file is
    in ``advantages/``, so only the ``-I`` path leads to it)."""
    from advantages import native_scans

    headers = tmp_path / "headers"
    headers.mkdir()
    header = headers / "native_simd.h"
    header.write_text((native.HEADERS / "native_simd.h").read_text())
    monkeypatch.setattr(native, "HEADERS", headers)
    monkeypatch.setenv("AGENT_LOOP_CACHE", str(tmp_path))
    before = native.library_path(native_scans.SOURCE)
    header.write_text('#error "the edited header"\n')
    assert native.library_path(native_scans.SOURCE) != before
    native.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="the edited header"):
            assert native.load(native_scans.SOURCE) is None
    finally:
        native.load.cache_clear()
