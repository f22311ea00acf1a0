"""Turn-level credit through the whole system (issue 47 item 4), on real episodes of the tiny agent: per-turn rewards
from an environment's steps (``TurnEnvironment``) and from a task's ``turn_rewards`` land on each turn's last
ASSISTANT token and reach the turn-level estimators through the trainer's batch; a task's ``turn_states`` are
recorded per episode and reach ``gigpo`` as its anchor states. Serial references kept here."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from advantages import get_estimator
from advantages.settings import GiGPOSettings
from agent_loop import Trainer
from agent_loop.episode.contracts import StepResult, Task, TurnEnvironment
from agent_loop.runners.batch import estimator_arguments, trajectories_to_batch, turn_state_ids
from agent_loop.types import Episode, Trajectory
from masking import SpanKind
from tests.helpers.trainer_config import batch_of, small_config

A = SpanKind.ASSISTANT
TURNS = 3


class Rooms(TurnEnvironment):
    """Three turns: after each, the agent is told which room it is in (by the parity of its reply's length, so
    the states recur across a group's episodes and differ between them), with a step reward of 0.1 x the room."""

    def __init__(self):
        self.turn = 0

    def step(self, turn, limits):
        room = len(turn.text) % 2 + 1
        self.turn += 1
        if self.turn == TURNS:
            return StepResult(reward=0.1 * room, done=True)
        return StepResult([{"role": "user", "content": f"room {room}"}], reward=0.1 * room)


class RoomsTask(Task):
    """Each episode in :class:`Rooms`; outcome 1.0, a task turn reward of 0.5 on turn 0, and the room each turn
    started from as its state (a tuple, recorded as a list)."""

    name = "rooms"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "Walk through the rooms."}], tools=[], environment=Rooms())

    def reward(self, episode, messages, tool_calls):
        return 1.0

    def turn_rewards(self, episode, messages, tool_calls):
        turns = sum(m["role"] == "assistant" for m in messages)
        return [0.5] + [0.0] * (turns - 1)

    def turn_states(self, episode, messages, tool_calls):
        rooms = [m["content"] for m in messages if m["role"] == "user"]  # the prompt, then each room told
        return [("at", text) for text in rooms[: sum(m["role"] == "assistant" for m in messages)]]


def last_assistant(t: Trajectory, turn: int) -> int:
    return max(i for i, (s, k) in enumerate(zip(t.spans, t.turn_ids)) if s == A and k == turn)


def per_turn_rewards_ref(t: Trajectory) -> list[float]:
    """Serial: each environment step's reward plus the task's turn reward on its turn, the outcome on the last."""
    turns = len({k for s, k in zip(t.spans, t.turn_ids) if s == A})
    r = [0.0] * turns
    for step in t.info.get("steps", []):
        r[step["turn"]] += step["reward"] or 0.0
    r[0] += 0.5
    r[-1] += 1.0
    return r


@pytest.fixture(scope="module")
def played(tiny_mid, tmp_path_factory):
    """One step's episodes (4 questions x 2) of the rooms task, played by the tiny agent through the trainer."""
    trainer = Trainer(small_config(tiny_mid, tmp_path_factory.mktemp("rooms"), estimator="turn_returns", gamma=0.5,
                                   max_turns=TURNS, steps=1), task=RoomsTask())
    return trainer, trainer.rollouts.play_groups(0)


@pytest.mark.slow
def test_per_turn_rewards_of_environment_and_task_reach_the_turn_level_returns(played):
    trainer, trajectories = played
    kept = [t for t in trajectories if t.finish_reason != "error"]
    assert max(len(set(t.turn_ids)) for t in kept) >= 2, "no episode took two turns: nothing turn-level to check"
    batch = batch_of(trainer, kept)
    trainer.ppo.score(batch)
    for row, t in enumerate(kept):
        r = per_turn_rewards_ref(t)
        expected = [0.0] * len(t.spans)
        for k, value in enumerate(r):
            expected[last_assistant(t, k)] += value
        assert batch.token_level_rewards[row, : len(t.spans)].tolist() == pytest.approx(expected), row
        returns = [0.0] * len(r)  # gamma once per turn
        for k in reversed(range(len(r))):
            returns[k] = r[k] + 0.5 * (returns[k + 1] if k + 1 < len(r) else 0.0)
        want = [returns[k] if s == A else 0.0 for s, k in zip(t.spans, t.turn_ids)]
        assert batch.returns[row, : len(t.spans)].tolist() == pytest.approx(want, abs=1e-6), row
    assert torch.all(batch.advantages[batch.spans != A] == 0)


@pytest.mark.slow
def test_turn_states_are_recorded_and_reach_gigpo(played):
    trainer, trajectories = played
    kept = [t for t in trajectories if t.finish_reason != "error"]
    for t in kept:  # recorded as the hook gave them (tuples), read back from JSON as lists
        turns = len({k for s, k in zip(t.spans, t.turn_ids) if s == A})
        assert len(t.info["turn_states"]) == turns and t.info["turn_states"][0] == ("at", "Walk through the rooms.")
        assert Trajectory.from_json(t.to_json()).info["turn_states"][0] == ["at", "Walk through the rooms."]
    batch = batch_of(trainer, kept)
    keys = [[tuple(s) for s in t.info["turn_states"]] for t in kept]
    ids = batch.turn_states.tolist()
    for i, row in enumerate(keys):  # equal keys <-> equal ids; -1 past the row's turns
        assert ids[i][len(row):] == [-1] * (len(ids[i]) - len(row))
        for j, other in enumerate(keys):
            for k, key in enumerate(row):
                for m, key2 in enumerate(other):
                    assert (ids[i][k] == ids[j][m]) == (key == key2)

    gigpo = get_estimator("gigpo")
    seen = {}

    @functools.wraps(gigpo.fn)
    def recording(*args, **kwargs):
        seen.update(kwargs)
        return gigpo.fn(*args, **kwargs)

    trained_with = trainer.ppo.estimator, trainer.ppo.settings
    # the trainer's path, gigpo's function and settings
    trainer.ppo.estimator, trainer.ppo.settings = dataclasses.replace(gigpo, fn=recording), GiGPOSettings(gamma=0.5)
    try:
        trainer.ppo.score(batch)
    finally:
        trainer.ppo.estimator, trainer.ppo.settings = trained_with
    assert torch.equal(seen["turn_states"], batch.turn_states) and torch.equal(seen["index"], batch.index)
    # the same advantages as gigpo given the keys themselves (it numbers them on its own)
    want, _ = gigpo(batch.token_level_rewards, batch.response_mask, index=batch.index, spans=batch.spans,
                    turn_ids=batch.turn_ids, turn_states=keys, gamma=0.5)
    torch.testing.assert_close(batch.advantages, want)


def test_turn_state_ids_number_equal_keys_alike_and_refuse_a_row_without_them():
    def trajectory(turns, states):
        spans = [A, A, SpanKind.OBSERVATION] * turns
        turn_ids = [k for k in range(turns) for _ in range(3)]
        info = {"index": 0} if states is None else {"index": 0, "turn_states": states}
        return Trajectory(prompt_ids=[1], response_ids=[5] * len(spans), spans=spans, turn_ids=turn_ids,
                          logprobs=[0.0] * len(spans), messages=[], info=info)

    rows = [trajectory(2, ["a", ["b", 1]]), trajectory(1, [("b", 1)]), trajectory(3, ["c", "a", "a"])]
    assert turn_state_ids(rows).tolist() == [[0, 1, -1], [1, -1, -1], [2, 0, 0]]
    assert trajectories_to_batch(rows).turn_states.tolist() == [[0, 1, -1], [1, -1, -1], [2, 0, 0]]
    assert turn_state_ids([trajectory(1, None)]) is None
    with pytest.raises(ValueError, match=r"row 1: no turn_states, while row 0 has them"):
        turn_state_ids([rows[0], trajectory(1, None)])
    with pytest.raises(ValueError, match=r"row 0: info\['turn_states'\] returned 1 keys for 2 assistant turns"):
        turn_state_ids([trajectory(2, ["a"])])
    with pytest.raises(ValueError, match=r"row 0: .*turn 1\] is dict"):
        turn_state_ids([trajectory(2, ["a", {"b": 1}])])


def test_estimator_arguments_are_exactly_the_batch_fields_each_estimator_accepts():
    rows = [Trajectory(prompt_ids=[1], response_ids=[5, 6, 7], spans=[A, SpanKind.OBSERVATION, A], turn_ids=[0, 0, 1],
                       logprobs=[0.0] * 3, messages=[], reward=1.0, info={"index": 0, "turn_states": ["x", "y"]})] * 2
    batch = trajectories_to_batch(rows)
    batch.index = torch.tensor([0, 0])
    for name in ("reinforce_plus_plus", "grpo", "turn_rloo", "gigpo", "turn_gae"):
        entry = get_estimator(name)
        given = estimator_arguments(entry, batch)
        assert set(given) == {n for n in entry.batch_arguments if n in batch and n not in (
            "token_level_rewards", "response_mask")}, name
    assert {"responses", "turn_states", "turn_ids", "index", "spans"} <= set(estimator_arguments(get_estimator("gigpo"), batch))
    assert "values" not in estimator_arguments(get_estimator("turn_gae"), batch)  # not in the batch: gae's own error


@pytest.mark.slow
def test_turn_gae_trains_with_the_value_head_gae_uses(tiny_mid, tmp_path):
    trainer = Trainer(small_config(tiny_mid, tmp_path, estimator="turn_gae", gamma=0.9, lam=0.8, steps=1))
    assert trainer.value_head is not None  # the critic of any estimator that needs values
    torch.nn.init.normal_(trainer.value_head.linear.weight, generator=torch.Generator().manual_seed(0))
    batch = batch_of(trainer, trainer.rollouts.play_groups(0))
    trainer.ppo.score(batch)
    assert batch.values is not None and torch.isfinite(batch.advantages).all()
    want, returns = get_estimator("turn_gae")(batch.token_level_rewards, batch.response_mask, values=batch.values,
                                              spans=batch.spans, turn_ids=batch.turn_ids, gamma=0.9, lam=0.8)
    torch.testing.assert_close(batch.advantages, want)
    torch.testing.assert_close(batch.returns, returns)
    loss, stats = trainer.ppo.micro_batch_loss(batch.select(torch.arange(2)))
    assert torch.isfinite(loss) and torch.isfinite(stats["value_loss"])


@pytest.mark.parametrize("states, message", [
    (["a", "b"], "rooms's turn_states returned 2 keys for 1 assistant turns"),
    ("a", "rooms's turn_states returned str 'a', not a list"),
    ([{"room": 1}], r"rooms's turn_states\[turn 0\] is dict"),
])
def test_a_bad_turn_states_hook_ends_its_episode_as_an_error_naming_the_turn(tiny_tokenizer, states, message):
    import asyncio

    from agent_loop.backends.scripted import ScriptedBackend
    from agent_loop.episode.loop import run_episode

    class Bad(RoomsTask):
        def make_episode(self, index, seed=0):
            return Episode(messages=[{"role": "user", "content": "Say hi."}], tools=[])

        def turn_states(self, episode, messages, tool_calls):
            return states

    backend = ScriptedBackend(lambda prompt: tiny_tokenizer.encode("hi", add_special_tokens=False))
    t = asyncio.run(run_episode(Bad(), 0, backend, tiny_tokenizer))
    assert t.finish_reason == "error" and "turn_states" not in t.info
    assert re_search(message, t.metrics["error"]), t.metrics["error"]


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None
