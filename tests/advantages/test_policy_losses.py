"""Loss aggregation, KL penalties, the policy-loss registry (dual-clip PPO, GSPO, CISPO, GPG, REINFORCE),
the clipped value loss and the entropy loss, against plain references written here token by token
with Python floats, and their gradients against the formulas they should have."""

import math

import pytest
import torch

from advantages import (
    KL_PENALTY_MODES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    cispo_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    entropy_loss,
    get_policy_loss_fn,
    gpg_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    ppo_clip_policy_loss,
    register_policy_loss,
    reinforce_policy_loss,
)


def rand(shape, seed, scale=1.0, shift=0.0):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * scale + shift


def batch(seed=4, b=5, t=7, log_ratio_std=0.3):
    """log_prob, old_log_prob, advantages, mask (row 2 empty)."""
    generator = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(b, t, generator=generator, dtype=torch.float64) * 2
    old_log_prob = log_prob + torch.randn(b, t, generator=generator, dtype=torch.float64) * log_ratio_std
    advantages = torch.randn(b, t, generator=generator, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=generator) < 0.7).double()
    mask[2] = 0
    mask[:, 0] = torch.tensor([1.0, 1, 0, 1, 1][:b])  # every other row has a token
    return log_prob, old_log_prob, advantages, mask


def rows_of(values, mask) -> list[list[float]]:
    return [[float(values[r, c]) for c in range(values.shape[1]) if mask[r, c]] for r in range(values.shape[0])]


def agg_reference(rows, mode, t, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """verl's agg_loss, one row and one token at a time (rows: the masked token losses of each row)."""
    non_empty = [r for r in rows if r]
    tokens = batch_num_tokens if batch_num_tokens is not None else sum(len(r) for r in rows)
    seqs = global_batch_size if global_batch_size is not None else len(non_empty)
    if mode == "token-sum":
        return sum(sum(r) for r in rows) * dp_size
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / tokens * dp_size if tokens else math.nan
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in non_empty) / seqs * dp_size if seqs else math.nan
    seq_mean = sum(sum(r) for r in non_empty) / seqs * dp_size if seqs else math.nan
    if mode == "seq-mean-token-sum":
        return seq_mean
    return seq_mean / (t if loss_scale_factor is None else loss_scale_factor)  # seq-mean-token-sum-norm


# --- aggregation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_matches_row_loop_and_skips_empty_rows(mode):
    loss_mat = rand((6, 5), 0)
    mask = (rand((6, 5), 1) > 0).double()
    mask[3] = 0  # an empty row: not counted as a sequence (verl)
    mask[0, 0] = 1
    loss_mat_with_nan = torch.where(mask.bool(), loss_mat, float("nan"))  # off-mask values never leak
    got = aggregate_loss(loss_mat_with_nan, mask, mode)
    assert got.item() == pytest.approx(agg_reference(rows_of(loss_mat, mask), mode, 5), rel=1e-12)
    scaled = aggregate_loss(loss_mat, mask, mode, 1, 40, 9, 3.0)  # verl's positional order
    expected = agg_reference(rows_of(loss_mat, mask), mode, 5, 1, 40, 9, 3.0)
    assert scaled.item() == pytest.approx(expected, rel=1e-12)


def test_seq_mean_token_sum_divides_by_non_empty_rows_like_seq_mean_token_mean():
    loss_mat = torch.ones(6, 3)
    mask = torch.ones(6, 3)
    mask[5] = 0
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)  # 15 / 5, not 15 / 6
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_data_parallel_ranks_average_to_the_full_batch(mode):
    """Each rank passes the global counts and dp_size; the mean over ranks is the full-batch loss and
    the gradients are the full batch's (verl's test_seq_mean_token_sum_norm_dp_average_matches_full_batch,
    for every mode)."""
    full = rand((4, 3), 2).requires_grad_(True)
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 1]])
    full_loss = aggregate_loss(full, mask, mode, loss_scale_factor=6)
    full_loss.backward()
    parts = [full.detach()[:2].clone().requires_grad_(True), full.detach()[2:].clone().requires_grad_(True)]
    ranks = [aggregate_loss(part, part_mask, mode, 2, mask.sum(), 4, 6)
             for part, part_mask in zip(parts, (mask[:2], mask[2:]))]
    averaged = (ranks[0] + ranks[1]) / 2
    averaged.backward()
    torch.testing.assert_close(averaged, full_loss.detach())
    torch.testing.assert_close(torch.cat([p.grad for p in parts]), full.grad)


def test_aggregate_loss_errors_and_the_all_empty_batch():
    loss_mat, mask = torch.ones(2, 4), torch.zeros(2, 4)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert torch.isnan(aggregate_loss(loss_mat, mask, mode)), mode  # 0/0, as verl
        assert aggregate_loss(loss_mat, mask, mode, 2, 8, 4).item() == 0.0  # an empty rank of a larger batch
    assert aggregate_loss(loss_mat, mask, "token-sum").item() == 0.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'"):
        aggregate_loss(loss_mat, mask, "sum")
    with pytest.raises(ValueError, match="global_batch_size .* is required when dp_size > 1"):
        aggregate_loss(loss_mat, torch.ones(2, 4), "seq-mean-token-sum-norm", dp_size=2)
    with pytest.raises(ValueError, match="batch_num_tokens .* is required when dp_size > 1"):
        aggregate_loss(loss_mat, torch.ones(2, 4), "token-mean", dp_size=2)


# --- KL penalties ------------------------------------------------------------------------------------


def kl_reference(log_ratio: float, mode: str) -> float:
    if mode in ("kl", "k1"):
        return log_ratio
    if mode == "abs":
        return abs(log_ratio)
    if mode in ("mse", "k2"):
        return 0.5 * log_ratio**2
    clamped = min(max(-log_ratio, -20.0), 20.0)
    return min(max(math.exp(clamped) - clamped - 1, -10.0), 10.0)


def kl_grad_reference(log_ratio: float, mode: str) -> float:
    """d kl / d logprob of each mode (inside the clamps)."""
    return {"kl": 1.0, "k1": 1.0, "abs": math.copysign(1.0, log_ratio), "mse": log_ratio, "k2": log_ratio,
            "low_var_kl": 1 - math.exp(-log_ratio), "k3": 1 - math.exp(-log_ratio)}[mode]


@pytest.mark.parametrize("mode", [m for m in KL_PENALTY_MODES if m != "full"])
def test_kl_penalty_values_and_gradients_per_token(mode):
    logprob = torch.tensor([[-1.0, -0.5, -30.0, -2.0], [-0.1, -3.0, -0.2, float("nan")]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -0.4, -1.0, -0.1], [-0.3, -0.2, -0.1, -0.4]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    logprob.requires_grad_(True)
    got = kl_penalty(logprob, ref, mode, response_mask=mask)
    got.sum().backward()
    for row in range(2):
        for t in range(4):
            if mask[row, t] == 0:
                assert got[row, t] == 0 and logprob.grad[row, t] == 0
                continue
            log_ratio = float(logprob[row, t].detach() - ref[row, t])
            assert got[row, t].item() == pytest.approx(kl_reference(log_ratio, mode), rel=1e-12, abs=1e-12)
            clamped = mode in ("k3", "low_var_kl") and kl_reference(log_ratio, mode) == 10.0
            expected_grad = 0.0 if clamped else kl_grad_reference(log_ratio, mode)  # the clamp stops the gradient
            assert logprob.grad[row, t].item() == pytest.approx(expected_grad, rel=1e-12)
    if mode in ("k3", "low_var_kl"):
        assert got[0, 2] == 10.0 and logprob.grad[0, 2] == 0  # clamped like verl
    unmasked = kl_penalty(logprob.detach(), ref, mode)  # verl's call: no mask, every position
    assert unmasked[0, 3].item() == pytest.approx(kl_reference(-1.9, mode), rel=1e-9)


@pytest.mark.parametrize("name", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_kl_straight_through_keeps_the_value_and_takes_the_k2_gradient(name):
    """verl's test_kl_penalty_straight_through_value_matches_base and test_kl_penalty_k3_plus_uses_k2_gradient."""
    torch.manual_seed(0)
    logprob = torch.randn(4, 8, requires_grad=True)
    ref_logprob = torch.randn(4, 8)
    plus = kl_penalty(logprob, ref_logprob, name)
    torch.testing.assert_close(plus, kl_penalty(logprob, ref_logprob, name[:-1]))
    (grad_plus,) = torch.autograd.grad(plus.sum(), logprob)
    (grad_k2,) = torch.autograd.grad(kl_penalty(logprob, ref_logprob, "k2").sum(), logprob)
    torch.testing.assert_close(grad_plus, grad_k2)
    torch.testing.assert_close(grad_k2, (logprob - ref_logprob).detach())


def test_full_kl_is_the_exact_kl_over_the_vocabulary():
    logits = rand((2, 3, 5), 7)
    ref_logits = rand((2, 3, 5), 8)
    logits[0, 0, 1] = -float("inf")  # a token the policy never samples: 0 log 0 = 0
    logprob, ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    got = kl_penalty(logprob, ref, "full", response_mask=torch.tensor([[1.0, 1, 0], [1, 1, 1]]))
    for b in range(2):
        for t in range(3):
            p, q = logprob[b, t].exp().tolist(), ref[b, t].exp().tolist()
            expected = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0) if (b, t) != (0, 2) else 0.0
            assert got[b, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match=r"full KL needs \(b, t, v\)"):
        kl_penalty(logprob[..., 0], ref[..., 0], "full")
    for bad in ("full+", "k4", "k3++"):
        with pytest.raises(ValueError, match=f"unknown KL penalty '{re_escape(bad)}'"):
            kl_penalty(logprob, ref, bad)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# --- policy losses -------------------------------------------------------------------------------------


def ppo_reference(log_prob, old_log_prob, advantages, mask, low, high, clip_c, mode):
    """Dual-clip PPO token by token, then the aggregation."""
    rows, clipped_count, lower_count, kl_sum, tokens = [], 0, 0, 0.0, 0
    for row in range(log_prob.shape[0]):
        losses = []
        for t in range(log_prob.shape[1]):
            if mask[row, t] == 0:
                continue
            log_ratio = min(max(float(log_prob[row, t] - old_log_prob[row, t]), -20.0), 20.0)
            ratio, advantage = math.exp(log_ratio), float(advantages[row, t])
            unclipped = -advantage * ratio
            clipped = -advantage * min(max(ratio, 1 - low), 1 + high)
            loss = max(unclipped, clipped)
            if advantage < 0:
                lower_count += loss > -advantage * clip_c
                loss = min(loss, -advantage * clip_c)
            losses.append(loss)
            clipped_count += clipped > unclipped
            kl_sum += -log_ratio
            tokens += 1
        rows.append(losses)
    return agg_reference(rows, mode, log_prob.shape[1]), clipped_count / tokens, lower_count / tokens, kl_sum / tokens


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("low, high, clip_c", [(None, None, 3.0), (0.1, 0.28, 1.5)])
def test_dual_clip_ppo_matches_token_loop(mode, low, high, clip_c):
    log_prob, old_log_prob, advantages, mask = batch(log_ratio_std=1.5)  # wide ratios: the dual clip acts
    loss, metrics = ppo_clip_policy_loss(old_log_prob, log_prob, advantages, mask, mode,
                                         clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c)
    expected, clipfrac, clipfrac_lower, approx_kl = ppo_reference(
        log_prob, old_log_prob, advantages, mask, low or 0.2, high or 0.2, clip_c, mode)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert 0 < clipfrac < 1 and 0 < clipfrac_lower < 1  # both clips are exercised
    assert metrics["clipfrac"].item() == pytest.approx(clipfrac)
    assert metrics["clipfrac_lower"].item() == pytest.approx(clipfrac_lower)
    assert metrics["approx_kl"].item() == pytest.approx(approx_kl, rel=1e-12)


def test_ppo_argument_order_is_verls_and_bad_settings_raise():
    log_prob, old_log_prob, advantages, mask = batch()
    swapped, _ = ppo_clip_policy_loss(log_prob, old_log_prob, advantages, mask)
    loss, _ = ppo_clip_policy_loss(old_log_prob, log_prob, advantages, mask)
    assert loss.item() == pytest.approx(ppo_reference(log_prob, old_log_prob, advantages, mask, .2, .2, 3., "token-mean")[0])
    assert swapped.item() != pytest.approx(loss.item())
    with pytest.raises(ValueError, match="clip_ratio_c .* greater than 1, got 1.0"):
        ppo_clip_policy_loss(old_log_prob, log_prob, advantages, mask, clip_ratio_c=1.0)
    with pytest.raises(TypeError):
        ppo_clip_policy_loss(old_log_prob, log_prob, advantages, mask, cliprange=0.2)  # verl's deprecated name


def test_policy_loss_gradient_flows_only_through_assistant_tokens():
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    for name, fn in POLICY_LOSSES.items():
        log_prob = torch.full((2, 3), -1.0, requires_grad=True)
        loss, _ = fn(torch.full((2, 3), -1.05), log_prob, torch.ones(2, 3), mask)
        loss.backward()
        assert torch.equal(log_prob.grad != 0, mask.bool()), name


def gspo_reference(log_prob, old_log_prob, advantages, mask, low, high):
    """GSPO value: s_i = exp(mean of the row's log-ratios), clipped PPO surrogate, seq-mean-token-mean."""
    rows, clipped_count, tokens = [], 0, 0
    for row in range(log_prob.shape[0]):
        positions = [t for t in range(log_prob.shape[1]) if mask[row, t]]
        if not positions:
            rows.append([])
            continue
        seq = math.exp(min(sum(float(log_prob[row, t] - old_log_prob[row, t]) for t in positions) / len(positions), 10))
        losses = []
        for t in positions:
            advantage = float(advantages[row, t])
            unclipped, clipped = -advantage * seq, -advantage * min(max(seq, 1 - low), 1 + high)
            losses.append(max(unclipped, clipped))
            clipped_count += clipped > unclipped
            tokens += 1
        rows.append(losses)
    return agg_reference(rows, "seq-mean-token-mean", log_prob.shape[1]), clipped_count / tokens


def test_gspo_value_and_sequence_level_gradient():
    log_prob, old_log_prob, _, mask = batch(log_ratio_std=0.05)
    advantages = rand((5, 1), 9).expand(5, 7).clone()  # GSPO's setting: one advantage per sequence
    log_prob.requires_grad_(True)
    loss, metrics = gspo_policy_loss(old_log_prob, log_prob, advantages, mask, clip_ratio=0.003)
    expected, clipfrac = gspo_reference(log_prob.detach(), old_log_prob, advantages, mask, 0.003, 0.003)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert 0 < clipfrac < 1 and metrics["clipfrac"].item() == pytest.approx(clipfrac)
    assert metrics["clipfrac_lower"].item() == 0
    loss.backward()
    # the same objective written at the sequence level, differentiated through the mean of the row
    plain = log_prob.detach().clone().requires_grad_(True)
    tokens = mask.sum(-1)
    seq_ratio = torch.exp(((plain - old_log_prob) * mask).sum(-1) / tokens.clamp(min=1))
    adv = advantages[:, 0]
    per_row = torch.maximum(-adv * seq_ratio, -adv * seq_ratio.clamp(1 - 0.003, 1 + 0.003))
    (per_row[tokens > 0].sum() / (tokens > 0).sum()).backward()
    torch.testing.assert_close(log_prob.grad, plain.grad)


def test_cispo_value_and_gradient_keep_every_token():
    log_prob, old_log_prob, advantages, mask = batch(log_ratio_std=0.5)
    log_prob.requires_grad_(True)
    loss, metrics = cispo_policy_loss(old_log_prob, log_prob, advantages, mask, clip_ratio_low=0.1, clip_ratio_high=0.3)
    loss.backward()
    tokens, total, clipped = int(mask.sum()), 0.0, 0
    for row in range(5):
        for t in range(7):
            ratio = math.exp(float(log_prob[row, t].detach() - old_log_prob[row, t]))
            weight = min(max(ratio, 0.9), 1.3)
            advantage = float(advantages[row, t])
            if mask[row, t]:
                total += -weight * advantage * float(log_prob[row, t].detach())
                clipped += weight != ratio
                # d loss / d log_prob = -sg(clip(ratio)) * A / tokens: a clipped token still has a gradient
                assert log_prob.grad[row, t].item() == pytest.approx(-weight * advantage / tokens, rel=1e-12)
    assert loss.item() == pytest.approx(total / tokens, rel=1e-12)
    assert 0 < clipped < tokens and metrics["clipfrac"].item() == pytest.approx(clipped / tokens)


@pytest.mark.parametrize("fn, default_mode", [(gpg_policy_loss, "token-mean"), (reinforce_policy_loss, "seq-mean-token-sum")])
def test_gpg_and_reinforce_are_the_plain_policy_gradient(fn, default_mode):
    log_prob, old_log_prob, advantages, mask = batch()
    weights = rand((5, 7), 11).abs()
    loss, metrics = fn(old_log_prob, log_prob, advantages, mask, rollout_is_weights=weights)
    rows = rows_of(-advantages * log_prob * weights, mask)
    assert loss.item() == pytest.approx(agg_reference(rows, default_mode, 7), rel=1e-12)
    if fn is reinforce_policy_loss:
        kl = rows_of(old_log_prob - log_prob, mask)
        assert metrics["approx_kl"].item() == pytest.approx(sum(map(sum, kl)) / sum(map(len, kl)), rel=1e-12)
    else:
        assert metrics == {}


def test_policy_loss_registry():
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "cispo", "gpg", "reinforce"}
    assert get_policy_loss_fn("vanilla") is ppo_clip_policy_loss
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*'vanilla'"):
        get_policy_loss_fn("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("gpg")(reinforce_policy_loss)
    log_prob, old_log_prob, advantages, mask = batch()
    global_info = dict(dp_size=2, batch_num_tokens=40, global_batch_size=8)
    for name, fn in POLICY_LOSSES.items():  # one positional signature; settings are keywords
        loss, _ = fn(old_log_prob, log_prob, advantages, mask, "token-mean", global_batch_info=global_info)
        local, _ = fn(old_log_prob, log_prob, advantages, mask, "token-mean")
        assert loss.item() == pytest.approx(local.item() * mask.sum().item() * 2 / 40, rel=1e-12), name
        with pytest.raises(TypeError):
            fn(old_log_prob, log_prob, advantages, mask, global_batch_info={"dp": 2})


# --- value and entropy ----------------------------------------------------------------------------------


def test_clipped_value_loss_matches_token_loop():
    vpreds, returns, values = rand((4, 6), 12), rand((4, 6), 13), rand((4, 6), 14)
    mask = (rand((4, 6), 15) > -0.5).double()
    loss, clipfrac = clipped_value_loss(vpreds, returns, values, mask, 0.2, "seq-mean-token-mean")
    rows, clipped = [], 0
    for b in range(4):
        row = []
        for t in range(6):
            if not mask[b, t]:
                continue
            v, r, old = float(vpreds[b, t]), float(returns[b, t]), float(values[b, t])
            v_clip = min(max(v, old - 0.2), old + 0.2)
            row.append(max((v - r) ** 2, (v_clip - r) ** 2))
            clipped += (v_clip - r) ** 2 > (v - r) ** 2
        rows.append(row)
    assert loss.item() == pytest.approx(0.5 * agg_reference(rows, "seq-mean-token-mean", 6), rel=1e-12)
    assert clipfrac.item() == pytest.approx(clipped / mask.sum().item())


def test_entropy_loss_is_the_aggregated_softmax_entropy():
    logits = rand((2, 3, 4), 16, scale=3.0)
    mask = torch.tensor([[1.0, 1, 0], [0, 1, 1]])
    for b in range(2):
        for t in range(3):
            p = torch.softmax(logits[b, t], -1).tolist()
            expected = -sum(pi * math.log(pi) for pi in p)
            assert entropy_from_logits(logits)[b, t].item() == pytest.approx(expected, rel=1e-12)
    expected = sum(entropy_from_logits(logits)[mask.bool()].tolist()) / 4
    assert entropy_loss(logits, mask).item() == pytest.approx(expected, rel=1e-12)
