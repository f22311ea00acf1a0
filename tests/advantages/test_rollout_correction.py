"""The sampler/trainer mismatch correction (advantages/rollout_correction.py) against plain serial references
written here (a Python loop over each row's tokens, float64), its edge cases (a row without ASSISTANT tokens,
nothing on the mask, bf16 inputs, NaN off the mask, bad settings), no host sync, its composition with the PPO
loss, and the real verl 0.9.1 (``rollout_corr_helper``, in the side environment) for the modes where verl and
we agree.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from advantages import (
    ROLLOUT_RS_OPTIONS,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    correct_rollouts,
    masked_quantiles,
    mismatch_metrics,
    ppo_clip_policy_loss,
)
from masking import SpanKind
from tests.helpers.host_syncs import HostSyncs
from tests.helpers.reference_losses import ppo_token_loss

A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)
BOUND = 20.0


def spans_batch(seed: int, b: int = 6, t: int = 12) -> torch.Tensor:
    """``(b, t)`` spans: ASSISTANT/OBSERVATION runs then PAD; row 1 has no ASSISTANT token."""
    g = torch.Generator().manual_seed(seed)
    spans = torch.where(torch.rand(b, t, generator=g) < 0.7, A, O)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    spans[torch.arange(t) >= lengths[:, None]] = P
    spans[1] = torch.where(spans[1] == A, O, spans[1])
    return spans.to(torch.int8)


def logprob_pair(spans: torch.Tensor, seed: int, scale: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer and sampler logprobs, 0 off ASSISTANT tokens (as the Batch holds them), log-ratios ~ N(0, scale)."""
    g = torch.Generator().manual_seed(seed + 1)
    on = spans == A
    rollout = torch.where(on, -torch.rand(spans.shape, generator=g) * 3, 0.0)
    old = torch.where(on, rollout + scale * torch.randn(spans.shape, generator=g), 0.0)
    return old, rollout


# --- serial references ----------------------------------------------------------------------------------


def clamp(x: float) -> float:
    return min(max(x, -BOUND), BOUND)


def token_log_ratios(old, rollout, mask) -> list[list[tuple[int, float]]]:
    """Per row, ``(position, old - rollout)`` of each masked token, in float64."""
    rows = []
    for r in range(old.shape[0]):
        rows.append([(j, float(old[r, j]) - float(rollout[r, j])) for j in range(old.shape[1]) if mask[r, j]])
    return rows


def reference_raw_weights(old, rollout, mask, level) -> list[list[tuple[int, float]]]:
    rows = []
    for tokens in token_log_ratios(old, rollout, mask):
        if level == "token":
            rows.append([(j, math.exp(clamp(lr))) for j, lr in tokens])
        else:
            weight = math.exp(clamp(sum(lr for _, lr in tokens)))
            rows.append([(j, weight) for j, _ in tokens])
    return rows


def reference_correction(old, rollout, mask, rollout_is, cap, rollout_rs, lower, upper):
    """``(weights, loss_mask, frac_capped, frac_masked)`` of :func:`correct_rollouts`, token by token."""
    b, t = old.shape
    weights, keep = torch.zeros(b, t, dtype=torch.float64), torch.zeros(b, t, dtype=torch.float64)
    capped = masked = count = 0
    for r, tokens in enumerate(token_log_ratios(old, rollout, mask)):
        seq_log_ratio = sum(clamp(lr) for _, lr in tokens)
        for j, lr in tokens:
            count += 1
            raw = math.exp(clamp(lr)) if rollout_is == "token" else math.exp(clamp(sum(x for _, x in tokens)))
            if rollout_is != "off":
                weights[r, j] = min(raw, cap)
                capped += raw > cap
            tested = clamp(lr) if rollout_rs == "token" else seq_log_ratio
            rejected = rollout_rs != "off" and not (math.log(lower) <= tested <= math.log(upper))
            masked += rejected
            keep[r, j] = 0.0 if rejected else 1.0
    return weights, keep, capped / count, masked / count


def reference_quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def reference_mismatch(old, rollout, mask) -> dict[str, float]:
    lrs = [clamp(lr) for tokens in token_log_ratios(old, rollout, mask) for _, lr in tokens]
    ratios = [math.exp(lr) for lr in lrs]
    n = len(lrs)
    return {
        "mismatch/kl_k1": sum(-lr for lr in lrs) / n,
        "mismatch/kl_k3": sum(math.exp(lr) - 1 - lr for lr in lrs) / n,
        "mismatch/ratio_mean": sum(ratios) / n,
        "mismatch/ratio_min": min(ratios),
        "mismatch/ratio_max": max(ratios),
        **{f"mismatch/ratio_p{round(q * 100):02d}": reference_quantile(ratios, q) for q in (0.05, 0.5, 0.95)},
    }


def reference_statistics(old, rollout, mask, option) -> list[tuple[int, int, float]]:
    """verl's ``option`` (``level_k``) token by token: ``(row, position, statistic)`` of each masked token."""
    level, kind = option.rsplit("_", 1)
    statistics = {"k1": lambda lr: -lr, "k2": lambda lr: 0.5 * lr * lr, "k3": lambda lr: math.exp(lr) - 1 - lr}
    found = []
    for r, tokens in enumerate(token_log_ratios(old, rollout, mask)):
        values = [(j, statistics[kind](clamp(lr))) for j, lr in tokens]
        row = {"token": None, "seq_sum": sum(v for _, v in values), "seq_max": max((v for _, v in values), default=0),
               "seq_mean": sum(v for _, v in values) / max(1, len(values))}[level]
        found += [(r, j, v if row is None else row) for j, v in values]
    return found


def between(values: list[float], q: float) -> float:
    """A threshold halfway between two neighbouring distinct values near quantile ``q`` (never on a value)."""
    distinct = sorted(set(values))
    i = min(max(int(q * (len(distinct) - 1)), 0), len(distinct) - 2)
    return (distinct[i] + distinct[i + 1]) / 2


# --- against the references -----------------------------------------------------------------------------

LEVELS = ("off", "token", "sequence")


@pytest.mark.parametrize("rollout_rs", LEVELS)
@pytest.mark.parametrize("rollout_is", LEVELS)
@pytest.mark.parametrize("seed", [0, 1])
def test_correction_equals_the_serial_reference(seed, rollout_is, rollout_rs):
    spans = spans_batch(seed)
    old, rollout = logprob_pair(spans, seed, scale=0.4 if rollout_rs != "sequence" else 0.25)
    mask = (spans == A).float()
    cap, lower, upper = 1.3, 0.6, 1.5
    found = correct_rollouts(old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=cap, rollout_rs=rollout_rs,
                             rollout_rs_lower=lower, rollout_rs_upper=upper)
    weights, keep, frac_capped, frac_masked = reference_correction(old, rollout, mask, rollout_is, cap, rollout_rs,
                                                                    lower, upper)
    if rollout_is == "off":
        assert found.weights is None and frac_capped == 0
    else:
        torch.testing.assert_close(found.weights.double(), weights, rtol=1e-6, atol=0)
        assert 0 < frac_capped < 1  # the batch exercises the cap
    torch.testing.assert_close(found.loss_mask.double(), keep, rtol=0, atol=0)
    assert found.loss_mask.dtype == mask.dtype
    assert (rollout_rs == "off") == (frac_masked == 0) and frac_masked < 1  # rejection exercised when on
    expected = {**reference_mismatch(old, rollout, mask), "mismatch/frac_capped": frac_capped,
                "mismatch/frac_masked": frac_masked}
    assert set(found.metrics) == set(expected)
    for name, value in expected.items():
        assert float(found.metrics[name]) == pytest.approx(value, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("threshold", [1.5, "0.7_1.6"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_named_weights_equal_the_serial_reference(level, threshold):
    spans = spans_batch(3)
    old, rollout = logprob_pair(spans, 3, scale=0.3)
    mask = spans == A
    weights, metrics = compute_rollout_correction_weights(old - rollout, mask, level, threshold)
    upper = float(str(threshold).split("_")[-1])
    lower = float(str(threshold).split("_")[0]) if "_" in str(threshold) else None
    expected = torch.zeros(old.shape, dtype=torch.float64)
    high = total = 0
    for r, tokens in enumerate(reference_raw_weights(old, rollout, mask, level)):
        for j, raw in tokens:
            expected[r, j] = min(raw, upper) if lower is None else (raw if lower <= raw <= upper else 0.0)
            high, total = high + (raw > upper), total + 1
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=0)
    assert not weights.requires_grad and weights.dtype == torch.float32
    assert float(metrics["rollout_is_mean"]) == pytest.approx(float(expected.sum()) / total, rel=1e-6)
    if level == "token":
        assert float(metrics["rollout_is_ratio_fraction_high"]) == pytest.approx(high / total)
    normalised, extra = compute_rollout_correction_weights(old - rollout, mask, level, threshold, True)
    torch.testing.assert_close(normalised * extra["rollout_is_batch_norm_factor"], weights)


@pytest.mark.parametrize("option", ROLLOUT_RS_OPTIONS)
def test_verl_named_rejection_equals_the_serial_reference(option):
    spans = spans_batch(4)
    old, rollout = logprob_pair(spans, 4, scale=0.3)
    mask = (spans == A).to(torch.int64)  # verl's agent loop emits int64 masks
    statistics = reference_statistics(old, rollout, mask, option)
    values = [v for _, _, v in statistics]
    lower, upper = (between(values, 0.2), between(values, 0.8)) if option.endswith("k1") else (None, between(values, 0.6))
    spec = f"{math.exp(lower)}_{math.exp(upper)}" if option.endswith("k1") else str(upper)  # k1: ratio bounds
    kept, metrics = compute_rollout_rejection_mask(old - rollout, mask, option, spec)
    expected = torch.zeros(old.shape, dtype=torch.float64)
    for r, j, v in statistics:
        expected[r, j] = float((lower is None or v >= lower) and v <= upper)
    assert kept.dtype == torch.int64
    torch.testing.assert_close(kept.double(), expected, rtol=0, atol=0)
    rejected = float((mask - kept).sum()) / float(mask.sum())
    assert 0 < rejected < 1  # the thresholds cut somewhere
    assert float(metrics["rollout_rs_masked_fraction"]) == pytest.approx(rejected)
    assert float(metrics["rollout_rs_seq_masked_fraction"]) == pytest.approx(
        float(((mask - kept).sum(-1) > 0).double().mean()))


def test_chained_rejection_options_all_must_pass():
    spans = spans_batch(5)
    old, rollout = logprob_pair(spans, 5, scale=0.3)
    mask = spans == A
    both, _ = compute_rollout_rejection_mask(old - rollout, mask, "token_k1,seq_max_k3", "0.7_1.4,0.14")
    one, _ = compute_rollout_rejection_mask(old - rollout, mask, "token_k1", "0.7_1.4")
    other, _ = compute_rollout_rejection_mask(old - rollout, mask, "seq_max_k3", 0.14)
    assert torch.equal(both, one & other) and not torch.equal(both, one) and not torch.equal(both, other)


def test_quantiles_equal_torch_quantile_over_the_masked_values():
    g = torch.Generator().manual_seed(0)
    values, mask = torch.randn(7, 13, generator=g), torch.rand(7, 13, generator=g) < 0.4
    qs = (0.0, 0.05, 0.37, 0.5, 0.95, 1.0)
    expected = torch.quantile(values[mask], torch.tensor(qs))
    torch.testing.assert_close(masked_quantiles(values, mask, qs), expected)
    one = torch.zeros_like(mask)
    one[3, 4] = True
    assert masked_quantiles(values, one, qs).tolist() == [float(values[3, 4])] * len(qs)
    assert masked_quantiles(values, torch.zeros_like(mask)).isnan().all()


# --- edge cases -----------------------------------------------------------------------------------------


def test_a_row_without_assistant_tokens_gets_nothing_and_changes_nothing_else():
    spans = spans_batch(6)
    old, rollout = logprob_pair(spans, 6)
    mask = (spans == A).float()
    assert mask[1].sum() == 0
    settings = dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_rs="token", rollout_rs_lower=0.7)
    full = correct_rollouts(old, rollout, mask, **settings)
    rest = torch.tensor([0, 2, 3, 4, 5])
    without = correct_rollouts(old[rest], rollout[rest], mask[rest], **settings)
    assert full.weights[1].abs().sum() == 0 and full.loss_mask[1].sum() == 0
    torch.testing.assert_close(full.weights[rest], without.weights)
    torch.testing.assert_close(full.loss_mask[rest], without.loss_mask)
    for name, value in without.metrics.items():
        torch.testing.assert_close(full.metrics[name], value, msg=name)


def test_nothing_on_the_mask_gives_zero_weights_an_empty_loss_mask_and_nan_metrics():
    spans = torch.full((3, 5), O, dtype=torch.int8)
    old, rollout = torch.randn(3, 5), torch.randn(3, 5)
    mask = (spans == A).float()
    found = correct_rollouts(old, rollout, mask, rollout_is="token", rollout_rs="sequence")
    assert found.weights.abs().sum() == 0 and found.loss_mask.sum() == 0
    assert all(math.isnan(float(v)) for v in found.metrics.values()), found.metrics
    kept, metrics = compute_rollout_rejection_mask(old - rollout, mask, "seq_mean_k1", 2.0)
    assert kept.sum() == 0 and float(metrics["rollout_rs_seq_masked_fraction"]) == 0.0


def test_nan_and_huge_values_off_the_mask_never_leak():
    spans = spans_batch(7)
    old, rollout = logprob_pair(spans, 7)
    mask = (spans == A).float()
    clean = correct_rollouts(old, rollout, mask, rollout_is="sequence", rollout_rs="token")
    off = spans != A
    dirty = correct_rollouts(torch.where(off, math.nan, old), torch.where(off, -1e30, rollout), mask,
                             rollout_is="sequence", rollout_rs="token")
    torch.testing.assert_close(dirty.weights, clean.weights)
    torch.testing.assert_close(dirty.loss_mask, clean.loss_mask)
    for name, value in clean.metrics.items():
        torch.testing.assert_close(dirty.metrics[name], value, msg=name)


def test_huge_log_ratios_are_bounded_as_verl_bounds_them():
    mask = torch.ones(1, 3)
    old, rollout = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[-100.0, -1.0, 60.0]])
    found = correct_rollouts(old, rollout, mask, rollout_is="token", rollout_is_threshold=1e12)
    assert found.weights[0].tolist() == pytest.approx([math.exp(20.0), 1.0, math.exp(-20.0)], rel=1e-6)
    assert all(math.isfinite(float(v)) for v in found.metrics.values())


def test_bf16_inputs_are_computed_in_float32():
    spans = spans_batch(8)
    old, rollout = (x.to(torch.bfloat16) for x in logprob_pair(spans, 8))
    mask = (spans == A).float()
    found = correct_rollouts(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=1.4, rollout_rs="token")
    # the reference on the very bf16 values, in float64: only float32 rounding remains
    weights, keep, capped, masked = reference_correction(old.double(), rollout.double(), mask, "sequence", 1.4,
                                                         "token", 0.5, 2.0)
    assert found.weights.dtype == torch.float32
    torch.testing.assert_close(found.weights.double(), weights, rtol=1e-6, atol=0)
    torch.testing.assert_close(found.loss_mask.double(), keep, rtol=0, atol=0)
    expected = reference_mismatch(old.double(), rollout.double(), mask)
    for name, value in expected.items():
        assert float(found.metrics[name]) == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_bad_settings_raise_one_clear_error():
    old, rollout, mask = torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="unknown rollout_is 'tokens'"):
        correct_rollouts(old, rollout, mask, rollout_is="tokens")
    with pytest.raises(ValueError, match=r"0 < lower <= upper, got \[3.0, 2.0\]"):
        correct_rollouts(old, rollout, mask, rollout_rs="token", rollout_rs_lower=3.0)
    with pytest.raises(ValueError, match="unknown rollout_is 'geometric'"):
        compute_rollout_correction_weights(old, mask, "geometric")
    with pytest.raises(ValueError, match="invalid rollout_is_threshold 'two'"):
        compute_rollout_correction_weights(old, mask, "token", "two")
    with pytest.raises(ValueError, match="lower <= upper"):
        compute_rollout_correction_weights(old, mask, "token", "3_2")
    with pytest.raises(TypeError, match="not|must be"):
        compute_rollout_correction_weights(old, mask, "token", True)
    with pytest.raises(ValueError, match="invalid rollout_rs 'seq_max_k1'"):
        compute_rollout_rejection_mask(old, mask, "seq_max_k1", 1.0)
    with pytest.raises(ValueError, match="must be provided"):
        compute_rollout_rejection_mask(old, mask, "token_k2")
    with pytest.raises(ValueError, match="takes one upper bound"):
        compute_rollout_rejection_mask(old, mask, "token_k3", "0.1_0.2")
    with pytest.raises(ValueError, match="one threshold or one per option"):
        compute_rollout_rejection_mask(old, mask, "token_k1,token_k2", "2,0.1,0.3")


def test_no_host_sync():
    spans = spans_batch(9)
    old, rollout = logprob_pair(spans, 9)
    mask = (spans == A).float()
    with HostSyncs() as recorder:
        correct_rollouts(old, rollout, mask, rollout_is="sequence", rollout_rs="sequence")
        compute_rollout_correction_weights(old - rollout, mask, "token", 2.0, True)
        compute_rollout_correction_weights(old - rollout, mask, "sequence", "0.5_2.0", True)
        compute_rollout_rejection_mask(old - rollout, mask, ",".join(ROLLOUT_RS_OPTIONS), "2.0")
        mismatch_metrics(old, rollout, mask)
    assert recorder.seen == []


# --- composed with the PPO loss -------------------------------------------------------------------------


def test_weights_and_loss_mask_compose_with_the_dual_clip_ppo_loss_as_the_reference():
    """loss = sum over kept tokens of w_t * ppo_t / kept tokens, ppo_t the dual-clip PPO term (verl's order)."""
    spans = spans_batch(10)
    old, rollout = logprob_pair(spans, 10, scale=0.3)
    g = torch.Generator().manual_seed(11)
    on = spans == A
    log_prob = torch.where(on, old + 0.3 * torch.randn(spans.shape, generator=g), 0.0)
    advantages = torch.where(on, torch.randn(spans.shape, generator=g), 0.0)
    found = correct_rollouts(old, rollout, on.float(), rollout_is="token", rollout_is_threshold=1.2,
                             rollout_rs="token", rollout_rs_lower=0.6, rollout_rs_upper=1.6)
    loss, _ = ppo_clip_policy_loss(old, log_prob, advantages, found.loss_mask, rollout_is_weights=found.weights)
    total = kept = 0
    for r, tokens in enumerate(token_log_ratios(old, rollout, on)):
        for j, lr in tokens:
            rho = math.exp(lr)
            if not 0.6 <= rho <= 1.6:
                continue
            ratio, a = math.exp(float(log_prob[r, j]) - float(old[r, j])), float(advantages[r, j])
            total, kept = total + min(rho, 1.2) * ppo_token_loss(ratio, a), kept + 1
    assert 0 < kept < int(on.sum())
    assert float(loss) == pytest.approx(total / kept, rel=1e-5)


# --- the real verl --------------------------------------------------------------------------------------

VERL_SIDE = r"""
import json, sys
import torch
from verl.trainer.ppo import rollout_corr_helper as v
cases = json.loads(sys.stdin.read())
out = []
for case in cases:
    lr = torch.tensor(case["log_ratio"], dtype=torch.float32)
    mask = torch.tensor(case["mask"], dtype=torch.float32)
    old = torch.tensor(case["old"], dtype=torch.float32)
    roll = torch.tensor(case["rollout"], dtype=torch.float32)
    found = {"weights": {}, "rejection": {}}
    for key, (level, threshold, normalize) in case["weights"].items():
        w, m = v.compute_rollout_correction_weights(lr, mask, level, threshold, normalize)
        found["weights"][key] = {"weights": w.double().tolist(), "metrics": m}
    for option, threshold in case["rejection"].items():
        kept, m = v.compute_rollout_rejection_mask(lr, mask, option, threshold)
        found["rejection"][option] = {"mask": kept.double().tolist(), "metrics": m}
    found["offpolicy"] = v.compute_offpolicy_metrics(old, roll, mask)
    for level in ("token", "sequence"):
        w, m = v.compute_rollout_correction_weights(lr, mask, level, case["cap"])
        found[f"ours_{level}"] = w.double().tolist()
    out.append(found)
print(json.dumps(out))
"""

VERL_WEIGHTS = {  # key: (level, threshold, batch-normalise)
    "token_tis": ("token", 1.5, False), "token_tis_norm": ("token", 1.5, True),
    "token_icepop": ("token", "0.6_1.7", False), "sequence_tis": ("sequence", 1.5, False),
    "sequence_tis_norm": ("sequence", 1.5, True), "sequence_icepop": ("sequence", "0.5_2.0", False),
}
VERL_REJECTION = {"token_k1": "0.8_1.25", "token_k2": 0.02, "token_k3": "0.02", "seq_sum_k1": "0.5_2.0",
                  "seq_sum_k2": 0.1, "seq_sum_k3": 0.1, "seq_mean_k1": "0.85_1.1", "seq_mean_k2": 0.02,
                  "seq_mean_k3": 0.02, "seq_max_k2": 0.05, "seq_max_k3": 0.05, "token_k1,seq_max_k3": "0.7_1.4,0.05"}


def verl_cases() -> list[dict]:
    """Batches where every row has an ASSISTANT token (verl counts empty rows in its sequence fractions)."""
    cases = []
    for seed in range(3):
        spans = spans_batch(20 + seed)
        spans[1, 0] = A  # give row 1 a token
        old, rollout = logprob_pair(spans, 20 + seed, scale=0.3)
        mask = (spans == A).float()
        cases.append({"log_ratio": (old - rollout).tolist(), "mask": mask.tolist(), "old": old.tolist(),
                      "rollout": rollout.tolist(), "weights": VERL_WEIGHTS, "rejection": VERL_REJECTION, "cap": 1.5})
    return cases


@pytest.mark.integration
def test_against_the_real_verl_rollout_corr_helper():
    """verl's functions run in the verl 0.9.1 side environment on the same inputs (JSON on stdin)."""
    from tests.helpers.side_envs import ROOT, side_python

    cases = verl_cases()
    done = subprocess.run([str(side_python("verl-0.9.1")), "-c", VERL_SIDE], cwd=ROOT, input=json.dumps(cases),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for case, theirs in zip(cases, results):
        compare_with_verl(case, theirs)


def compare_with_verl(case: dict, theirs: dict) -> None:
    log_ratio, mask = torch.tensor(case["log_ratio"]), torch.tensor(case["mask"])
    old, rollout = torch.tensor(case["old"]), torch.tensor(case["rollout"])
    for key, (level, threshold, normalize) in VERL_WEIGHTS.items():
        weights, metrics = compute_rollout_correction_weights(log_ratio, mask, level, threshold, normalize)
        torch.testing.assert_close(weights.double(), torch.tensor(theirs["weights"][key]["weights"], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-7, msg=key)
        for name, value in metrics.items():
            assert float(value) == pytest.approx(theirs["weights"][key]["metrics"][name], rel=1e-6, abs=1e-7), (key, name)
    for option, threshold in VERL_REJECTION.items():
        kept, metrics = compute_rollout_rejection_mask(log_ratio, mask, option, threshold)
        assert kept.tolist() == theirs["rejection"][option]["mask"], option
        for name, value in metrics.items():
            assert float(value) == pytest.approx(theirs["rejection"][option]["metrics"][name], rel=1e-6), (option, name)
    ours = mismatch_metrics(old, rollout, mask)
    assert float(ours["mismatch/kl_k1"]) == pytest.approx(theirs["offpolicy"]["kl"], rel=1e-5, abs=1e-7)
    assert float(ours["mismatch/kl_k3"]) == pytest.approx(theirs["offpolicy"]["k3_kl"], rel=1e-5, abs=1e-7)
    for level in ("token", "sequence"):  # the trainer's TIS is verl's with a number as threshold
        found = correct_rollouts(old, rollout, mask, rollout_is=level, rollout_is_threshold=case["cap"])
        torch.testing.assert_close(found.weights.double(), torch.tensor(theirs[f"ours_{level}"], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-7)
    # the trainer's rejection with [l, u], l = 1/u, is verl's token_k1 / seq_sum_k1 "l_u" (verl's k1 is -log rho)
    for level, option in (("token", "token_k1"), ("sequence", "seq_sum_k1")):
        lower, upper = (float(x) for x in VERL_REJECTION[option].split("_"))
        found = correct_rollouts(old, rollout, mask, rollout_rs=level, rollout_rs_lower=lower, rollout_rs_upper=upper)
        assert found.loss_mask.tolist() == theirs["rejection"][option]["mask"], level
