"""The turn-level estimators as verl calls them (issue 47), without verl: ``agent_loop_<name>`` takes verl's
arguments (rewards, mask, config, uids) and reads the rest of the batch our AgentLoop builds (token ids, attention
mask, the task's turn states in ``agent_loop_info``) from the ``compute_advantage`` call it runs in. The real verl
runs them in tests/integrations/test_verl_real.py."""

from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from advantages import get_estimator
from agent_loop.integrations import verl as plugin
from masking.spans import SpanKind

A, O, P = SpanKind.ASSISTANT, SpanKind.OBSERVATION, SpanKind.PAD


def verl_batch():
    """4 rows of 2 groups: turn, a 2-token tool result, turn, trailing padding; rows 0 and 1 see the same result."""
    spans = torch.tensor([[A, A, O, O, A, A, P], [A, A, O, O, A, P, P], [A, A, O, O, A, A, A], [A, O, O, A, A, P, P]])
    responses = torch.tensor([[1, 2, 9, 9, 3, 4, 0], [1, 5, 9, 9, 6, 0, 0], [1, 2, 8, 8, 3, 4, 5], [1, 7, 7, 3, 4, 0, 0]])
    mask = (spans == A).long()
    rewards = torch.zeros(4, 7, dtype=torch.float64)
    last = torch.where(spans == A, torch.arange(7), -1).amax(-1)
    rewards[torch.arange(4), last] = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    rewards[:, 1] = torch.tensor([0.2, -0.1, 0.0, 0.0], dtype=torch.float64)  # a first-turn reward
    attention = torch.cat([torch.ones(4, 3, dtype=torch.long), (spans != P).long()], dim=1)  # 3 prompt tokens
    return spans, responses, mask, rewards, attention, np.array(["a", "a", "a", "b"], dtype=object)


class FakeData:
    """A DataProto's two parts, as verl's compute_advantage gets them."""

    def __init__(self, tensors: dict, non_tensors: dict):
        self.batch, self.non_tensor_batch = tensors, non_tensors


def test_registered_names_are_the_turn_level_estimators():
    assert set(plugin.TURN_LEVEL_FOR_VERL) == {f"agent_loop_{n}" for n in plugin.TURN_LEVEL}


@pytest.mark.parametrize("name", ["turn_returns", "turn_rloo", "turn_index_normalized", "gigpo"])
def test_the_batch_compute_advantage_computes_reaches_the_estimator(name):
    spans, responses, mask, rewards, attention, uids = verl_batch()
    ray_trainer = ModuleType("ray_trainer")
    fn = plugin.TURN_LEVEL_FOR_VERL[f"agent_loop_{name}"]
    config = SimpleNamespace(gamma=0.9, lam=0.95, step_advantage_w=0.5)
    ray_trainer.compute_advantage = lambda data, estimator: fn(data.batch["token_level_rewards"],
                                                               data.batch["response_mask"], config=config, index=uids)
    plugin.capture_batches(ray_trainer)
    plugin.capture_batches(ray_trainer)  # twice: one wrapper
    assert ray_trainer.compute_advantage.agent_loop_captures
    data = FakeData({"token_level_rewards": rewards, "response_mask": mask, "responses": responses,
                     "attention_mask": attention}, {"uid": uids})
    got, _ = ray_trainer.compute_advantage(data, name)
    entry = get_estimator(name)
    fields = {"index": uids, "spans": spans, "responses": responses}
    settings = {k: v for k, v in vars(config).items() if k in entry.hyperparameters}
    want, _ = entry(rewards, mask.double(), **{k: v for k, v in fields.items() if k in entry.batch_arguments}, **settings)
    torch.testing.assert_close(got, want)


def test_gigpo_takes_the_tasks_turn_states_and_refuses_a_batch_it_cannot_see():
    spans, responses, mask, rewards, attention, uids = verl_batch()
    fn = plugin.TURN_LEVEL_FOR_VERL["agent_loop_gigpo"]
    with pytest.raises(ValueError, match="agent_loop_gigpo needs the batch's responses"):
        fn(rewards, mask, index=uids)  # called outside compute_advantage, without the token ids
    infos = np.array([{"turn_states": ["s", ["x", 1]]}, {"turn_states": ["s", ["x", 1]]},
                      {"turn_states": ["s", ["x", 1]]},
                      {"turn_states": ["t", "u", "cut off"]}], dtype=object)  # row 3: a turn the response lost
    ray_trainer = ModuleType("ray_trainer")
    ray_trainer.compute_advantage = lambda data: fn(data.batch["token_level_rewards"], data.batch["response_mask"],
                                                    index=uids)
    plugin.capture_batches(ray_trainer)
    got, _ = ray_trainer.compute_advantage(FakeData({"token_level_rewards": rewards, "response_mask": mask,
                                                     "attention_mask": attention}, {"agent_loop_info": infos}))
    states = [["s", ("x", 1)], ["s", ("x", 1)], ["s", ("x", 1)], ["t", "u"]]  # row 2's tool result differs
    want, _ = get_estimator("gigpo")(rewards, mask.double(), index=uids, spans=spans, turn_states=states)
    torch.testing.assert_close(got, want)
    by_tokens, _ = get_estimator("gigpo")(rewards, mask.double(), index=uids, spans=spans, responses=responses)
    assert not torch.equal(got, by_tokens)  # the task's states, not the tool results' tokens
