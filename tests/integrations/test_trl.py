"""agent_loop.integrations.trl without TRL: NaN and truncated-row rules, advantages, against a serial reference.

The real TRL GRPOTrainer runs in tests/integrations/test_trl_real.py.
"""

import math
import random

import pytest
import torch
from reference_returns import ASSISTANT, PAD, discounted_returns_ref, whiten_ref
from trl_reference import from_trl_batch_ref

from agent_loop.integrations.trl import from_trl_batch, sequence_rewards, trl_advantages


def random_trl_batch(rng: random.Random, b: int = 6, t: int = 12, masked_rows=(), nan_row=None):
    """Lists as TRL builds them: completion_mask (right-padded with 0, a masked row all 0), tool_mask
    (0 on tool results, padded with 1), one reward per row (some 0)."""
    completion, tools, rewards = [], [], []
    for row in range(b):
        length = rng.randint(2, t)
        tool = [1] * t
        start = rng.randint(1, length - 1)
        for p in range(start, min(length - 1, start + rng.randint(0, 4))):
            tool[p] = 0  # a tool result: after the first sampled token, before the last
        mask = [0] * t if row in masked_rows else [1] * length + [0] * (t - length)
        completion.append(mask)
        tools.append(tool)
        rewards.append(rng.choice([0.0, 1.0, -0.5, rng.uniform(-2, 2)]))
    if nan_row is not None:
        rewards[nan_row] = math.nan
    return completion, tools, rewards


def tensors(completion, tools, rewards):
    return torch.tensor(completion), torch.tensor(tools), torch.tensor(rewards, dtype=torch.float32)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("masked", ["raise", "drop"])
def test_from_trl_batch_matches_the_serial_reference(seed, masked):
    rng = random.Random(seed)
    masked_rows = set(rng.sample(range(6), rng.randint(0, 2)))
    completion, tools, rewards = random_trl_batch(rng, masked_rows=masked_rows)
    try:
        expected = from_trl_batch_ref(completion, tools, rewards, masked)
    except ValueError as error:
        with pytest.raises(ValueError, match=str(error).split(":")[0] + ": a nonzero reward has no ASSISTANT"):
            from_trl_batch(*tensors(completion, tools, rewards), masked=masked)
        return
    spans, response_mask, token_level_rewards = from_trl_batch(*tensors(completion, tools, rewards), masked=masked)
    assert spans.tolist() == expected[0]
    assert torch.equal(response_mask, (torch.tensor(completion) * torch.tensor(tools)).float())  # TRL's loss mask
    torch.testing.assert_close(token_level_rewards.double(), torch.tensor(expected[1], dtype=torch.float64))


def test_a_truncated_row_raises_by_default_and_is_dropped_and_counted_on_request():
    completion, tools, rewards = random_trl_batch(random.Random(1), masked_rows={2})
    rewards[2] = 0.75
    with pytest.raises(ValueError, match=r"row 2: a nonzero reward has no ASSISTANT token .*masked='drop'"):
        from_trl_batch(*tensors(completion, tools, rewards))
    _, spans, metrics = trl_advantages(*tensors(completion, tools, rewards), masked="drop", gamma=0.9)
    assert spans[2].tolist() == [PAD] * 12
    assert int(metrics["masked_rows"]) == 1 and int(metrics["dropped_rewards"]) == 1
    rewards[2] = 0.0  # a masked row with reward 0 loses nothing: counted as masked, not as dropped
    _, _, metrics = trl_advantages(*tensors(completion, tools, rewards), masked="drop", gamma=0.9)
    assert int(metrics["masked_rows"]) == 1 and int(metrics["dropped_rewards"]) == 0
    with pytest.raises(ValueError, match="masked must be one of"):
        from_trl_batch(*tensors(completion, tools, rewards), masked="keep")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("masked", ["raise", "drop"])
def test_a_non_finite_reward_raises_naming_the_row(bad, masked):
    completion, tools, rewards = random_trl_batch(random.Random(3), masked_rows={4})
    rewards[4] = bad  # even on a masked row: "drop" is for truncation, not for broken rewards
    with pytest.raises(ValueError, match=rf"row 4: reward is {bad}; rewards must be finite"):
        from_trl_batch(*tensors(completion, tools, rewards), masked=masked)


def test_sequence_rewards_sum_as_trl_and_keep_unscorable_rows_nan():
    per_func = torch.tensor([[1.0, 0.5], [math.nan, 0.5], [math.nan, math.nan], [0.0, 0.0]])
    rewards = sequence_rewards(per_func, torch.tensor([2.0, 1.0]))
    assert rewards[:2].tolist() == [2.5, 0.5] and math.isnan(rewards[2]) and rewards[3] == 0.0
    completion = [[1, 1, 0]] * 4
    with pytest.raises(ValueError, match="row 2: reward is nan"):
        from_trl_batch(torch.tensor(completion), None, rewards)
    with pytest.raises(ValueError, match=r"\(b, n\) with \(n,\) reward_weights"):
        sequence_rewards(per_func, torch.ones(3))


@pytest.mark.parametrize("seed", range(10))
def test_trl_advantages_reinforce_plus_plus_against_the_serial_reference(seed):
    rng = random.Random(100 + seed)
    completion, tools, rewards = random_trl_batch(rng, masked_rows={0})
    rewards[0] = 1.0  # dropped
    spans_ref, token_rewards_ref = from_trl_batch_ref(completion, tools, rewards, "drop")
    expected = whiten_ref(discounted_returns_ref(token_rewards_ref, spans_ref, 0.9), spans_ref)
    advantages, spans, _ = trl_advantages(*tensors(completion, tools, rewards), masked="drop", gamma=0.9)
    torch.testing.assert_close(advantages.double(), expected, atol=1e-5, rtol=1e-5)
    off = spans != ASSISTANT
    assert torch.equal(advantages[off], torch.zeros_like(advantages[off]))  # exactly 0 on tool tokens and PAD


def grpo_ref(rewards, groups, has_assistant, eps=1e-6):
    """Per-row GRPO score (reward - group mean) / (group std + eps) over the unmasked rows of each group."""
    out = []
    for row, reward in enumerate(rewards):
        if not has_assistant[row]:
            out.append(0.0)  # no ASSISTANT token: no advantage anywhere
            continue
        members = [rewards[r] for r in range(len(rewards)) if groups[r] == groups[row] and has_assistant[r]]
        assert len(members) >= 2, "the test batch keeps at least 2 unmasked rows per group"
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        out.append((reward - mean) / (std + eps))
    return out


def test_group_estimators_leave_a_masked_row_out_of_its_group():
    completion, tools, rewards = random_trl_batch(random.Random(7), b=6, masked_rows={1})
    rewards = [1.0, 5.0, 0.0, 2.0, 0.5, -1.0]  # row 1 (masked, dropped) would pull group 0's mean up
    groups = [0, 0, 0, 1, 1, 1]
    advantages, spans, metrics = trl_advantages(*tensors(completion, tools, rewards), estimator="grpo",
                                                index=torch.tensor(groups), masked="drop")
    has_assistant = [bool((spans[r] == ASSISTANT).any()) for r in range(6)]
    expected = grpo_ref(rewards, groups, has_assistant)
    per_row = torch.where(spans == ASSISTANT, advantages, torch.nan).nanmean(dim=1).nan_to_num(0.0)
    torch.testing.assert_close(per_row.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    assert int(metrics["dropped_rewards"]) == 1
    with pytest.raises(ValueError, match="grpo estimator needs index"):
        trl_advantages(*tensors(completion, tools, rewards), estimator="grpo", masked="drop")
