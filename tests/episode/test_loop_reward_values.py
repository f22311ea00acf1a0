"""A task's reward or turn reward that is NaN, infinite or not a number ends that episode as an error (issue 30):
it used to be written as reward ``null`` with finish "stop", and the rollout's returns table (and a training
step) then crashed on the NaN. Scripted replies on the real Qwen2.5 tokenizer and chat template (loop logic)."""

import asyncio
import json

import pytest

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.runners.local import run_rollouts
from agent_loop.types import Episode


class Valued:
    """One question; episode ``bad`` gets reward (or turn rewards) ``value``, the others 1.0."""

    name = "valued"

    def __init__(self, value, turns: bool = False):
        self.value, self.turns = value, turns

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "What is 2 + 2?"}], tools=[], answer="4", info={"i": index})

    def reward(self, episode, messages, tool_calls):
        return self.value if episode.info["i"] == 1 and not self.turns else 1.0

    def turn_rewards(self, episode, messages, tool_calls):
        return [self.value] if self.turns and episode.info["i"] == 1 else None


@pytest.mark.parametrize("value,message", [
    (float("nan"), "ValueError: valued's reward returned nan, not a finite number"),
    (float("-inf"), "ValueError: valued's reward returned -inf, not a finite number"),
    ("1.0", "TypeError: valued's reward returned str '1.0', not a number"),
    (None, "TypeError: valued's reward returned NoneType None, not a number"),
])
@pytest.mark.parametrize("turns", [False, True])
def test_a_reward_that_is_no_finite_number_is_an_error_episode(qwen_tokenizer, tmp_path, value, message, turns):
    backend = ScriptedBackend(lambda prompt: qwen_tokenizer.encode("It is 4.", add_special_tokens=False))
    out = tmp_path / "run.jsonl"
    got = asyncio.run(run_rollouts(Valued(value, turns), backend, qwen_tokenizer, range(3), output_path=out,
                                   progress=False))
    if turns:
        message = message.replace("valued's reward", "valued's turn reward")
    assert [t.finish_reason for t in got] == ["stop", "error", "stop"]
    assert got[1].reward == 0.0 and got[1].info["reward_error"] == got[1].metrics["error"] == message
    assert got[1].response_ids and [t.reward for t in got] == [1.0, 0.0, 1.0]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert all("json_repairs" not in r["metrics"] and r["reward"] in (0.0, 1.0) for r in written)
    batch = trajectories_to_batch(got, pad_token_id=0)  # what the returns table and a training step collate
    assert batch.token_level_rewards.isfinite().all() and batch.token_level_rewards.sum().item() == 2.0
