"""Issue 28 item 7: every estimator with 0, 1 and 2 ASSISTANT tokens, validated and not, against the
serial references (tests/helpers/reference_returns.py and the group loops here), on the compiled and the
torch CPU paths. Off the mask the advantages are exactly 0 always; below 2 tokens the whitened
estimators raise when validated (as verl) and give exactly 0 everywhere when not
(advantages/stats.py). The Triton path's cases are in test_triton_kernels.py (interpreter)."""

import pytest
import torch

from advantages import (
    gae,
    grpo,
    masked_whiten,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    reinforce_plus_plus_ignore_mask,
    reinforce_plus_plus_reset_at_observation,
    rloo,
)
from advantages.native_scans import compiled_scans
from masking.spans import SpanKind
from tests.helpers.reference_returns import (
    discounted_returns_ref,
    gae_ref,
    returns_ignore_mask_ref,
    returns_reset_at_observation_ref,
    whiten_ref,
)

A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)
GAMMA, LAM = 0.9, 0.95
INDEX = [0, 0, 1]  # rows 0 and 1 one group, row 2 a group of one
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}
WHITENED = ("reinforce_plus_plus", "gae", "reinforce_plus_plus_baseline", "reset_at_observation", "ignore_mask")
ESTIMATORS = (*WHITENED, "grpo", "rloo")


def few_token_batch(tokens: int, dtype: torch.dtype):
    """(3, 6) spans with observations and trailing padding holding ``tokens`` ASSISTANT tokens (row 1
    first, then row 0; row 2 never has one), a nonzero reward on each, and critic values everywhere."""
    spans = torch.tensor([[O, O, O, O, P, P], [O, O, O, P, P, P], [O] * 6], dtype=torch.int8)
    rewards = torch.zeros(3, 6, dtype=torch.float64)
    for row, pos, reward in ((1, 0, -1.0), (0, 1, 2.0))[:tokens]:
        spans[row, pos] = A
        rewards[row, pos] = reward
    values = torch.linspace(-1.0, 1.5, 18, dtype=torch.float64).reshape(3, 6)
    return spans, rewards.to(dtype), values.to(dtype), (spans == A).to(dtype)


def serial_scores(rewards, spans, kind: str) -> torch.Tensor:
    """verl's outcome loops, one row at a time: each row's score minus its group's baseline
    (GRPO: over the std + 1e-6; RLOO: the leave-one-out mean), broadcast over ASSISTANT tokens."""
    scores = rewards.double().sum(-1).tolist()
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for row, score in enumerate(scores):
        group = [scores[i] for i, g in enumerate(INDEX) if g == INDEX[row]]
        n, mean = len(group), sum(group) / len(group)
        if kind == "grpo":
            std = (sum((s - mean) ** 2 for s in group) / (n - 1)) ** 0.5 if n > 1 else 1.0
            value = (score - (mean if n > 1 else 0.0)) / (std + 1e-6)
        elif kind == "rloo":
            value = (score - mean) * n / (n - 1) if n > 1 else score
        else:  # reinforce_plus_plus_baseline, before its whitening
            value = score - (mean if n > 1 else 0.0)
        out[row] = torch.where(spans[row] == A, torch.tensor(value, dtype=torch.float64), 0.0)
    return out


def reference(name: str, spans, rewards, values, mask, tokens: int):
    """(advantages, returns) of the serial references; whitened ones are 0 below 2 tokens."""
    whiten = whiten_ref if tokens >= 2 else (lambda x, s: torch.zeros(x.shape, dtype=torch.float64))
    if name == "reinforce_plus_plus":
        returns = discounted_returns_ref(rewards, spans, GAMMA)
    elif name == "reset_at_observation":
        returns = returns_reset_at_observation_ref(rewards, mask, GAMMA)
    elif name == "ignore_mask":
        returns = returns_ignore_mask_ref(rewards, GAMMA)
    elif name == "gae":
        advantages, returns = gae_ref(rewards, values, spans, GAMMA, LAM)
        return whiten(advantages, spans), returns
    elif name == "reinforce_plus_plus_baseline":
        advantages = whiten(serial_scores(rewards, spans, "baseline"), spans)
        return advantages, advantages
    else:
        advantages = serial_scores(rewards, spans, name)
        return advantages, advantages
    return whiten(returns, spans), returns


def call(name: str, spans, rewards, values, mask, validate: bool):
    keywords = dict(spans=spans, validate=validate)
    if name == "gae":
        return gae(rewards, values, mask, GAMMA, LAM, **keywords)
    functions = {"reinforce_plus_plus": reinforce_plus_plus, "reset_at_observation": reinforce_plus_plus_reset_at_observation,
                 "ignore_mask": reinforce_plus_plus_ignore_mask}
    if name in functions:
        return functions[name](rewards, mask, GAMMA, **keywords)
    grouped = {"grpo": grpo, "rloo": rloo, "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline}[name]
    return grouped(rewards, mask, INDEX, **keywords)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("tokens", [0, 1, 2])
@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_estimators_with_few_assistant_tokens(name, tokens, validate, dtype, scan_path):
    spans, rewards, values, mask = few_token_batch(tokens, dtype)
    if validate and tokens < 2 and name in WHITENED:  # verl's masked_var raises here too
        with pytest.raises(ValueError, match=f"need at least 2 unmasked tokens.*got {tokens}"):
            call(name, spans, rewards, values, mask, validate)
        return
    advantages, returns = call(name, spans, rewards, values, mask, validate)
    expected_advantages, expected_returns = reference(name, spans, rewards, values, mask, tokens)
    assert advantages.dtype == returns.dtype == dtype and advantages.shape == spans.shape
    assert torch.equal(advantages[spans != A], torch.zeros_like(advantages[spans != A]))  # exactly 0, never NaN
    torch.testing.assert_close(advantages.double(), expected_advantages, **TOLERANCE[dtype])
    torch.testing.assert_close(returns.double(), expected_returns, **TOLERANCE[dtype])
    if tokens < 2 and name in WHITENED:
        assert torch.equal(advantages, torch.zeros_like(advantages))  # on the mask too: no variance, no signal


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ESTIMATORS)
def test_unvalidated_estimators_are_zero_off_the_mask_for_any_batch(name, seed, scan_path):
    """Random masks (often with 0 or 1 ASSISTANT tokens in the whole batch), rewards and values on
    every position (off the mask too: unvalidated input), every estimator: exactly 0 off the mask,
    finite everywhere."""
    generator = torch.Generator().manual_seed(seed)
    b, t = (1, 1) if seed == 0 else (2 + seed, 3 + 2 * seed)
    density = (0.0, 0.05, 0.1, 0.5, 0.9, 1.0)[seed]
    mask = (torch.rand(b, t, generator=generator) < density).float()
    rewards, values = torch.randn(b, t, generator=generator), torch.randn(b, t, generator=generator)
    values[mask == 0] = float("nan")  # a critic's values off the mask are never read
    index = [row % 2 for row in range(b)]
    if name == "gae":
        advantages, _ = gae(rewards, values, mask, GAMMA, LAM, validate=False)
    elif name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        advantages, _ = {"grpo": grpo, "rloo": rloo, "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline}[name](
            rewards, mask, index, validate=False)
    else:
        functions = {"reinforce_plus_plus": reinforce_plus_plus, "reset_at_observation": reinforce_plus_plus_reset_at_observation,
                     "ignore_mask": reinforce_plus_plus_ignore_mask}
        advantages, _ = functions[name](rewards, mask, GAMMA, validate=False)
    assert torch.isfinite(advantages).all()
    assert torch.equal(advantages[mask == 0], torch.zeros_like(advantages[mask == 0]))


@pytest.mark.parametrize("tokens", [0, 1])
def test_masked_whiten_unchecked_below_two_tokens(tokens):
    """masked_whiten(check=False) below 2 set positions: 0 (and the mean back with shift_mean=False);
    check=True raises as verl's masked_var."""
    values = torch.tensor([[3.0, -2.0, 7.0], [float("nan"), 1.0, 4.0]])
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[0, :tokens] = True
    assert torch.equal(masked_whiten(values, mask, check=False), torch.zeros(2, 3))
    rescaled = masked_whiten(values, mask, shift_mean=False, check=False)
    assert torch.equal(rescaled, torch.where(mask, values, 0.0))  # the one value is its own mean
    with pytest.raises(ValueError, match=f"got {tokens}"):
        masked_whiten(values, mask)


def test_ablations_without_whitening_are_zero_off_the_mask():
    """whiten=False: the ablations' advantages are their returns on ASSISTANT tokens and 0 elsewhere;
    their returns keep verl's values off the mask (reproduced, for inspection)."""
    spans, rewards, values, mask = few_token_batch(2, torch.float64)
    for function, ref in ((reinforce_plus_plus_reset_at_observation, returns_reset_at_observation_ref(rewards, mask, GAMMA)),
                          (reinforce_plus_plus_ignore_mask, returns_ignore_mask_ref(rewards, GAMMA))):
        advantages, returns = function(rewards, mask, GAMMA, spans=spans, whiten=False)
        torch.testing.assert_close(returns, ref)
        torch.testing.assert_close(advantages, ref * mask)
        assert returns[spans != A].abs().sum() > 0  # the reproduced bug's values off the mask are kept


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_unvalidated_non_finite_rewards_stay_on_the_mask_in_the_compiled_loops(name, bad):
    """A NaN/inf reward on an ASSISTANT token (what validate=True rejects) poisons values on the
    mask (loudly: the loss turns NaN), never off it, on the compiled CPU path (and Triton: selects).
    The torch scans carry it through observations as ``0 * NaN`` (docs/verl.md): validate there."""
    assert compiled_scans() is not None
    spans, rewards, values, mask = few_token_batch(2, torch.float32)
    rewards[0, 1] = bad
    advantages, _ = call(name, spans, rewards, values, mask, validate=False)
    assert not torch.isfinite(advantages[mask.bool()]).all()
    assert torch.equal(advantages[spans != A], torch.zeros_like(advantages[spans != A]))


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_critic_values_never_leak_off_the_mask(bad, validate, scan_path):
    """GAE's values are not validated: a non-finite value on an ASSISTANT token poisons the
    advantages on the mask, never off it; values off the mask are never read."""
    spans, rewards, values, mask = few_token_batch(2, torch.float32)
    values[1, 0] = bad
    advantages, returns = gae(rewards, values, mask, GAMMA, LAM, spans=spans, validate=validate)
    assert not torch.isfinite(advantages[mask.bool()]).all()
    for out in (advantages, returns):
        assert torch.equal(out[spans != A], torch.zeros_like(out[spans != A]))
