"""verl's own CPU test cases for the functions we share a name and meaning with, ported onto
``advantages`` (inputs and expected values as in verl: tests/training/ppo/test_core_algos_on_cpu.py,
test_reinforce_pp_multiturn_on_cpu.py, test_loss_aggregation_on_cpu.py), the verl plugin called
exactly as verl's ``compute_advantage`` calls an estimator, and the TRL recipe on tensors built as
TRL's GRPOTrainer builds them. verl itself cannot be installed next to this project (docs/verl.md);
``agent-loop verl-check`` runs the same comparisons against a real verl.

The KL straight-through cases (test_kl_penalty_straight_through_*) are ported in test_policy_losses.py.
"""

import importlib.util
import math
import random
from enum import Enum
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from advantages import (
    ESTIMATORS,
    aggregate_loss,
    cispo_policy_loss,
    gae,
    get_adv_estimator_fn,
    grpo,
    ppo_clip_policy_loss,
    register_adv_est,
    reinforce_plus_plus,
    rloo,
)
from agent_loop.integrations import verl as verl_plugin
from agent_loop.integrations.trl import from_trl_batch
from masking.spans import SpanKind
from tests.helpers.reference_returns import discounted_returns_ref, whiten_ref

A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)


# --- TestRegisterAdvEst -------------------------------------------------------------------------------


@pytest.fixture
def scratch_names():
    """Names registered by a test are removed afterwards (verl's setUp/tearDown clear the registry)."""
    before = set(ESTIMATORS)
    yield
    for name in set(ESTIMATORS) - before:
        del ESTIMATORS[name]


def test_register_new_function_and_enum(scratch_names):
    @register_adv_est("test_estimator")
    def test_fn(token_level_rewards, response_mask):
        return token_level_rewards, token_level_rewards

    class AdvantageEstimator(Enum):
        TEST = "test_enum_estimator"

    @register_adv_est(AdvantageEstimator.TEST)
    def test_enum_fn(token_level_rewards, response_mask):
        return response_mask, response_mask

    assert ESTIMATORS["test_estimator"].fn is test_fn
    assert ESTIMATORS["test_enum_estimator"].fn is test_enum_fn
    assert get_adv_estimator_fn(AdvantageEstimator.TEST) is test_enum_fn


def mock_test_fn(token_level_rewards, response_mask):
    return token_level_rewards, token_level_rewards


def test_duplicate_registration(scratch_names):
    register_adv_est("duplicate_test")(mock_test_fn)
    register_adv_est("duplicate_test")(mock_test_fn)  # the same function twice: fine
    assert ESTIMATORS["duplicate_test"].fn is mock_test_fn

    @register_adv_est("conflict_test")
    def test_fn1(token_level_rewards, response_mask):
        return token_level_rewards, token_level_rewards

    with pytest.raises(ValueError):

        @register_adv_est("conflict_test")
        def test_fn2(token_level_rewards, response_mask):
            return token_level_rewards, token_level_rewards


def test_decorator_preserves_function_and_counts(scratch_names):
    def test_fn():
        return "original"

    assert register_adv_est("preserve_test")(test_fn)() == "original"
    count = len(ESTIMATORS)
    register_adv_est("estimator1")(lambda token_level_rewards, response_mask: None)
    register_adv_est("estimator2")(lambda token_level_rewards, response_mask: None)
    assert len(ESTIMATORS) == count + 2


def test_get_adv_estimator_fn_names():
    assert get_adv_estimator_fn("gae") is gae
    with pytest.raises(ValueError, match="invalid_name"):  # verl: "Unknown advantage estimator simply: ..."
        get_adv_estimator_fn("invalid_name")
    with pytest.raises(ValueError):
        get_adv_estimator_fn("GAE")  # case-sensitive


# --- test_multi_turn_compute_gae_advantage_return --------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_multi_turn_gae_ignores_values_on_observation_tokens(seed):
    """Values on masked (observation) tokens must not change anything (verl PR #2337)."""
    rng = random.Random(seed)
    gamma, lam = rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0)
    rewards = torch.tensor([[0.0, 0.0, 0.1, 0.1, 0.1, 0.0, 0.0, 0.1, 1.0, 0.0, 0.0]])
    values1 = torch.tensor([[rng.uniform(-100.0, 100.0), rng.random(), 4.0, 5.0, 6.0, rng.uniform(-100.0, 0),
                             rng.random(), 7.0, 9.0, 0.0, 0.0]])
    values2 = torch.tensor([[rng.random(), rng.uniform(-100.0, 100.0), 4.0, 5.0, 6.0, rng.random(),
                             rng.uniform(0.0, 100.0), 7.0, 9.0, 0.0, 0.0]])
    response_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.float)
    adv1, ret1 = gae(rewards, values1, response_mask, gamma, lam)
    adv2, ret2 = gae(rewards, values2, response_mask, gamma, lam)
    assert torch.equal(adv1, adv2)
    assert torch.equal(ret1 * response_mask, ret2 * response_mask)


# --- GRPO / RLOO against verl's loops (test_*_and_vectorized_equivalence) ---------------------------------


def verl_group_loop(scores: torch.Tensor, index, kind: str, epsilon: float = 1e-6, norm: bool = True) -> torch.Tensor:
    """verl's compute_grpo/rloo_outcome_advantage loops over ``index[i]`` dict keys, per row."""
    id2score: dict = {}
    for i in range(scores.shape[0]):
        id2score.setdefault(index[i], []).append(scores[i])
    out = scores.clone()
    for i in range(scores.shape[0]):
        group = torch.stack(id2score[index[i]])
        n = len(group)
        if kind == "grpo":
            mean, std = (group.mean(), group.std()) if n > 1 else (torch.tensor(0.0), torch.tensor(1.0))
            out[i] = (scores[i] - mean) / (std + epsilon) if norm else scores[i] - mean
        elif n > 1:  # rloo
            out[i] = scores[i] * n / (n - 1) - group.mean() * n / (n - 1)
    return out


def make_group_index(batch_size: int, num_groups: int) -> np.ndarray:
    counts = [2] * num_groups
    for _ in range(batch_size - 2 * num_groups):
        counts[random.randrange(num_groups)] += 1
    index = [gid for gid, count in enumerate(counts) for _ in range(count)]
    random.shuffle(index)
    return np.asarray(index, dtype=np.int64)


def rand_mask(batch_size: int, seq_len: int) -> torch.Tensor:
    mask = torch.randint(0, 2, (batch_size, seq_len), dtype=torch.int64).float()
    mask[(mask.sum(dim=-1) == 0).nonzero(as_tuple=True)[0], -1] = 1.0
    return mask


@pytest.mark.parametrize("batch_size,seq_len,num_groups,seed", [(64, 128, 5, 0), (128, 256, 8, 1), (512, 512, 10, 2)])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_group_estimators_match_verls_loop(kind, batch_size, seq_len, num_groups, seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    index = make_group_index(batch_size, num_groups)
    response_mask = rand_mask(batch_size, seq_len)
    token_level_rewards = torch.randn(batch_size, seq_len, dtype=torch.float32) * response_mask
    expected = verl_group_loop(token_level_rewards.sum(-1), index, kind).unsqueeze(-1) * response_mask
    adv, ret = (grpo if kind == "grpo" else rloo)(token_level_rewards, response_mask, index)
    assert adv.shape == ret.shape == (batch_size, seq_len)
    assert torch.allclose(adv, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(adv, ret)


def test_grpo_matches_verl_for_low_variance_rewards():
    token_level_rewards = torch.tensor([[1.0], [1.00001], [2.0], [2.00001]], dtype=torch.float32)
    response_mask = torch.ones_like(token_level_rewards)
    index = np.array(["prompt-a", "prompt-a", "prompt-b", "prompt-b"], dtype=object)
    expected = verl_group_loop(token_level_rewards.sum(-1), index, "grpo").unsqueeze(-1)
    adv, ret = grpo(token_level_rewards, response_mask, index)
    assert torch.allclose(adv, expected, rtol=1e-5, atol=1e-6) and torch.equal(adv, ret)
    unscaled = verl_group_loop(token_level_rewards.sum(-1), index, "grpo", norm=False).unsqueeze(-1)
    torch.testing.assert_close(grpo(token_level_rewards, response_mask, index, 1e-6, False)[0], unscaled)


# --- TestReinforcePPMultiTurn (test_reinforce_pp_multiturn_on_cpu.py) -------------------------------------


def rpp_returns(rewards, mask, gamma):
    return reinforce_plus_plus(rewards, mask, gamma)[1]


def test_observation_span_does_not_block_returns():
    compact_mask, compact_rewards = torch.ones(1, 4), torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    expanded_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    expanded_rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    compact = rpp_returns(compact_rewards, compact_mask, 1.0)
    expanded = rpp_returns(expanded_rewards, expanded_mask, 1.0)
    torch.testing.assert_close(compact[compact_mask.bool()], expanded[expanded_mask.bool()])


def test_observation_positions_have_zero_returns():
    returns = rpp_returns(torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]), torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]), 1.0)
    assert returns[0, 2].item() == 0.0 and returns[0, 3].item() == 0.0


def test_trailing_padding_stays_zero():
    returns = rpp_returns(torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]]), 1.0)
    assert returns[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_gamma_discount_across_observation_span():
    returns = rpp_returns(torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0]]), torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]]), 0.5)
    assert returns[0, 4].item() == 2.0
    assert returns[0, 2].item() == 0.0 and returns[0, 3].item() == 0.0
    assert returns[0, 1].item() == pytest.approx(1.0)
    assert returns[0, 0].item() == pytest.approx(0.5)


def test_batch_dimension():
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    returns = rpp_returns(rewards, mask, 1.0)
    assert returns[0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert returns[1].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_no_observation_tokens_unchanged():
    returns = rpp_returns(torch.tensor([[0.0, 0.0, 0.0, 0.0, 3.0]]), torch.ones(1, 5), 1.0)
    assert returns[0].tolist() == [3.0] * 5


# --- test_loss_aggregation_on_cpu.py ---------------------------------------------------------------------


def drgrpo_oracle(loss_mat, loss_mask, normalizer, batch_size):
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    seq_mask = torch.sum(loss_mask, dim=-1) > 0
    return torch.sum(seq_losses[seq_mask]) / (batch_size * normalizer)


LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
LOSS_MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_seq_mean_token_sum_norm_matches_single_dp_oracle():
    loss = aggregate_loss(LOSS_MAT, LOSS_MASK, loss_agg_mode="seq-mean-token-sum-norm")
    torch.testing.assert_close(loss, drgrpo_oracle(LOSS_MAT, LOSS_MASK, normalizer=4, batch_size=3))


def test_seq_mean_token_sum_norm_respects_loss_scale_factor():
    loss = aggregate_loss(LOSS_MAT, LOSS_MASK, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=10)
    torch.testing.assert_close(loss, drgrpo_oracle(LOSS_MAT, LOSS_MASK, normalizer=10, batch_size=3))


def test_seq_mean_token_sum_norm_gradient_scale():
    loss_mat = LOSS_MAT.clone().requires_grad_(True)
    aggregate_loss(loss_mat, LOSS_MASK, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8).backward()
    torch.testing.assert_close(loss_mat.grad, LOSS_MASK / (3 * 8))


def test_seq_mean_token_sum_norm_dp_average_matches_full_batch():
    full_loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]],
                                 requires_grad=True)
    full_loss_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    full_loss = aggregate_loss(full_loss_mat, full_loss_mask, loss_agg_mode="seq-mean-token-sum-norm",
                               loss_scale_factor=6)
    full_loss.backward()
    rank0 = full_loss_mat[:2].detach().clone().requires_grad_(True)
    rank1 = full_loss_mat[2:].detach().clone().requires_grad_(True)
    losses = [aggregate_loss(mat, mask, loss_agg_mode="seq-mean-token-sum-norm", dp_size=2, global_batch_size=4,
                             loss_scale_factor=6) for mat, mask in ((rank0, full_loss_mask[:2]), (rank1, full_loss_mask[2:]))]
    averaged = (losses[0] + losses[1]) / 2
    averaged.backward()
    torch.testing.assert_close(averaged, full_loss.detach())
    torch.testing.assert_close(torch.cat([rank0.grad, rank1.grad], dim=0), full_loss_mat.grad)


def test_seq_mean_token_sum_norm_rejects_missing_global_batch_for_dp():
    with pytest.raises(ValueError, match="global_batch_size .*is required"):
        aggregate_loss(torch.ones(2, 4), torch.ones(2, 4), loss_agg_mode="seq-mean-token-sum-norm", dp_size=2)


def test_seq_mean_token_sum_norm_empty_rows_are_explicit():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    loss_mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    fallback = aggregate_loss(loss_mat, loss_mask, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=3)
    explicit = aggregate_loss(loss_mat, loss_mask, loss_agg_mode="seq-mean-token-sum-norm", global_batch_size=3,
                              loss_scale_factor=3)
    torch.testing.assert_close(fallback, drgrpo_oracle(loss_mat, loss_mask, normalizer=3, batch_size=2))
    torch.testing.assert_close(explicit, drgrpo_oracle(loss_mat, loss_mask, normalizer=3, batch_size=3))
    assert not torch.isclose(fallback, explicit)


# --- TestComputePolicyLossCispo ----------------------------------------------------------------------------


def test_cispo_output_defaults_and_differs_from_vanilla():
    torch.manual_seed(0)
    old_log_prob, log_prob, advantages = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    response_mask = torch.ones(2, 4)
    loss, metrics = cispo_policy_loss(old_log_prob, log_prob, advantages, response_mask)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert set(metrics) == {"clipfrac", "clipfrac_lower", "approx_kl"}
    vanilla, _ = ppo_clip_policy_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=0.2, clip_ratio_c=3.0)
    assert torch.isfinite(vanilla) and not torch.isclose(loss, vanilla)


# --- the verl plugin, called as verl 0.9's compute_advantage calls a registered estimator ------------------


def verl_reinforce_plus_plus_loop(rewards, mask, gamma):
    """verl's compute_reinforce_plus_plus_outcome_advantage after PR #7300, literally."""
    returns = torch.zeros_like(rewards)
    running = 0
    for t in reversed(range(rewards.shape[1])):
        new_running = rewards[:, t] + gamma * running
        returns[:, t] = new_running * mask[:, t]
        running = new_running * mask[:, t] + running * (1 - mask[:, t])
    kept = returns[mask.bool()]
    advantages = (returns - kept.mean()) * torch.rsqrt(kept.var() + 1e-8) * mask
    return advantages, returns


def verl_gae_loop(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return after PR #2337, literally (advantages not masked)."""
    nextvalues, lastgaelam, reversed_advantages = 0, 0, []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        reversed_advantages.append(lastgaelam)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    returns = advantages + values
    kept = advantages[mask.bool()]
    return (advantages - kept.mean()) * torch.rsqrt(kept.var() + 1e-8), returns


def verl_multi_turn_batch():
    """A verl agent-loop batch: left-padded prompts, right-padded responses with a tool result inside."""
    prompts = torch.tensor([[0, 0, 11, 12], [0, 13, 14, 15], [16, 17, 18, 19]])
    responses = torch.tensor([[21, 22, 31, 32, 23, 24, 0, 0],
                              [25, 26, 27, 0, 0, 0, 0, 0],
                              [28, 33, 34, 35, 29, 30, 36, 37]])
    prompt_attention = (prompts != 0).long()
    response_attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [1] * 8])
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 1, 1, 1, 1]])
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    rewards = torch.zeros(3, 8, dtype=torch.float64)
    rewards[0, 5], rewards[1, 2], rewards[2, 7] = 1.0, -0.5, 2.0
    return responses, attention_mask, response_mask, rewards


def test_plugin_estimators_take_verls_call_and_match_verls_loops():
    responses, attention_mask, response_mask, rewards = verl_multi_turn_batch()
    mask = response_mask.double()
    config = SimpleNamespace(gamma=0.9, lam=0.95, norm_adv_by_std_in_grpo=True)  # verl's AlgoConfig fields
    uids = np.array(["a", "a", "b"], dtype=object)
    advantages, returns = verl_plugin.reinforce_plus_plus_for_verl(
        token_level_rewards=rewards, response_mask=mask, config=config, index=uids,
        reward_baselines=torch.zeros(3))  # everything verl passes
    expected_advantages, expected_returns = verl_reinforce_plus_plus_loop(rewards, mask, 0.9)
    torch.testing.assert_close(returns, expected_returns)
    torch.testing.assert_close(advantages, expected_advantages)
    values = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="replace_builtin_gae=True"):
        verl_plugin.gae_for_verl(token_level_rewards=rewards, response_mask=mask, config=config, index=uids)
    advantages, returns = verl_plugin.gae_for_verl(token_level_rewards=rewards, response_mask=mask, config=config,
                                                   values=values)
    expected_advantages, expected_returns = verl_gae_loop(rewards, values, mask, 0.9, 0.95)
    torch.testing.assert_close(advantages, expected_advantages * mask)  # verl leaves values off the mask
    torch.testing.assert_close(returns, expected_returns * mask)
    dropin = verl_plugin.compute_gae_advantage_return(rewards, values, mask, 0.9, 0.95)
    assert all(torch.equal(a, b) for a, b in zip(dropin, (advantages, returns)))


def verl_batch_ending_in_a_tool_output():
    """verl_multi_turn_batch with row 0's reward on its tool output (position 3, a 0 of the mask), as
    verl's reward manager puts it on the last valid token of a trajectory that ends in a tool call."""
    responses, attention_mask, response_mask, rewards = verl_multi_turn_batch()
    rewards[0, 5], rewards[0, 3] = 0.0, 1.0
    return responses, attention_mask, response_mask.double(), rewards


@pytest.fixture
def plugin_defaults(monkeypatch):
    """The plugin as a fresh process sees it: no register() call yet, no policy in the environment."""
    monkeypatch.setitem(verl_plugin._settings, "observation_reward", None)
    monkeypatch.delenv(verl_plugin.OBSERVATION_REWARD_ENV, raising=False)


def test_plugin_drops_observation_rewards_as_verl_and_logs_the_count(plugin_defaults, caplog):
    """Called exactly as verl's compute_advantage calls a registered estimator (and, for
    replace_builtin_gae, as its gae branch calls compute_gae_advantage_return): by default the
    reward on the observation token is dropped, value for value as verl's own loops, and logged."""
    _, _, mask, rewards = verl_batch_ending_in_a_tool_output()
    config = SimpleNamespace(gamma=0.9, lam=0.95, norm_adv_by_std_in_grpo=True)
    values = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    before = verl_plugin.observation_reward_count()
    with caplog.at_level("WARNING", logger="agent_loop.integrations.verl"):
        advantages, returns = verl_plugin.reinforce_plus_plus_for_verl(
            token_level_rewards=rewards, response_mask=mask, config=config, index=np.array(["a", "a", "b"], dtype=object),
            reward_baselines=torch.zeros(3))
        gae_advantages, gae_returns = verl_plugin.compute_gae_advantage_return(
            token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.95)
    expected_advantages, expected_returns = verl_reinforce_plus_plus_loop(rewards, mask, 0.9)  # verl drops it
    torch.testing.assert_close(returns, expected_returns)
    torch.testing.assert_close(advantages, expected_advantages)
    assert returns[0].abs().sum() == 0  # row 0's only reward was the dropped one
    expected_gae, expected_gae_returns = verl_gae_loop(rewards, values, mask, 0.9, 0.95)
    torch.testing.assert_close(gae_advantages, expected_gae * mask)
    torch.testing.assert_close(gae_returns, expected_gae_returns * mask)
    assert verl_plugin.observation_reward_count() == before + 2
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "agent_loop_reinforce_plus_plus: 1 reward(s) on observation tokens dropped, as verl does (observation_reward='drop')",
        "gae: 1 reward(s) on observation tokens dropped, as verl does (observation_reward='drop')",
    ]
    caplog.clear()
    clean = verl_multi_turn_batch()[3]
    verl_plugin.reinforce_plus_plus_for_verl(token_level_rewards=clean, response_mask=mask, config=config)
    assert caplog.records == [] and verl_plugin.observation_reward_count() == before + 2  # nothing to log


def test_plugin_moves_or_raises_on_observation_rewards(plugin_defaults, monkeypatch):
    _, _, mask, rewards = verl_batch_ending_in_a_tool_output()
    spans = torch.where(mask.bool(), A, O).to(torch.int8)  # as the plugin sees the mask: every 0 an observation
    config = SimpleNamespace(gamma=0.9, lam=0.95)
    moved = rewards.clone()
    moved[0, 1], moved[0, 3] = 1.0, 0.0  # the last assistant token before position 3
    expected_returns = discounted_returns_ref(moved, spans, 0.9)
    advantages, returns = verl_plugin.reinforce_plus_plus_for_verl(rewards, mask, config, observation_reward="move")
    torch.testing.assert_close(returns, expected_returns)
    torch.testing.assert_close(advantages, whiten_ref(expected_returns, spans))
    assert returns[0, 0].item() == pytest.approx(0.9)  # the reward now reaches the first turn
    monkeypatch.setenv(verl_plugin.OBSERVATION_REWARD_ENV, "move")  # how a process that registers on import is set
    torch.testing.assert_close(verl_plugin.reinforce_plus_plus_for_verl(rewards, mask, config)[1], expected_returns)
    with pytest.raises(ValueError, match="reward 1.0 at row 0, position 3 sits on an OBSERVATION token"):
        verl_plugin.reinforce_plus_plus_for_verl(rewards, mask, config, observation_reward="raise")
    monkeypatch.setenv(verl_plugin.OBSERVATION_REWARD_ENV, "keep")
    with pytest.raises(ValueError, match=r"observation_reward must be one of \('raise', 'move', 'drop'\), got 'keep'"):
        verl_plugin.reinforce_plus_plus_for_verl(rewards, mask, config)
    with pytest.raises(ValueError, match="got 'keep'"):  # checked before verl is imported or touched
        verl_plugin.register(observation_reward="keep")


def test_plugin_keeps_verls_meaning_for_few_assistant_tokens(plugin_defaults):
    """verl's masked_whiten raises below 2 masked tokens; so does the plugin (it validates)."""
    rewards = torch.zeros(2, 4, dtype=torch.float64)
    mask = torch.zeros(2, 4, dtype=torch.float64)
    mask[1, 0], rewards[1, 0] = 1.0, 1.0
    with pytest.raises(ValueError, match="need at least 2 unmasked tokens.*got 1"):
        verl_plugin.reinforce_plus_plus_for_verl(token_level_rewards=rewards, response_mask=mask, config=SimpleNamespace(gamma=1.0))


def test_plugin_register_needs_verl():
    if importlib.util.find_spec("verl") is None:  # this project's environment (docs/verl.md)
        with pytest.raises(ImportError, match=r"pip install 'agent-loop\[verl\]'"):
            verl_plugin.register()
    else:
        from verl.trainer.ppo import core_algos

        assert verl_plugin.register() == [verl_plugin.REINFORCE_PLUS_PLUS, verl_plugin.GAE,
                                          *verl_plugin.TURN_LEVEL_FOR_VERL]
        assert core_algos.get_adv_estimator_fn(verl_plugin.GAE) is verl_plugin.gae_for_verl


def test_spans_from_verl_batch():
    responses, attention_mask, response_mask, rewards = verl_multi_turn_batch()
    spans = verl_plugin.spans_from_verl_batch(responses, attention_mask, response_mask)
    assert spans.tolist() == [[A, A, O, O, A, A, P, P], [A, A, A, P, P, P, P, P], [A, O, O, O, A, A, A, A]]
    # PAD-aware carry-through returns on the verl batch, against the serial reference
    returns = reinforce_plus_plus(rewards, response_mask.double(), 0.9, spans=spans, whiten=False)[1]
    torch.testing.assert_close(returns, discounted_returns_ref(rewards, spans, 0.9))
    bad = response_mask.clone()
    bad[1, 5] = 1  # a response-mask 1 on padding
    with pytest.raises(ValueError, match="row 1, position 5 is marked sampled but holds no token"):
        verl_plugin.spans_from_verl_batch(responses, attention_mask, bad)
    gap = attention_mask.clone()
    gap[2, 4 + 2] = 0  # padding inside a response
    with pytest.raises(ValueError, match="row 2, position 1 .* but holds no token|PAD at row 2"):
        verl_plugin.spans_from_verl_batch(responses, gap, response_mask * (gap[:, 4:] > 0))
    with pytest.raises(ValueError, match=r"attention_mask \(3, 5\) must be \(b, prompt \+ t\)"):
        verl_plugin.spans_from_verl_batch(responses, attention_mask[:, :5], response_mask)


# --- the TRL recipe ------------------------------------------------------------------------------------------


def trl_pad(rows, value):
    """trl.trainer.utils.pad(..., padding_side="right") for 1-D rows."""
    width = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])


def trl_tool_batch():
    """As GRPOTrainer._generate_and_score_completions builds it with tools: per-completion id lists,
    completion_mask padded with 0, tool_mask (0 over tool-result tokens) padded with 1."""
    completion_ids = [[5, 6, 7, 90, 91, 92, 8, 9], [5, 6, 9], [5, 90, 91, 6, 93, 94, 95, 7, 9, 3]]
    tool_spans = [[(3, 6)], [], [(1, 3), (4, 7)]]
    tool_masks = []
    for ids, spans in zip(completion_ids, tool_spans):
        mask = [1] * len(ids)
        for start, end in spans:
            mask[start:end] = [0] * (end - start)
        tool_masks.append(mask)
    completion_mask = trl_pad([[1] * len(ids) for ids in completion_ids], 0)
    tool_mask = trl_pad(tool_masks, 1)
    rewards = torch.tensor([1.0, 0.0, 0.5])  # rewards_per_func summed with the reward weights, one per sequence
    return completion_mask, tool_mask, rewards


def test_trl_batch_to_spans_and_token_rewards():
    completion_mask, tool_mask, rewards = trl_tool_batch()
    spans, response_mask, token_level_rewards = from_trl_batch(completion_mask, tool_mask, rewards)
    assert spans.tolist() == [[A, A, A, O, O, O, A, A, P, P], [A, A, A, P, P, P, P, P, P, P],
                              [A, O, O, A, O, O, O, A, A, A]]
    assert torch.equal(response_mask, (completion_mask * tool_mask).float())  # TRL's loss mask
    assert token_level_rewards[0, 7] == 1.0 and token_level_rewards[2, 9] == 0.5
    assert token_level_rewards.sum(-1).tolist() == rewards.tolist()
    # tool tokens get no return; the reward reaches every earlier assistant turn without discount steps
    returns = reinforce_plus_plus(token_level_rewards, response_mask, 0.9, spans=spans, whiten=False)[1]
    torch.testing.assert_close(returns, discounted_returns_ref(token_level_rewards, spans, 0.9).float())
    assert returns[2, 0].item() == pytest.approx(0.5 * 0.9**4)  # 4 assistant tokens later; the 5 tool tokens cost no step
    spans_no_tools, mask_no_tools, _ = from_trl_batch(completion_mask, None, rewards)
    assert torch.equal(mask_no_tools, completion_mask.float())


def test_trl_batch_errors_name_the_row():
    completion_mask, tool_mask, rewards = trl_tool_batch()
    truncated = completion_mask.clone()
    truncated[1] = 0  # mask_truncated_completions zeroes the whole row
    with pytest.raises(ValueError, match="row 1: a nonzero reward has no ASSISTANT token"):
        from_trl_batch(truncated, tool_mask, torch.tensor([1.0, 2.0, 0.5]))
    spans, _, token_level_rewards = from_trl_batch(truncated, tool_mask, rewards)  # its reward is 0: fine
    assert spans[1].tolist() == [P] * 10 and token_level_rewards[1].abs().sum() == 0
    with pytest.raises(ValueError, match=r"one per sequence, shape \(3,\)"):
        from_trl_batch(completion_mask, tool_mask, rewards[:2])
    gap = completion_mask.clone()
    gap[0, 1] = 0
    with pytest.raises(ValueError, match="PAD at row 0, position 1 comes before a non-PAD token"):
        from_trl_batch(gap, tool_mask, rewards)
    assert math.isclose(float(from_trl_batch(completion_mask, tool_mask, torch.tensor([1, 0, 2]))[2].sum()), 3.0)
