"""agent_loop.integrations.trl without TRL: NaN and truncated-row rules, advantages, against a serial reference.

The real TRL GRPOTrainer runs in tests/integrations/test_trl_real.py.
"""

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agent_loop.integrations.trl import (
    TESTED_TRL,
    check_trl_args,
    check_trl_version,
    from_trl_batch,
    sequence_rewards,
    trl_advantages,
)
from tests.helpers.reference_returns import ASSISTANT, PAD, discounted_returns_ref, whiten_ref
from tests.helpers.trl_reference import from_trl_batch_ref


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


def example_like_batch():
    """The example's first batch, shaped: a 20-token tool call, a 6-token tool result, an 8-token answer;
    row 0 answers right (reward 1.5: answer and tool use), rows 1-3 wrong (0.5: tool use only)."""
    completion_mask = torch.ones(4, 34, dtype=torch.long)
    tool_mask = torch.ones(4, 34, dtype=torch.long)
    tool_mask[:, 20:26] = 0
    return completion_mask, tool_mask, torch.tensor([1.5, 0.5, 0.5, 0.5])


def test_gamma_1_gives_wrong_answers_negative_advantages_on_every_token():
    """The example's gamma (1, docs/trl.md): a wrong answer's tokens all get a negative advantage and a right
    one's all positive. With 0.95 and per-batch whitening the right rows' first tokens are discounted below
    the wrong rows' final ones: a wrong final answer is then reinforced (the example's old default)."""
    completion_mask, tool_mask, rewards = example_like_batch()
    advantages, spans, _ = trl_advantages(completion_mask, tool_mask, rewards, gamma=1.0)
    assistant = spans == ASSISTANT
    assert bool((advantages[:1][assistant[:1]] > 0).all()) and bool((advantages[1:][assistant[1:]] < 0).all())
    discounted, _, _ = trl_advantages(completion_mask, tool_mask, rewards, gamma=0.95)
    assert bool((discounted[1:, -3:] > 0).all()) and bool((discounted[:1, :2] < 0).all())  # the signs flip


def test_span_trainer_refuses_an_untested_trl_unless_asked():
    for version in (f"{TESTED_TRL[0]}.0", f"{TESTED_TRL[-1]}.3"):
        check_trl_version(version)
    with pytest.raises(RuntimeError, match="tested with TRL 1.16.x; this is TRL 1.17.0.*allow_untested_trl=True"):
        check_trl_version("1.17.0")
    with pytest.warns(UserWarning, match="this is TRL 0.9.2"):
        check_trl_version("0.9.2", allow_untested=True)


def test_span_trainer_refuses_trl_options_that_act_on_a_sequences_sign():
    check_trl_args(None)
    check_trl_args(SimpleNamespace(off_policy_mask_threshold=None, loss_type="dapo"))
    with pytest.raises(ValueError, match="off_policy_mask_threshold masks whole sequences"):
        check_trl_args(SimpleNamespace(off_policy_mask_threshold=0.5, loss_type="dapo"))
    with pytest.raises(ValueError, match="loss_type='vespo'"):
        check_trl_args(SimpleNamespace(off_policy_mask_threshold=None, loss_type="vespo"))


def test_the_docs_install_line_is_the_trl_side_environments():
    """docs/trl.md's install of agent-loop (no --no-deps) is the line scripts/side_env.sh builds .side-envs/trl
    with, so test_trl_real runs on what the doc gives a TRL user."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "trl.md").read_text()
    block = doc[doc.index("## Run the recipe"):].split("```bash\n", 1)[1].split("```", 1)[0]
    ours = [line.split("#")[0].split() for line in block.splitlines() if line.startswith("pip install") and "trl" not in line]
    assert ours == [["pip", "install", "-e", "."]], ours
    side_env = (root / "scripts" / "side_env.sh").read_text()
    assert '  *) "${pip[@]}" -e . "torch==2.13.0" ;;' in side_env.splitlines()  # the trl environment's branch


def test_turn_level_estimators_get_the_trl_batch_fields_they_accept():
    """gigpo keys its anchor states on the tool results' tokens (TRL's completion_ids as responses): two rows of a
    group with the same tool result share the second turn's anchor group; turn_rloo's turns come from the spans;
    an estimator that needs critic values is refused."""
    completion_mask, tool_mask, _ = example_like_batch()  # turn 0: 20 tokens, a 6-token tool result, turn 1: 8 tokens
    rewards = torch.tensor([1.5, 0.5, 0.5, 1.0])
    responses = torch.arange(4 * 34).reshape(4, 34)
    responses[:, 20:26] = torch.tensor([[7] * 6, [7] * 6, [8] * 6, [9] * 6])  # rows 0 and 1: the same tool result
    index = torch.tensor([0, 0, 0, 1])
    spans, mask, token_rewards = from_trl_batch(completion_mask, tool_mask, rewards)
    from advantages import get_estimator

    for name in ("gigpo", "turn_rloo"):
        got, _, _ = trl_advantages(completion_mask, tool_mask, rewards, estimator=name, index=index, responses=responses)
        fields = {"index": index, "spans": spans, "responses": responses}
        entry = get_estimator(name)
        want, _ = entry(token_rewards, mask, **{k: v for k, v in fields.items() if k in entry.batch_arguments})
        torch.testing.assert_close(got, want)
    with_states, _, _ = trl_advantages(completion_mask, tool_mask, rewards, estimator="gigpo", index=index,
                                       responses=responses)
    apart = responses.clone()
    apart[1, 20:26] = 6  # row 1's tool result now differs from row 0's: its second turn falls back
    without, _, _ = trl_advantages(completion_mask, tool_mask, rewards, estimator="gigpo", index=index, responses=apart)
    assert not torch.equal(with_states[:2, 26:], without[:2, 26:])  # the anchor states come from the tool results
    with pytest.raises(ValueError, match="turn_gae estimator needs critic values"):
        trl_advantages(completion_mask, tool_mask, rewards, estimator="turn_gae")
