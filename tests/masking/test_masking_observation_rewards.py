"""Issue 28 item 6: masking.rewards.relocate_observation_rewards (rewards that sit on OBSERVATION
tokens: raise, move to the last ASSISTANT token before them, or drop) against a serial reference,
its errors, and no host sync for "move" and "drop"."""

import math

import pytest
import torch

from advantages import reinforce_plus_plus
from masking import OBSERVATION_REWARD_POLICIES, relocate_observation_rewards
from masking.spans import SpanKind, spans_from_response_mask
from tests.helpers.host_syncs import HostSyncs
from tests.helpers.reference_returns import discounted_returns_ref

A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)


def relocate_ref(rewards, spans, policy):
    """One token at a time: an observation's finite nonzero reward is zeroed ("drop") or added to
    the last assistant token seen so far in its row ("move"; kept if there is none)."""
    out, count = [], 0
    for row, kinds in zip(rewards.tolist(), spans.tolist()):
        new, last = list(row), -1
        for t, (reward, kind) in enumerate(zip(row, kinds)):
            if kind == A:
                last = t
            elif kind == O and reward != 0 and math.isfinite(reward):
                if policy == "drop":
                    new[t], count = 0.0, count + 1
                elif policy == "move" and last >= 0:
                    new[t], new[last], count = 0.0, new[last] + reward, count + 1
        out.append(new)
    return torch.tensor(out, dtype=torch.float64).reshape(rewards.shape), count


def agent_batch(seed: int, b: int = 6, t: int = 24):
    """Rows of alternating assistant/observation runs, trailing padding, one row that starts with an
    observation; rewards on a random share of every token (assistant, observation and padding)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in range(b):
        kinds, kind = [], O if row == 0 else A
        while len(kinds) < t:
            kinds += [kind] * int(torch.randint(1, 5, (), generator=generator))
            kind = O if kind == A else A
        pad = int(torch.randint(0, 5, (), generator=generator))
        rows.append(kinds[: t - pad] + [P] * pad)
    spans = torch.tensor(rows, dtype=torch.int8)
    rewards = torch.where(torch.rand(b, t, generator=generator) < 0.3, torch.randn(b, t, generator=generator), 0.0)
    return spans, rewards.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("policy", ["move", "drop"])
@pytest.mark.parametrize("seed", range(5))
def test_relocation_matches_serial_reference(policy, seed, dtype):
    spans, rewards = agent_batch(seed)
    rewards = rewards.to(dtype)
    before = rewards.clone()
    got, count = relocate_observation_rewards(rewards, spans, policy)
    expected, expected_count = relocate_ref(rewards, spans, policy)
    assert torch.equal(rewards, before)  # the input is not changed
    assert got.dtype == dtype and got.shape == spans.shape
    assert count.dim() == 0 and count.dtype == torch.int64 and int(count) == expected_count > 0
    torch.testing.assert_close(got.double(), expected, atol=1e-6 if dtype == torch.float32 else 1e-12, rtol=1e-6)
    assert torch.equal(got[spans == P], rewards[spans == P])  # padding untouched: validation names it
    if policy == "move":  # nothing is lost but the unmovable ones, which stay in place
        torch.testing.assert_close(got.double().sum(-1), rewards.double().sum(-1))


def test_move_puts_a_final_tool_output_reward_on_the_last_assistant_token():
    """A trajectory that ends in a tool output: the reward moves to the answer's last token, then
    reaches every earlier assistant token as any reward does."""
    spans = torch.tensor([[A, A, O, O, A, A, O, O, P]], dtype=torch.int8)
    rewards = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 2.0, 0]], dtype=torch.float64)
    moved, count = relocate_observation_rewards(rewards, spans, "move")
    assert moved.tolist() == [[0, 0, 0, 0, 0, 2.0, 0, 0, 0]] and int(count) == 1
    advantages, returns = reinforce_plus_plus(moved, (spans == A).double(), 0.5, spans=spans, whiten=False)
    torch.testing.assert_close(returns, discounted_returns_ref(moved, spans, 0.5))
    assert returns[0, 0].item() == pytest.approx(2.0 * 0.5**3)
    dropped, count = relocate_observation_rewards(rewards, spans, "drop")
    assert dropped.abs().sum() == 0 and int(count) == 1


def test_raise_names_row_and_position_and_passes_clean_batches():
    spans, rewards = agent_batch(3)
    clean = torch.where(spans == O, 0.0, rewards)
    same, count = relocate_observation_rewards(clean, spans, "raise")
    assert same is clean and int(count) == 0
    bad = torch.zeros(3, 5, dtype=torch.float64)
    bad_spans = torch.tensor([[A] * 5, [A, A, O, O, P], [A, O, O, O, O]], dtype=torch.int8)
    bad[1, 3], bad[2, 1] = 1.5, 2.0
    with pytest.raises(ValueError, match=r"reward 1.5 at row 1, position 3 sits on an OBSERVATION token.*'move'.*'drop'"):
        relocate_observation_rewards(bad, bad_spans, "raise")
    with pytest.raises(ValueError, match=r"reward 1.5 at row 1, position 3"):  # the default policy
        relocate_observation_rewards(bad, bad_spans)


def test_what_stays_in_place_is_named_by_validation():
    """NaN/inf, rewards on PAD and a "move" with no assistant token before it are left where they
    are (count 0), so the estimators' validation raises naming them instead of losing them."""
    spans = torch.tensor([[O, A, A, P], [O, O, A, A], [A, A, O, O]], dtype=torch.int8)
    mask = (spans == A).double()
    for row, pos, value, message in ((0, 3, 1.0, "row 0, position 3 sits on a PAD token"),
                                     (1, 0, 1.0, "row 1, position 0 sits on an OBSERVATION token"),
                                     (2, 2, float("nan"), "non-finite value nan at row 2, position 2"),
                                     (2, 3, float("inf"), "non-finite value inf at row 2, position 3")):
        rewards = torch.zeros(3, 4, dtype=torch.float64)
        rewards[row, pos] = value
        for policy in ("move", "drop") if value == value and row != 1 else ("move",):
            got, count = relocate_observation_rewards(rewards, spans, policy)
            assert int(count) == 0 and torch.equal(got.isnan(), rewards.isnan())
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(rewards))
            with pytest.raises(ValueError, match=message):
                reinforce_plus_plus(got, mask, 0.9, spans=spans)


def test_no_host_sync_for_move_and_drop_and_mask_only_input():
    spans, rewards = agent_batch(4)
    mask = (spans == A).float()
    for policy in ("move", "drop"):
        with HostSyncs() as syncs:
            got, count = relocate_observation_rewards(rewards, spans_from_response_mask(mask), policy)
        assert syncs.seen == [], policy
        # mask-only input: every 0 is an observation, padding included (as verl's loops see it)
        expected, expected_count = relocate_ref(rewards, spans_from_response_mask(mask), policy)
        torch.testing.assert_close(got, expected)
        assert int(count) == expected_count
    with HostSyncs() as syncs:
        relocate_observation_rewards(torch.where(spans == O, 0.0, rewards), spans, "raise")  # raise has to look: one sync
    assert syncs.seen


def test_bad_arguments():
    rewards, spans = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"one of \('raise', 'move', 'drop'\), got 'keep'"):
        relocate_observation_rewards(rewards, spans, "keep")
    with pytest.raises(ValueError, match=r"spans \(2, 4\) and token_level_rewards \(2, 3\) must both be \(b, t\)"):
        relocate_observation_rewards(rewards, torch.ones(2, 4, dtype=torch.int8), "drop")
    assert OBSERVATION_REWARD_POLICIES == ("raise", "move", "drop")
    for shape in ((0, 3), (2, 0)):  # empty batches
        for policy in OBSERVATION_REWARD_POLICIES:
            got, count = relocate_observation_rewards(torch.zeros(shape), torch.ones(shape, dtype=torch.int8), policy)
            assert got.shape == shape and int(count) == 0
