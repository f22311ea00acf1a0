"""Carry-through returns and GAE (advantages.returns) against the serial references, plus the
multi-turn regressions of docs/design.md section 3 and the errors on bad input."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantages import discounted_returns, gae, returns_ignore_mask, returns_reset_at_observation
from advantages.native_scans import native_gae, native_returns, native_whitened_returns
from advantages.returns import WHITEN_EPS, whitened_discounted_returns
from advantages.scan import carry_scan, max_exponent
from masking.spans import SpanKind
from tests.helpers.reference_returns import (
    discounted_returns_ref,
    gae_ref,
    returns_ignore_mask_ref,
    returns_reset_at_observation_ref,
    whiten_ref,
)

A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)
GAMMAS = (0.0, 0.5, 0.99, 1.0)
LENGTHS = (1, 127, 128, 129, 1000, 8192)
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def random_spans(t: int, generator: torch.Generator) -> torch.Tensor:
    """(6, t) int8 spans: multi-turn rows (several observation spans, trailing padding of varied
    length), an all-ASSISTANT row, an all-PAD row, and a row that starts with an observation."""
    rows = []
    for kind in ("turns", "turns", "turns", "assistant", "pad", "observation_first"):
        if kind == "assistant":
            rows.append([A] * t)
            continue
        if kind == "pad":
            rows.append([P] * t)
            continue
        row, current = [], O if kind == "observation_first" else A
        while len(row) < t:
            longest = max(2, t // 8)
            row += [current] * int(torch.randint(1, longest, (1,), generator=generator))
            current = O if current == A else A
        row = row[:t]
        trailing = int(torch.randint(0, max(1, t // 4), (1,), generator=generator))
        rows.append(row[: t - trailing] + [P] * trailing)
    return torch.tensor(rows, dtype=torch.int8)


def random_rewards(spans: torch.Tensor, generator: torch.Generator, dtype=torch.float64, density=0.2) -> torch.Tensor:
    """Normal rewards on a random share of the ASSISTANT tokens (per-turn/outcome-like), 0 elsewhere."""
    noise = torch.randn(spans.shape, generator=generator, dtype=torch.float64)
    keep = (torch.rand(spans.shape, generator=generator) < density) & (spans == A)
    return torch.where(keep, noise, 0.0).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_discounted_returns_match_serial_reference(gamma, t, dtype, scan_path):
    generator = torch.Generator().manual_seed(t)
    spans = random_spans(t, generator)
    rewards = random_rewards(spans, generator, dtype)
    mask = (spans == A).to(dtype)
    got = discounted_returns(rewards, mask, gamma, spans=spans)
    assert got.dtype == dtype and got.device == rewards.device and got.is_contiguous()
    torch.testing.assert_close(got.double(), discounted_returns_ref(rewards, spans, gamma), **TOLERANCE[dtype])
    assert torch.all(got[spans != A] == 0)  # observation and padding exactly 0
    assert torch.equal(discounted_returns(rewards, mask, gamma, spans=spans, validate=False), got)  # the hot path
    if scan_path == "compiled":  # what ran
        assert torch.equal(native_returns(rewards, mask, gamma), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_gae_matches_serial_reference(gamma, t, dtype, scan_path):
    generator = torch.Generator().manual_seed(1000 + t)
    spans = random_spans(t, generator)
    rewards = random_rewards(spans, generator, dtype)
    values = torch.randn(spans.shape, generator=generator, dtype=torch.float64).to(dtype)
    mask = (spans == A).to(dtype)
    for lam in (0.0, 0.3, 0.5, 0.95, 1.0):  # below and from GAE_ONE_SCAN_MIN_LAM
        advantages, returns = gae(rewards, values, mask, gamma, lam, spans=spans, whiten=False)
        expected_advantages, expected_returns = gae_ref(rewards, values, spans, gamma, lam)
        assert advantages.dtype == returns.dtype == dtype
        torch.testing.assert_close(advantages.double(), expected_advantages, **TOLERANCE[dtype])
        torch.testing.assert_close(returns.double(), expected_returns, **TOLERANCE[dtype])
        assert torch.all(advantages[spans != A] == 0) and torch.all(returns[spans != A] == 0)


@pytest.mark.parametrize("t", (1, 129, 1000))
@pytest.mark.parametrize("gamma", GAMMAS)
def test_buggy_variants_match_their_serial_references(gamma, t):
    generator = torch.Generator().manual_seed(2000 + t)
    spans = random_spans(t, generator)
    rewards = random_rewards(spans, generator, torch.float32)
    mask = (spans == A).float()
    torch.testing.assert_close(
        returns_reset_at_observation(rewards, mask, gamma).double(),
        returns_reset_at_observation_ref(rewards, mask, gamma),
        **TOLERANCE[torch.float32],
    )
    expected = returns_ignore_mask_ref(rewards, gamma)
    torch.testing.assert_close(returns_ignore_mask(rewards, gamma).double(), expected, **TOLERANCE[torch.float32])


def test_design_worked_example_literally():
    """docs/design.md section 3: gamma 0.5, spans [A, A, O, O, A, P, P], reward 2.0 at t=4."""
    spans = torch.tensor([[A, A, O, O, A, P, P]], dtype=torch.int8)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0]])
    mask = (spans == A).float()
    expected = torch.tensor([[0.5, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0]])
    assert torch.equal(discounted_returns(rewards, mask, 0.5, spans=spans), expected)
    assert torch.equal(discounted_returns(rewards, mask, 0.5), expected)  # mask-only: every 0 carries
    assert torch.equal(returns_reset_at_observation(rewards, mask, 0.5), torch.tensor([[0, 0, 0, 1.0, 2.0, 0, 0]]))
    assert torch.equal(returns_ignore_mask(rewards, 0.5), torch.tensor([[0.125, 0.25, 0.5, 1.0, 2.0, 0, 0]]))


@pytest.mark.parametrize("gamma", (1.0, 0.9, 0.5))
def test_inserting_observations_leaves_assistant_returns_unchanged(gamma, scan_path):
    generator = torch.Generator().manual_seed(7)
    compact_rewards = torch.randn(3, 40, generator=generator, dtype=torch.float64)
    compact = discounted_returns(compact_rewards, torch.ones_like(compact_rewards), gamma)
    # the same assistant tokens with observation spans of random length inserted between them
    for row in range(3):
        spans, rewards = [], []
        for token in range(40):
            spans += [A] + [O] * int(torch.randint(0, 4, (1,), generator=generator))
            rewards += [float(compact_rewards[row, token])] + [0.0] * (len(spans) - len(rewards) - 1)
        spans, rewards = torch.tensor([spans], dtype=torch.int8), torch.tensor([rewards], dtype=torch.float64)
        mask = (spans == A).double()
        with_spans = discounted_returns(rewards, mask, gamma, spans=spans)
        for expanded in (with_spans, discounted_returns(rewards, mask, gamma)):
            torch.testing.assert_close(expanded[spans == A], compact[row], atol=1e-12, rtol=1e-12)
            assert torch.all(expanded[spans == O] == 0)


def test_all_assistant_rows_give_the_plain_discounted_return():
    rewards = torch.randn(4, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = discounted_returns(rewards, torch.ones_like(rewards), 0.97)
    torch.testing.assert_close(got, returns_ignore_mask_ref(rewards, 0.97), atol=1e-10, rtol=1e-10)


def test_rows_are_independent(scan_path):
    generator = torch.Generator().manual_seed(11)
    spans = random_spans(500, generator)
    rewards = random_rewards(spans, generator)
    values = torch.randn(spans.shape, generator=generator, dtype=torch.float64)
    mask = (spans == A).double()
    batch = discounted_returns(rewards, mask, 0.9, spans=spans)
    batch_gae = gae(rewards, values, mask, 0.9, 0.8, spans=spans, whiten=False)
    for row in range(spans.shape[0]):
        alone = slice(row, row + 1)
        assert torch.equal(batch[alone], discounted_returns(rewards[alone], mask[alone], 0.9, spans=spans[alone]))
        alone_gae = gae(rewards[alone], values[alone], mask[alone], 0.9, 0.8, spans=spans[alone], whiten=False)
        torch.testing.assert_close(batch_gae[0][alone], alone_gae[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("scan_path", ["torch"], indirect=True)
def test_row_blocks_give_the_same_result(monkeypatch, scan_path):
    """Big CPU batches run the torch scans in blocks of rows (advantages.scan.by_row_blocks); force 3 blocks here."""
    monkeypatch.setattr("advantages.scan.CPU_BLOCK_ELEMENTS", 1000)
    generator = torch.Generator().manual_seed(13)
    spans = random_spans(500, generator)
    rewards = random_rewards(spans, generator)
    values = torch.randn(spans.shape, generator=generator, dtype=torch.float64)
    mask = (spans == A).double()
    expected = discounted_returns_ref(rewards, spans, 0.9)
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.9, spans=spans), expected, atol=1e-10, rtol=1e-10)
    advantages, returns = gae(rewards, values, mask, 0.9, 0.8, spans=spans, whiten=False)
    expected_advantages, expected_returns = gae_ref(rewards, values, spans, 0.9, 0.8)
    torch.testing.assert_close(advantages, expected_advantages, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(returns, expected_returns, atol=1e-10, rtol=1e-10)


def test_trailing_padding_and_observations_get_exactly_zero_even_without_validation(scan_path):
    spans = torch.tensor([[A, O, A, P, P], [O, O, A, A, P]], dtype=torch.int8)
    rewards = torch.tensor([[1.0, 0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0, 0.0]])
    got = discounted_returns(rewards, (spans == A).float(), 0.9, spans=spans, validate=False)
    assert torch.equal(got[spans != A], torch.zeros(int((spans != A).sum())))
    torch.testing.assert_close(got[spans == A], torch.tensor([1.0 + 0.9 * 2.0, 2.0, 0.9 * 3.0, 3.0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_scanned_in_float32_and_returned_in_its_dtype(dtype):
    generator = torch.Generator().manual_seed(5)
    spans = random_spans(300, generator)
    rewards = random_rewards(spans, generator, dtype)
    got = discounted_returns(rewards, (spans == A).to(dtype), 0.99, spans=spans)
    assert got.dtype == dtype
    expected = discounted_returns_ref(rewards.double(), spans, 0.99).to(dtype)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_many_chunks_and_tiny_gamma():
    """gamma 0.01 keeps float32 blocks at 9 tokens (0.01**9 is the last power above sqrt(tiny)); the
    carries go through a float64 level of 8-block groups and then the doubling fallback."""
    assert max_exponent(0.01, torch.float32) == 9
    generator = torch.Generator().manual_seed(9)
    spans = random_spans(3000, generator)
    rewards = random_rewards(spans, generator, torch.float32, density=1.0)
    got = discounted_returns(rewards, (spans == A).float(), 0.01, spans=spans)
    torch.testing.assert_close(got.double(), discounted_returns_ref(rewards, spans, 0.01), atol=1e-6, rtol=1e-5)


def test_carry_scan_ignores_x_off_the_steps_and_gives_zero_there():
    steps = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]])
    x = torch.tensor([[1.0, 5.0, 0.0, 2.0, 7.0]])
    for decay in (0.0, 1e-30, 0.5, 1.0):  # 1e-30: even decay**1 underflows sqrt(tiny), the doubling fallback
        expected = torch.tensor([[1.0 + decay * 2.0, 0.0, 0.0, 2.0, 0.0]])
        torch.testing.assert_close(carry_scan(x, steps, decay), expected)
        # masked=True (validated input, x already 0 off the steps) skips zeroing x: the same result
        torch.testing.assert_close(carry_scan(x * steps, steps, decay, masked=True), expected)


def test_empty_inputs(scan_path):
    """No rows or no columns: empty outputs of that shape; whitening one needs validate=False (the
    default raises: fewer than 2 tokens)."""
    for shape in ((0, 5), (3, 0)):
        rewards = torch.zeros(shape)
        assert discounted_returns(rewards, rewards, 0.9).shape == shape
        assert gae(rewards, rewards, rewards, 0.9, 0.9, whiten=False)[0].shape == shape
        for pair in (
            whitened_discounted_returns(rewards, rewards, 0.9, validate=False),
            gae(rewards, rewards, rewards, 0.9, 0.9, validate=False),
        ):
            assert [x.shape for x in pair] == [shape, shape]
        with pytest.raises(ValueError, match="need at least 2 unmasked tokens"):
            whitened_discounted_returns(rewards, rewards, 0.9)


# --- property-based: random span layouts ------------------------------------------------------------

segments = st.lists(st.tuples(st.sampled_from([A, O]), st.integers(1, 30)), min_size=0, max_size=8)
layouts = st.lists(st.tuples(segments, st.integers(0, 10)), min_size=1, max_size=4)


def build(layout, reward_seed: int):
    rows = [[kind for kind, length in segs for _ in range(length)] + [P] * trailing for segs, trailing in layout]
    t = max(1, max(len(row) for row in rows))
    spans = torch.tensor([row + [P] * (t - len(row)) for row in rows], dtype=torch.int8)
    generator = torch.Generator().manual_seed(reward_seed)
    values = torch.randn(spans.shape, generator=generator, dtype=torch.float64)
    return spans, random_rewards(spans, generator, density=0.5), values


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layouts, st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 2**16))
def test_property_scans_match_serial_references(scan_path, layout, gamma, lam, seed):
    spans, rewards, values = build(layout, seed)
    mask = (spans == A).double()
    tolerance = dict(atol=1e-9, rtol=1e-9)
    expected = discounted_returns_ref(rewards, spans, gamma)
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma, spans=spans), expected, **tolerance)
    advantages, returns = gae(rewards, values, mask, gamma, lam, spans=spans, whiten=False)
    expected_advantages, expected_returns = gae_ref(rewards, values, spans, gamma, lam)
    torch.testing.assert_close(advantages, expected_advantages, **tolerance)
    torch.testing.assert_close(returns, expected_returns, **tolerance)
    expected = returns_reset_at_observation_ref(rewards, mask, gamma)
    torch.testing.assert_close(returns_reset_at_observation(rewards, mask, gamma), expected, **tolerance)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layouts, st.floats(0.0, 1.0), st.integers(0, 2**16))
def test_property_mask_only_equals_spans_with_padding_as_observation(scan_path, layout, gamma, seed):
    """verl after PR #7300: without spans every 0 carries, which matches spans whose PAD became OBSERVATION."""
    spans, rewards, _ = build(layout, seed)
    mask = (spans == A).double()
    as_observation = torch.where(spans == P, O, spans).to(torch.int8)
    expected = discounted_returns_ref(rewards, as_observation, gamma)
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), expected)


# --- bad input ------------------------------------------------------------------------------------


def bad_batch():
    spans = torch.tensor([[A, A, O, P], [A, O, A, P]], dtype=torch.int8)
    return spans, torch.zeros(2, 4), (spans == A).float()


@pytest.mark.parametrize("function", ["returns", "gae"])
@pytest.mark.parametrize(
    "case, message",
    [
        ("reward_on_observation", r"reward 1\.0 at row 1, position 1 sits on an OBSERVATION"),
        ("reward_on_pad", r"row 0, position 3 sits on a PAD"),
        ("nan_reward", r"non-finite value nan at row 1, position 2"),
        ("inf_reward", r"non-finite value inf at row 0, position 0"),
        ("pad_before_token", r"PAD at row 1, position 1 comes before a non-PAD token"),
        ("unknown_span", r"unknown span value 7 at row 0, position 2"),
        ("mask_disagrees", r"row 1, position 1"),
        ("mask_not_binary", r"value 0\.5 at row 0, position 1"),
        ("wrong_shape", r"shape \(2, 3\)"),
        ("gamma_out_of_range", r"gamma must be a number in \[0, 1\]"),
        ("gamma_tensor", r"gamma must be a number in \[0, 1\]"),
    ],
)
def test_bad_input_raises_value_error_naming_row_and_position(function, case, message):
    spans, rewards, mask = bad_batch()
    gamma, use_spans = 0.9, True
    if case == "reward_on_observation":
        rewards[1, 1] = 1.0
    elif case == "reward_on_pad":
        rewards[0, 3] = 1.0
    elif case == "nan_reward":
        rewards[1, 2] = float("nan")
    elif case == "inf_reward":
        rewards[0, 0] = float("inf")
    elif case == "pad_before_token":
        spans[1, 1] = P
        mask = (spans == A).float()
    elif case == "unknown_span":
        spans[0, 2] = 7
    elif case == "mask_disagrees":
        mask[1, 1] = 1.0
    elif case == "mask_not_binary":
        mask[0, 1], use_spans = 0.5, False
    elif case == "wrong_shape":
        mask = mask[:, :3]
    elif case == "gamma_out_of_range":
        gamma = 1.5
    elif case == "gamma_tensor":
        gamma = torch.tensor(0.9)
    spans = spans if use_spans else None
    with pytest.raises(ValueError, match=message):
        if function == "returns":
            discounted_returns(rewards, mask, gamma, spans=spans)
        else:
            gae(rewards, torch.zeros_like(rewards), mask, gamma, 0.95, spans=spans)


def test_gae_rejects_values_of_another_shape_and_lam_out_of_range():
    spans, rewards, mask = bad_batch()
    with pytest.raises(ValueError, match=r"values has shape \(2, 3\)"):
        gae(rewards, torch.zeros(2, 3), mask, 0.9, 0.95, spans=spans)
    with pytest.raises(ValueError, match=r"lam must be a number in \[0, 1\]"):
        gae(rewards, torch.zeros_like(rewards), mask, 0.9, -0.1, spans=spans)


def test_integer_rewards_are_rejected():
    with pytest.raises(ValueError, match="must be floating point"):
        discounted_returns(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), 0.9)


# --- whitening (REINFORCE++ advantages, gae(whiten=True)) --------------------------------------------


@pytest.mark.parametrize("with_spans", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", (1, 129, 8192))
@pytest.mark.parametrize("gamma", (0.0, 0.99, 1.0))
def test_whitened_returns_match_serial_reference(gamma, t, dtype, with_spans, scan_path):
    generator = torch.Generator().manual_seed(77 + t)
    spans = random_spans(t, generator)
    if not with_spans:  # mask-only: every non-ASSISTANT token is an observation
        spans = torch.where(spans == A, A, O).to(torch.int8)
    rewards = random_rewards(spans, generator, dtype)
    rewards[0, 0] = 1.0  # at least 2 ASSISTANT tokens even for t = 1
    spans[:2, 0] = A
    mask = (spans == A).to(dtype)
    advantages, returns = whitened_discounted_returns(rewards, mask, gamma, spans=spans if with_spans else None)
    expected_returns = discounted_returns_ref(rewards, spans, gamma)
    torch.testing.assert_close(returns.double(), expected_returns, **TOLERANCE[dtype])
    torch.testing.assert_close(advantages.double(), whiten_ref(expected_returns, spans), **TOLERANCE[dtype])
    assert advantages.dtype == dtype and torch.all(advantages[spans != A] == 0)
    unchecked = whitened_discounted_returns(rewards, mask, gamma, spans=spans, validate=False)
    torch.testing.assert_close(unchecked[0], advantages, atol=1e-6, rtol=1e-6)
    if scan_path == "compiled":  # what ran
        assert torch.equal(native_whitened_returns(rewards, mask, gamma, WHITEN_EPS)[0], advantages)


def test_whitening_keeps_precision_when_the_mean_dwarfs_the_spread(scan_path):
    """Returns near 1000 that differ by ~1e-3: a sum-of-squares variance would cancel in float32
    (whitened values off by O(1)); the torch path's centred two-pass variance is off by the float32
    rounding of the returns and their mean only (~3e-3 here, the same as masked_whiten). The
    compiled loop sums in double, less each row's first value, and merges the rows (Chan): off by
    the rounding of its float32 output only."""
    generator = torch.Generator().manual_seed(5)
    spans = random_spans(4096, generator)
    rewards = torch.where(spans == A, 1000.0 + 1e-3 * torch.randn(spans.shape, generator=generator, dtype=torch.float64), 0.0)
    advantages, returns = whitened_discounted_returns(rewards.float(), (spans == A).float(), 0.0, spans=spans)
    expected = whiten_ref(discounted_returns_ref(rewards.float(), spans, 0.0), spans)
    torch.testing.assert_close(advantages.double(), expected, atol=1e-2 if scan_path == "torch" else 1e-6, rtol=0)


def test_whitening_in_row_blocks_and_half_precision(monkeypatch, scan_path):
    monkeypatch.setattr("advantages.scan.CPU_BLOCK_ELEMENTS", 1000)
    generator = torch.Generator().manual_seed(21)
    spans = random_spans(500, generator)
    rewards = random_rewards(spans, generator)
    values = torch.randn(spans.shape, generator=generator, dtype=torch.float64)
    mask = (spans == A).double()
    advantages, _ = whitened_discounted_returns(rewards, mask, 0.9, spans=spans)
    torch.testing.assert_close(advantages, whiten_ref(discounted_returns_ref(rewards, spans, 0.9), spans), atol=1e-10, rtol=1e-10)
    gae_advantages, gae_returns = gae(rewards, values, mask, 0.9, 0.8, spans=spans)
    expected_advantages, expected_returns = gae_ref(rewards, values, spans, 0.9, 0.8)
    torch.testing.assert_close(gae_advantages, whiten_ref(expected_advantages, spans), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(gae_returns, expected_returns, atol=1e-10, rtol=1e-10)
    half, _ = whitened_discounted_returns(rewards.bfloat16(), mask.bfloat16(), 0.9, spans=spans)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), whiten_ref(discounted_returns_ref(rewards.bfloat16(), spans, 0.9), spans), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("tokens", [0, 1])
def test_whitening_needs_two_assistant_tokens(tokens):
    spans = torch.full((2, 4), O, dtype=torch.int8)
    spans[1, :tokens] = A
    mask = (spans == A).float()
    for call in (
        lambda **kw: whitened_discounted_returns(torch.zeros(2, 4), mask, 0.9, spans=spans, **kw),
        lambda **kw: gae(torch.zeros(2, 4), torch.zeros(2, 4), mask, 0.9, 0.95, spans=spans, **kw),
    ):
        with pytest.raises(ValueError, match=f"need at least 2 unmasked tokens.*got {tokens}"):
            call()
        assert torch.equal(call(validate=False)[0], torch.zeros(2, 4))  # unchecked: 0 everywhere (advantages/stats.py)


def test_one_whitening_epsilon_and_one_token_rule():
    """WHITEN_EPS, MIN_WHITEN_TOKENS, whitenable and check_whitenable are defined once (advantages.stats)
    and used by every whitening: masked_whiten's default, the scans' whitening, the checks' message."""
    import inspect

    import advantages
    import advantages.returns
    import advantages.stats
    from advantages.stats import check_enough_tokens, masked_var

    assert advantages.WHITEN_EPS is advantages.returns.WHITEN_EPS is advantages.stats.WHITEN_EPS == WHITEN_EPS == 1e-8
    assert inspect.signature(advantages.masked_whiten).parameters["eps"].default is advantages.WHITEN_EPS
    assert advantages.check_whitenable is advantages.returns.check_whitenable is advantages.stats.check_whitenable
    assert advantages.MIN_WHITEN_TOKENS == 2
    assert [advantages.whitenable(n) for n in range(4)] == [False, False, True, True]
    for n in range(4):  # whitenable(n) is exactly "check_whitenable(n) does not raise"
        try:
            advantages.check_whitenable(n)
            raised = False
        except ValueError:
            raised = True
        assert raised is not advantages.whitenable(n)
    message = "need at least 2 unmasked tokens for a Bessel-corrected variance, got 1 "
    with pytest.raises(ValueError, match=message):
        advantages.check_whitenable(1)
    with pytest.raises(ValueError, match=message):
        check_enough_tokens(torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match="need at least 1 unmasked tokens.*got 0"):
        masked_var(torch.zeros(1, 2), torch.zeros(1, 2), unbiased=False)
    advantages.check_whitenable(1, needed=1)
    values, mask = torch.tensor([[1.0, 2.0, 4.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    expected = torch.tensor([[-0.5, 0.5, 0.0]]) / (0.5 + WHITEN_EPS) ** 0.5
    torch.testing.assert_close(advantages.masked_whiten(values, mask), expected, atol=0, rtol=1e-6)


def test_hot_path_calls_nothing_that_syncs_with_the_host(monkeypatch):
    """validate=False: the torch path reads nothing back (on CUDA it would not wait for the device);
    validate=True reads its checks back once per call (one sync on CUDA: a stack of scalars) on
    the torch path, and through no torch call on the compiled CPU path."""
    from tests.helpers.host_syncs import HostSyncs

    generator = torch.Generator().manual_seed(3)
    spans = random_spans(300, generator)
    rewards = random_rewards(spans, generator, torch.float32)
    mask = (spans == A).float()
    with HostSyncs() as syncs:
        discounted_returns(rewards, mask, 0.99, spans=spans, validate=False)
        whitened_discounted_returns(rewards, mask, 0.99, spans=spans, validate=False)
        gae(rewards, rewards, mask, 0.99, 0.95, spans=spans, validate=False)
    assert syncs.seen == []
    with HostSyncs() as syncs:
        whitened_discounted_returns(rewards, mask, 0.99, spans=spans)
    assert syncs.seen == []  # the compiled checks (masking.native_checks) return Python numbers
    monkeypatch.setattr("masking.validate.native_check", lambda *tensors: None)  # the torch path, as on CUDA
    with HostSyncs() as syncs:
        whitened_discounted_returns(rewards, mask, 0.99, spans=spans)
    assert syncs.seen and set(syncs.seen) == {"item"}  # the fused checks' scalars, nothing per check


def test_compiled_scans_leave_what_they_cannot_take_to_torch():
    """Non-contiguous, half-precision or mixed-dtype tensors take the torch scans: the same results."""
    generator = torch.Generator().manual_seed(21)
    spans = random_spans(50, generator)
    rewards = random_rewards(spans, generator, torch.float32)
    values = torch.randn(spans.shape, generator=generator)
    mask = (spans == A).float()
    assert native_returns(rewards, mask, 0.9) is not None
    assert native_returns(rewards.t().contiguous().t(), mask, 0.9) is None
    assert native_returns(rewards.half(), mask.half(), 0.9) is None
    assert native_returns(rewards.double(), mask, 0.9) is None
    strided = rewards.t().contiguous().t()  # column-major: the torch scan
    torch.testing.assert_close(discounted_returns(strided, mask, 0.9, spans=spans), discounted_returns(rewards, mask, 0.9, spans=spans))
    for values_dtype in (torch.float32, torch.float64):  # values of another dtype are converted for the loop
        advantages, returns = gae(rewards, values.to(values_dtype), mask, 0.9, 0.8, spans=spans, whiten=False)
        expected_advantages, expected_returns = gae_ref(rewards, values.to(values_dtype), spans, 0.9, 0.8)
        torch.testing.assert_close(advantages.double(), expected_advantages, **TOLERANCE[torch.float32])
        torch.testing.assert_close(returns.double(), expected_returns, **TOLERANCE[torch.float32])


def test_whitened_gae_matches_serial_reference(scan_path):
    generator = torch.Generator().manual_seed(12)
    spans = random_spans(700, generator)
    rewards = random_rewards(spans, generator, torch.float32)
    values = torch.randn(spans.shape, generator=generator)
    advantages, returns = gae(rewards, values, (spans == A).float(), 0.99, 0.95, spans=spans)
    expected_advantages, expected_returns = gae_ref(rewards, values, spans, 0.99, 0.95)
    torch.testing.assert_close(advantages.double(), whiten_ref(expected_advantages, spans), **TOLERANCE[torch.float32])
    torch.testing.assert_close(returns.double(), expected_returns, **TOLERANCE[torch.float32])
    assert torch.all(advantages[spans != A] == 0)
    if scan_path == "compiled":  # what ran
        assert torch.equal(native_gae(rewards, values, (spans == A).float(), 0.99, 0.95, whiten_eps=WHITEN_EPS)[0], advantages)
