"""Estimators, masked statistics, KL penalties and the PPO loss against plain references written
here with loops (over groups, rows or tokens), and the registry."""

import math

import pytest
import torch
from reference_returns import discounted_returns_ref, gae_ref

from advantages import (
    ESTIMATORS,
    gae,
    get_estimator,
    grpo,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_clip_policy_loss,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from masking.spans import SpanKind

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


def test_registry_calls_every_estimator_with_one_signature():
    rewards, spans, mask, index = outcome_batch()
    values = torch.zeros_like(rewards)
    batch = dict(spans=spans, index=index, values=values, gamma=0.9, lam=0.95, norm_adv_by_std_in_grpo=True)
    assert set(ESTIMATORS) == {"reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo", "rloo", "gae"}
    expected = {
        "reinforce_plus_plus": reinforce_plus_plus(rewards, mask, 0.9, spans=spans),
        "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline(rewards, mask, index, spans=spans),
        "grpo": grpo(rewards, mask, index, spans=spans),
        "rloo": rloo(rewards, mask, index, spans=spans),
        "gae": gae(rewards, values, mask, 0.9, 0.95, spans=spans),
    }
    for name, (advantages, returns) in expected.items():
        got_advantages, got_returns = get_estimator(name)(rewards, mask, **batch)
        assert torch.equal(got_advantages, advantages) and torch.equal(got_returns, returns), name
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'grpo'"):
        get_estimator("ppo")
    with pytest.raises(ValueError, match="index must be an integer tensor of shape \\(6,\\).*got None"):
        get_estimator("grpo")(rewards, mask)
    with pytest.raises(ValueError, match="needs values"):
        get_estimator("gae")(rewards, mask)


@pytest.mark.parametrize("estimator", [grpo, rloo, reinforce_plus_plus_baseline])
def test_outcome_estimators_reject_bad_index_and_misplaced_rewards(estimator):
    rewards, spans, mask, index = outcome_batch()
    with pytest.raises(ValueError, match=r"index must be an integer tensor of shape \(6,\).*got torch.float32"):
        estimator(rewards, mask, index.float())
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        estimator(rewards, mask, index[:5])
    rewards[3, 0] = 1.0  # an OBSERVATION token
    with pytest.raises(ValueError, match="row 3, position 0 sits on a OBSERVATION"):
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


# --- KL penalties and the PPO loss ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_penalty_per_token_formulas_on_assistant_tokens_only(kind):
    logprob = torch.tensor([[-1.0, -0.5, -30.0, -2.0], [-0.1, -3.0, -0.2, float("nan")]])
    ref = torch.tensor([[-1.5, -0.5, -1.0, -0.1], [-0.3, -0.2, -0.1, -0.4]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    got = kl_penalty(logprob, ref, mask, kind)
    for row in range(2):
        for t in range(4):
            if mask[row, t] == 0:
                assert got[row, t] == 0
                continue
            log_ratio = float(logprob[row, t] - ref[row, t])
            if kind == "k1":
                expected = log_ratio
            elif kind == "k2":
                expected = 0.5 * log_ratio**2
            else:
                clamped = min(max(-log_ratio, -20.0), 20.0)
                expected = min(max(math.exp(clamped) - clamped - 1, -10.0), 10.0)
            assert got[row, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-6), (row, t)
    if kind in ("k3", "low_var_kl"):
        assert got[0, 2] == 10.0  # clamped like verl
    with pytest.raises(ValueError, match="unknown KL penalty kind 'k4'"):
        kl_penalty(logprob, ref, mask, "k4")


def ppo_reference(log_prob, old_log_prob, advantages, mask, low, high, mode):
    """Token by token: the clipped surrogate, then the aggregation."""
    rows = []
    clipped_count, kl_sum, tokens = 0, 0.0, 0
    for row in range(log_prob.shape[0]):
        losses = []
        for t in range(log_prob.shape[1]):
            if mask[row, t] == 0:
                continue
            log_ratio = min(max(float(log_prob[row, t] - old_log_prob[row, t]), -20.0), 20.0)
            ratio, advantage = math.exp(log_ratio), float(advantages[row, t])
            unclipped = -advantage * ratio
            clipped = -advantage * min(max(ratio, 1 - low), 1 + high)
            losses.append(max(unclipped, clipped))
            clipped_count += clipped > unclipped
            kl_sum += -log_ratio
            tokens += 1
        rows.append(losses)
    if mode == "token-mean":
        loss = sum(sum(r) for r in rows) / tokens
    elif mode == "seq-mean-token-sum":
        loss = sum(sum(r) for r in rows) / len(rows)
    else:
        non_empty = [r for r in rows if r]
        loss = sum(sum(r) / len(r) for r in non_empty) / len(non_empty)
    return loss, clipped_count / tokens, kl_sum / tokens


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("low, high", [(None, None), (0.1, 0.28)])
def test_ppo_clip_policy_loss_matches_token_loop(mode, low, high):
    generator = torch.Generator().manual_seed(4)
    log_prob = -torch.rand(4, 7, generator=generator, dtype=torch.float64) * 2
    old_log_prob = log_prob + torch.randn(4, 7, generator=generator, dtype=torch.float64) * 0.3
    advantages = torch.randn(4, 7, generator=generator, dtype=torch.float64)
    mask = (torch.rand(4, 7, generator=generator) < 0.7).double()
    mask[2] = 0  # a row without ASSISTANT tokens
    loss, metrics = ppo_clip_policy_loss(
        log_prob, old_log_prob, advantages, mask, clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=mode
    )
    expected_loss, clipfrac, approx_kl = ppo_reference(
        log_prob, old_log_prob, advantages, mask, low or 0.2, high or 0.2, mode
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert 0 < clipfrac < 1  # the case exercises clipping
    assert metrics["clipfrac"].item() == pytest.approx(clipfrac)
    assert metrics["approx_kl"].item() == pytest.approx(approx_kl, rel=1e-12)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'"):
        ppo_clip_policy_loss(log_prob, old_log_prob, advantages, mask, loss_agg_mode="sum")


def test_ppo_loss_gradient_flows_only_through_assistant_tokens():
    log_prob = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    loss, _ = ppo_clip_policy_loss(log_prob, torch.full((2, 3), -1.0), torch.ones(2, 3), mask)
    loss.backward()
    assert torch.equal(log_prob.grad != 0, mask.bool())
