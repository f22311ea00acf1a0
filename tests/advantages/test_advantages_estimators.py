"""Estimators and masked statistics against plain references written here with loops (over groups,
rows or tokens), and the one estimator registry. Losses: tests/advantages/test_policy_losses.py."""

import math

import numpy as np
import pytest
import torch

from advantages import (
    ESTIMATORS,
    AdvantageEstimator,
    gae,
    get_adv_estimator_fn,
    get_estimator,
    grpo,
    masked_mean,
    masked_var,
    masked_whiten,
    register_adv_est,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    reinforce_plus_plus_ignore_mask,
    reinforce_plus_plus_reset_at_observation,
    rloo,
)
from masking.spans import SpanKind
from tests.helpers.reference_returns import (
    discounted_returns_ref,
    gae_ref,
    returns_ignore_mask_ref,
    returns_reset_at_observation_ref,
)

A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)


def outcome_batch():
    """Six multi-turn rows in groups {7: 3 rows, 2: 2 rows, 5: 1 row}, outcome reward plus a per-turn reward."""
    spans = torch.tensor(
        [
            [A, A, O, O, A, A, P, P],
            [A, O, A, A, A, P, P, P],
            [A, A, A, A, A, A, A, A],
            [O, A, A, O, A, P, P, P],
            [A, A, O, A, A, A, A, P],
            [A, O, O, O, A, A, P, P],
        ],
        dtype=torch.int8,
    )
    rewards = torch.zeros(spans.shape, dtype=torch.float64)
    last_assistant = [5, 4, 7, 4, 6, 5]
    for row, (position, outcome) in enumerate(zip(last_assistant, [1.0, 0.0, 1.0, 0.5, -1.0, 2.0])):
        rewards[row, position] = outcome
    rewards[0, 1] = 0.25  # a per-turn reward on the first turn's last token
    index = torch.tensor([7, 7, 2, 7, 2, 5])
    return rewards, spans, (spans == A).double(), index


def whiten_reference(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kept = values[mask.bool()]
    whitened = (values - kept.mean()) / torch.sqrt(kept.var(unbiased=True) + 1e-8)
    return whitened * mask


def group_reference(scores: list[float], index: list[int], kind: str) -> list[float]:
    """verl's loops over groups, one row at a time."""
    members: dict[int, list[float]] = {}
    for score, group in zip(scores, index):
        members.setdefault(group, []).append(score)
    out = []
    for score, group in zip(scores, index):
        group_scores = members[group]
        n = len(group_scores)
        mean = sum(group_scores) / n if n > 1 else 0.0
        std = math.sqrt(sum((s - mean) ** 2 for s in group_scores) / (n - 1)) if n > 1 else 1.0
        if kind == "grpo":
            out.append((score - mean) / (std + 1e-6))
        elif kind == "grpo_no_std":
            out.append(score - mean)
        elif kind == "rloo":
            out.append((score - mean) * n / (n - 1) if n > 1 else score)
        else:  # baseline
            out.append(score - mean)
    return out


@pytest.mark.parametrize("kind", ["grpo", "grpo_no_std", "rloo", "baseline"])
@pytest.mark.parametrize("with_spans", [True, False])
def test_outcome_estimators_match_loop_over_groups(kind, with_spans):
    rewards, spans, mask, index = outcome_batch()
    spans_arg = spans if with_spans else None
    per_row = torch.tensor(group_reference(rewards.sum(-1).tolist(), index.tolist(), kind), dtype=torch.float64)
    expected = per_row[:, None] * mask
    if kind == "grpo":
        advantages, returns = grpo(rewards, mask, index, spans=spans_arg)
    elif kind == "grpo_no_std":
        advantages, returns = grpo(rewards, mask, index, spans=spans_arg, norm_adv_by_std_in_grpo=False)
    elif kind == "rloo":
        advantages, returns = rloo(rewards, mask, index, spans=spans_arg)
    else:
        advantages, returns = reinforce_plus_plus_baseline(rewards, mask, index, spans=spans_arg)
        expected = whiten_reference(expected, mask)
    torch.testing.assert_close(advantages, expected)
    assert torch.equal(advantages, returns)
    assert torch.all(advantages[spans != A] == 0)


def dense_bf16_batch(seed: int):
    """8x24 bf16 rewards on every ASSISTANT token (dense, as a per-token reward), two groups of four."""
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(8, 24, generator=generator) > 0.2).double()
    rewards = (torch.randn(8, 24, generator=generator, dtype=torch.float64) * mask).bfloat16()
    return rewards, mask, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


@pytest.mark.parametrize("kind", ["grpo", "grpo_no_std", "rloo", "baseline"])
def test_bf16_outcome_estimators_are_the_float64_result_rounded_once(kind):
    """Dense bf16 rewards: the scores and group statistics accumulate in float32 (as verl's), so each
    advantage is the float64 loop reference on the same bf16 inputs rounded once to bf16 (within bf16's
    unit roundoff 2**-8 of its own value). Summing and whitening in bf16 was up to 1.4e-2 of the largest
    advantage off (GRPO), 4x verl's error."""
    run = {"grpo": lambda r, m, i: grpo(r, m, i), "grpo_no_std": lambda r, m, i: grpo(r, m, i, 1e-6, False),
           "rloo": rloo, "baseline": reinforce_plus_plus_baseline}[kind]
    for seed in range(8):
        rewards, mask, index = dense_bf16_batch(seed)
        per_row = group_reference(rewards.double().sum(-1).tolist(), index.tolist(), kind)
        expected = torch.tensor(per_row, dtype=torch.float64)[:, None] * mask
        if kind == "baseline":
            expected = whiten_reference(expected, mask)
        advantages, returns = run(rewards, mask, index)
        assert advantages.dtype == returns.dtype == torch.bfloat16
        error = (advantages.double() - expected).abs()
        assert bool((error <= 2**-8 * expected.abs() + 1e-6).all()), (seed, float(error.max()))


def test_masked_whiten_of_bf16_values_is_the_float64_result_rounded_once():
    generator = torch.Generator().manual_seed(3)
    values = (torch.randn(8, 24, generator=generator) * 3 + 5).bfloat16()  # an offset mean: bf16 centring loses bits
    mask = torch.rand(8, 24, generator=generator) > 0.3
    expected = whiten_reference(values.double(), mask.double())
    whitened = masked_whiten(values, mask)
    assert whitened.dtype == torch.bfloat16
    assert bool(((whitened.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-6).all())
    assert masked_whiten(values.double(), mask).dtype == torch.float64  # float64 stays float64

def test_group_ids_need_not_be_dense_or_sorted():
    rewards, _, mask, index = outcome_batch()
    relabelled = torch.tensor([10**9, 10**9, -3, 10**9, -3, 42])
    assert torch.equal(grpo(rewards, mask, index)[0], grpo(rewards, mask, relabelled)[0])
    permutation = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled = rloo(rewards[permutation], mask[permutation], index[permutation])[0]
    torch.testing.assert_close(shuffled, rloo(rewards, mask, index)[0][permutation])


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_whitens_carry_through_returns(gamma):
    rewards, spans, mask, _ = outcome_batch()
    advantages, returns = reinforce_plus_plus(rewards, mask, gamma, spans=spans)
    expected_returns = discounted_returns_ref(rewards, spans, gamma)
    torch.testing.assert_close(returns, expected_returns)
    torch.testing.assert_close(advantages, whiten_reference(expected_returns, mask))
    raw, _ = reinforce_plus_plus(rewards, mask, gamma, spans=spans, whiten=False)
    torch.testing.assert_close(raw, expected_returns)


def test_gae_whitens_advantages_and_keeps_returns():
    rewards, spans, mask, _ = outcome_batch()
    values = torch.randn(spans.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    advantages, returns = gae(rewards, values, mask, 0.99, 0.95, spans=spans)
    expected_advantages, expected_returns = gae_ref(rewards, values, spans, 0.99, 0.95)
    torch.testing.assert_close(returns, expected_returns)
    torch.testing.assert_close(advantages, whiten_reference(expected_advantages, mask))


def test_registry_calls_every_estimator_by_keyword_and_declares_needs():
    rewards, spans, mask, index = outcome_batch()
    values = torch.randn(spans.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert set(ESTIMATORS) == {e.value for e in AdvantageEstimator}
    calls = {
        "reinforce_plus_plus": (dict(gamma=0.9), reinforce_plus_plus(rewards, mask, 0.9, spans=spans)),
        "reinforce_plus_plus_reset_at_observation": (
            dict(gamma=0.9), reinforce_plus_plus_reset_at_observation(rewards, mask, 0.9, spans=spans)),
        "reinforce_plus_plus_ignore_mask": (dict(gamma=0.9), reinforce_plus_plus_ignore_mask(rewards, mask, 0.9)),
        "reinforce_plus_plus_baseline": (dict(index=index), reinforce_plus_plus_baseline(rewards, mask, index)),
        "grpo": (dict(index=index, epsilon=0.1), grpo(rewards, mask, index, 0.1)),
        "rloo": (dict(index=index), rloo(rewards, mask, index)),
        "gae": (dict(values=values, gamma=0.9, lam=0.95), gae(rewards, values, mask, 0.9, 0.95)),
    }
    for name, (kwargs, (advantages, returns)) in calls.items():
        got_advantages, got_returns = get_estimator(name)(rewards, mask, spans=spans, **kwargs)
        assert torch.equal(got_advantages, advantages) and torch.equal(got_returns, returns), name
    # needs and settings are declared by the entry, read off the function's signature
    assert {n for n, e in ESTIMATORS.items() if e.needs_index} == {
        "grpo", "rloo", "reinforce_plus_plus_baseline", "turn_rloo", "turn_index_normalized", "gigpo"}
    assert {n for n, e in ESTIMATORS.items() if e.needs_values} == {"gae", "turn_gae"}
    assert get_estimator("gae").hyperparameters == ("gamma", "lam", "whiten")
    assert get_estimator(AdvantageEstimator.GRPO).hyperparameters == ("epsilon", "norm_adv_by_std_in_grpo")
    assert get_adv_estimator_fn(AdvantageEstimator.RLOO) is rloo
    # whiten reaches the function; a misspelled or foreign keyword is a TypeError, not silently dropped
    raw, _ = get_estimator("reinforce_plus_plus")(rewards, mask, spans=spans, gamma=0.9, whiten=False)
    torch.testing.assert_close(raw, discounted_returns_ref(rewards, spans, 0.9))
    with pytest.raises(TypeError, match="gama"):
        get_estimator("reinforce_plus_plus")(rewards, mask, gama=0.9)
    with pytest.raises(TypeError, match="gamma"):
        get_estimator("grpo")(rewards, mask, index=index, gamma=0.9)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'grpo'"):
        get_estimator("ppo")
    with pytest.raises(ValueError, match="the grpo estimator needs index"):
        get_estimator("grpo")(rewards, mask)
    with pytest.raises(ValueError, match="the gae estimator needs values"):
        get_estimator("gae")(rewards, mask, values=None)


def test_register_adv_est_decorator_like_verl():
    def fn(token_level_rewards, response_mask, index, *, scale=1.0):
        return token_level_rewards * scale, token_level_rewards

    try:
        assert register_adv_est("test_scaled", needs_index=True)(fn) is fn
        assert register_adv_est("test_scaled", needs_index=True)(fn) is fn  # same function again: a no-op
        entry = get_estimator("test_scaled")
        assert entry.needs_index and not entry.needs_values and entry.hyperparameters == ("scale",)
        rewards = torch.ones(2, 3)
        assert torch.equal(entry(rewards, rewards, index=[0, 0], scale=2.0)[0], 2 * rewards)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("test_scaled")(lambda token_level_rewards, response_mask: None)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est(AdvantageEstimator.GRPO)(fn)
    finally:
        ESTIMATORS.pop("test_scaled", None)


def test_ablation_entries_are_the_historical_returns_whitened():
    rewards, spans, mask, _ = outcome_batch()
    for fn, reference in ((reinforce_plus_plus_reset_at_observation,
                           returns_reset_at_observation_ref(rewards, mask, 0.9)),
                          (reinforce_plus_plus_ignore_mask, returns_ignore_mask_ref(rewards, 0.9))):
        advantages, returns = fn(rewards, mask, 0.9, spans=spans)
        torch.testing.assert_close(returns, reference)
        torch.testing.assert_close(advantages, whiten_reference(reference, mask))
        raw, raw_returns = fn(rewards, mask, 0.9, whiten=False)
        torch.testing.assert_close(raw_returns, reference)  # verl's values off the mask kept in the returns
        torch.testing.assert_close(raw, reference * mask)  # advantages: exactly 0 off the mask (every estimator)


@pytest.mark.parametrize("make_index", [
    lambda ids: torch.tensor(ids),
    lambda ids: np.asarray(ids, dtype=np.int64),
    lambda ids: np.asarray([f"uid-{i}" for i in ids], dtype=object),
    lambda ids: np.asarray([f"uid-{i}" for i in ids]),  # numpy unicode strings
    lambda ids: [f"uid-{i}" for i in ids],
    lambda ids: tuple(ids),
], ids=["tensor", "numpy-int", "numpy-object-str", "numpy-str", "list-str", "tuple-int"])
def test_index_takes_what_verl_passes(make_index):
    rewards, spans, mask, index = outcome_batch()
    expected = grpo(rewards, mask, index)[0]
    torch.testing.assert_close(grpo(rewards, mask, make_index(index.tolist()))[0], expected)
    torch.testing.assert_close(rloo(rewards, mask, make_index(index.tolist()))[0], rloo(rewards, mask, index)[0])


@pytest.mark.parametrize("estimator", [grpo, rloo, reinforce_plus_plus_baseline])
def test_outcome_estimators_reject_bad_index_and_misplaced_rewards(estimator):
    rewards, spans, mask, index = outcome_batch()
    with pytest.raises(ValueError, match=r"one integer group id per row, shape \(6,\); got a torch.float32"):
        estimator(rewards, mask, index.float())
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        estimator(rewards, mask, index[:5])
    with pytest.raises(ValueError, match=r"one group id per row \(6\)"):
        estimator(rewards, mask, [0, 1])
    with pytest.raises(ValueError, match=r"index\[1\] is 0.5; group ids are ints or strings"):
        estimator(rewards, mask, [0, 0.5, 1, 1, 2, 2])
    with pytest.raises(ValueError, match=r"one group id per row \(6\); got None"):
        estimator(rewards, mask, None)
    rewards[3, 0] = 1.0  # an OBSERVATION token
    with pytest.raises(ValueError, match="row 3, position 0 sits on an OBSERVATION"):
        estimator(rewards, mask, index, spans=spans)
    rewards[3, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite value nan at row 3, position 0"):
        estimator(rewards, mask, index, spans=spans)


# --- masked statistics ---------------------------------------------------------------------------


def test_masked_statistics_match_selected_elements():
    values = torch.randn(5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.rand(5, 9, generator=torch.Generator().manual_seed(2)) < 0.5
    values_with_nan_off_mask = torch.where(mask, values, float("nan"))
    kept = values[mask]
    torch.testing.assert_close(masked_mean(values_with_nan_off_mask, mask), kept.mean())
    torch.testing.assert_close(masked_var(values_with_nan_off_mask, mask), kept.var(unbiased=True))
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), kept.var(unbiased=False))
    torch.testing.assert_close(masked_mean(values, mask, dim=-1)[0], values[0][mask[0]].mean())
    whitened = masked_whiten(values_with_nan_off_mask, mask)
    torch.testing.assert_close(whitened, whiten_reference(values, mask.double()))
    rescaled = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(rescaled[mask], (kept - kept.mean()) / torch.sqrt(kept.var() + 1e-8) + kept.mean())


@pytest.mark.parametrize("tokens", [0, 1])
def test_whitening_fewer_than_two_tokens_raises_unless_unchecked(tokens):
    values = torch.randn(2, 4)
    mask = torch.zeros(2, 4)
    mask[1, :tokens] = 1
    with pytest.raises(ValueError, match=f"need at least 2 unmasked tokens.*got {tokens}"):
        masked_whiten(values, mask)
    with pytest.raises(ValueError, match=f"got {tokens}"):
        reinforce_plus_plus(torch.zeros(2, 4), mask, 1.0)
    assert torch.isnan(masked_var(values, mask, check=False))  # unchecked: NaN, no sync
