"""The ``keydoor`` task (issue 47 item 5): its world by hand, its tools, rewards, per-turn rewards and states through
the real agent loop (scripted models writing the turns as text, the real tokenizers and chat templates), its
demonstrations (replayed by warm start, scoring 1.0), its held-out split, bad tool input as error observations,
and one episode of the tiny agent through the real loop."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.keydoor import (
    HELD_OUT_SEED,
    MAX_TURNS,
    MOVES,
    STEP_REWARD,
    KeyDoorTask,
    Map,
    State,
    advance,
    describe,
    ideal_directions,
    maps,
    moves_left,
    offset,
)
from agent_loop.tasks.registry import get_task
from agent_loop.types import SpanKind

SEED = 3
CONFIG = LoopConfig(max_turns=MAX_TURNS, max_tokens=48, max_response_tokens=768)
WORLD = Map(start=(3, 1), key=(1, 2), door=(4, 2))  # 2 up 1 right to the key, then 3 down: 6 moves


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def move(direction) -> str:
    return call("move", {"direction": direction})


def test_the_world_by_hand():
    assert describe(WORLD, State(3, 1)) == "You are at row 3, column 1. The key is 2 up and 1 right."
    assert describe(WORLD, State(4, 2)) == "You are at row 4, column 2. The door is here, but locked. The key is 3 up."
    assert describe(WORLD, State(1, 2, True)) == "You are at row 1, column 2. You have the key. The door is 3 down."
    assert describe(WORLD, State(4, 2, True, True)) == "You are at row 4, column 2. You opened the door."
    assert offset((2, 2), (2, 1)) == "1 left" and offset((1, 1), (3, 4)) == "2 down and 3 right"
    assert advance(WORLD, State(3, 1), "up") == State(2, 1)
    assert advance(WORLD, State(1, 1), " Right ") == State(1, 2, True)  # the key's room: picked up
    assert advance(WORLD, State(4, 1), "right") == State(4, 2)  # the door's room without the key: still closed
    assert advance(WORLD, State(3, 2, True), "down") == State(4, 2, True, True)
    assert moves_left(WORLD, State(3, 1)) == 6 and moves_left(WORLD, State(2, 2, True)) == 2
    assert ideal_directions(WORLD) == ["up", "up", "right", "down", "down", "down"]
    for bad, message in (("north", "unknown direction 'north'"), (3, "unknown direction 3")):
        with pytest.raises(ValueError, match=message):
            advance(WORLD, State(3, 1), bad)
    with pytest.raises(ValueError, match="a wall: you cannot move left from row 3, column 1"):
        advance(WORLD, State(3, 1), "left")
    with pytest.raises(ValueError, match="already open"):
        advance(WORLD, State(4, 2, True, True), "up")


def test_maps_and_the_held_out_split():
    train, held_out = maps(False), maps(True)
    assert not set(train) & set(held_out) and len(held_out) > 100 and len(train) > 3 * len(held_out)
    assert all(MOVES[0] <= m.moves <= MOVES[1] and len({m.start, m.key, m.door}) == 3 for m in train + held_out)
    task = get_task("keydoor")
    from agent_loop.recipes.train import EVAL_SEED_OFFSET  # train's evaluation stream is the held-out one

    assert HELD_OUT_SEED <= EVAL_SEED_OFFSET
    for seed, split in ((0, train), (7, train), (EVAL_SEED_OFFSET, held_out), (EVAL_SEED_OFFSET + 2, held_out)):
        worlds = [Map.from_info(task.make_episode(i, seed).info) for i in range(40)]
        assert set(worlds) <= set(split)
        assert len(set(worlds)) > 20
    again = task.make_episode(5, SEED)
    assert again.info == task.make_episode(5, SEED).info and again.info["split"] == "train"


def scripted(task, tokenizer, policy, episodes=range(4), config=CONFIG):
    """Play ``episodes`` through the real loop; ``policy(world, observations, turn)`` writes each reply, where
    ``observations`` are the tool responses so far (the texts inside the template's tool-response wrapper)."""
    worlds = {task.make_episode(i, SEED).messages[0]["content"]: Map.from_info(task.make_episode(i, SEED).info)
              for i in episodes}

    def script(prompt):
        text = tokenizer.decode(prompt)
        world = next(w for question, w in worlds.items() if question in text)
        observations = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        turn = text.count("<|im_start|>assistant") - 1
        return tokenizer.encode(policy(world, observations, turn), add_special_tokens=False)

    return asyncio.run(run_rollouts(task, ScriptedBackend(script), tokenizer, episodes, config, seed=SEED,
                                    progress=False))


def ideal(world, observations, turn):
    """Follows the first direction each observation names (the prompt's at first), as a reader of the text would."""
    directions = ideal_directions(world)
    return move(directions[turn]) if turn < len(directions) else "Done."


def test_ideal_play_scores_one_with_a_reward_per_turn_and_its_states(tiny_tokenizer):
    task = KeyDoorTask()
    for t in scripted(task, tiny_tokenizer, ideal):
        world = Map.from_info(t.info)
        moves = ideal_directions(world)
        assert t.finish_reason == "stop" and t.reward == 1.0 and t.success and t.metrics["template_exact"]
        assert t.turn_rewards == [STEP_REWARD] * len(moves) + [0.0]
        assert t.metrics["task"] == {"got_key": 1.0, "opened": 1.0, "good_moves": 1.0}
        assert [c.error_kind for c in t.tool_calls] == [None] * len(moves)
        assert t.tool_calls[-1].result.endswith("You opened the door.")
        # each observation is the description of the state the move left, so the states can be read back
        states = task.turn_states(task.make_episode(t.info["index"], SEED), t.messages, t.tool_calls)
        assert states[0] == (*world.start, 0, 0) and len(states) == len(moves) + 1
        for state, call_ in zip(states[1:], t.tool_calls):
            row, column = map(int, re.match(r"You are at row (\d), column (\d)", call_.result).groups())
            assert state[:2] == (row, column)
        assert states[-1] == (*world.door, 1, 1)
        assert SpanKind.OBSERVATION in t.spans and len(set(t.turn_ids) - {-1}) == len(moves) + 1


def detour(world, observations, turn):
    """A wrong first move (the opposite of the ideal one: away, or into a wall), back if it moved, then the ideal play."""
    directions = ideal_directions(world)
    if turn == 0:
        return move({"up": "down", "down": "up", "left": "right", "right": "left"}[directions[0]])
    wasted = 1 if "a wall" in observations[0] else 2
    if turn == 1 and wasted == 2:
        return move(directions[0])  # back
    return move(directions[turn - wasted]) if turn - wasted < len(directions) else "Done."


def test_a_wrong_move_costs_its_own_turn_only(tiny_tokenizer):
    task = KeyDoorTask()
    played = scripted(task, tiny_tokenizer, detour, episodes=range(10))
    walls = [t.tool_calls[0].error_kind is not None for t in played]
    assert any(walls) and not all(walls)  # both kinds of mistake happen among these episodes
    for t, wall in zip(played, walls):
        moves = Map.from_info(t.info).moves
        assert t.turn_rewards[0] == -STEP_REWARD and t.reward == 1.0 and t.success
        if wall:  # an error observation; the state did not change
            assert t.tool_calls[0].error_kind == "exception" and "a wall" in t.messages[2]["content"]
            assert t.turn_rewards[1:] == [STEP_REWARD] * moves + [0.0]
        else:  # moved away (-), then back (closer again: +)
            assert t.turn_rewards[1:] == [STEP_REWARD] * (moves + 1) + [0.0]
        assert t.metrics["task"]["good_moves"] < 1.0


def test_stopping_early_or_never_answering_scores_zero(tiny_tokenizer):
    task = KeyDoorTask()
    early = scripted(task, tiny_tokenizer, lambda w, o, turn: move(ideal_directions(w)[0]) if turn == 0 else "Done.")
    for t in early:
        assert t.reward == 0.0 and not t.success and t.turn_rewards == [STEP_REWARD, 0.0]
        assert t.metrics["task"]["opened"] == 0.0
    looking = scripted(task, tiny_tokenizer, lambda w, o, turn: call("look", {}), episodes=range(2),
                       config=LoopConfig(max_turns=3, max_tokens=48, max_response_tokens=768))
    for t in looking:  # look changes nothing and is worth 0; the last turn's call is not run (no turn reads it)
        assert t.finish_reason == "max_turns" and t.reward == 0.0 and t.turn_rewards == [0.0, 0.0, 0.0]
        assert t.tool_calls[0].result == describe(Map.from_info(t.info), Map.from_info(t.info).start_state)


def test_bad_tool_input_is_an_error_observation(tiny_tokenizer):
    task = KeyDoorTask()
    bad = ["north", 7, None]

    def policy(world, observations, turn):
        if turn < len(bad):
            return move(bad[turn]) if bad[turn] is not None else '<tool_call>\n{"name": "move", "arguments": \n</tool_call>'
        return move("sideways") if turn == len(bad) else "Done."

    for t in scripted(task, tiny_tokenizer, policy, episodes=range(2)):
        kinds = [c.error_kind for c in t.tool_calls]
        assert kinds == ["exception", "invalid_arguments", "malformed_json", "exception"]
        assert "unknown direction 'north'; use up, down, left or right" in t.tool_calls[0].error
        assert t.reward == 0.0 and t.turn_rewards == [-STEP_REWARD] * 4 + [0.0]
        states = task.turn_states(task.make_episode(t.info["index"], SEED), t.messages, t.tool_calls)
        assert len(set(states)) == 1  # nothing moved


def test_two_moves_in_one_turn_run_in_call_order(tiny_tokenizer):
    """The tools are async and never await, so a turn's calls run one after the other in call order: the
    observations and the rewards' replay of the calls agree."""
    task = KeyDoorTask()

    def policy(world, observations, turn):
        directions = ideal_directions(world)
        if turn == 0:
            return move(directions[0]) + "\n" + move(directions[1])
        return move(directions[turn + 1]) if turn + 1 < len(directions) else "Done."

    two_calls = LoopConfig(max_turns=MAX_TURNS, max_tokens=96, max_response_tokens=768)  # two calls in a turn
    for t in scripted(task, tiny_tokenizer, policy, config=two_calls):
        world = Map.from_info(t.info)
        first, second = t.tool_calls[:2]
        assert (first.turn, second.turn) == (0, 0)
        state = advance(world, advance(world, world.start_state, first.arguments["direction"]), second.arguments["direction"])
        assert second.result == describe(world, state)
        assert t.turn_rewards[0] == pytest.approx(2 * STEP_REWARD) and t.reward == 1.0
        states = task.turn_states(task.make_episode(t.info["index"], SEED), t.messages, t.tool_calls)
        assert states[1] == (state.row, state.column, int(state.has_key), int(state.opened))


@pytest.fixture(params=["tiny", "qwen"])
def tokenizer(request, tiny_tokenizer, qwen_tokenizer):
    return {"tiny": tiny_tokenizer, "qwen": qwen_tokenizer}[request.param]


def test_demonstrations_replay_and_succeed(tokenizer):
    from agent_loop.training.demonstrations import has_demonstrations, replay

    task = get_task("keydoor")
    assert has_demonstrations(task)
    for t in replay(task, tokenizer, range(6), SEED, progress=False):
        episode = task.make_episode(t.info["index"], SEED)
        moves = ideal_directions(Map.from_info(episode.info))
        assert t.reward == 1.0 and t.success and t.metrics["template_exact"] and t.finish_reason == "stop"
        assert task.reward(episode, t.messages, t.tool_calls) == 1.0
        assert [c.arguments["direction"] for c in t.tool_calls] == moves
        assert 3 <= len(moves) <= 5 and len(moves) + 1 <= MAX_TURNS
        assert t.messages[-1] == {"role": "assistant", "content": "Done."}
        assert t.turn_rewards == [STEP_REWARD] * len(moves) + [0.0]
    # the same reward on a demonstration cut before its last move fails, so the check above can fail
    trajectory = replay(task, tokenizer, range(1), SEED, progress=False)[0]
    episode = task.make_episode(0, SEED)
    assert task.reward(episode, trajectory.messages, trajectory.tool_calls[:-1]) == 0.0


@pytest.mark.slow
def test_one_episode_of_the_tiny_agent_through_the_real_loop(tiny_mid, tiny_tokenizer):
    """The tiny agent was never trained on this task: what it writes is whatever it writes; the record must still
    be whole: one reward and one state per assistant turn, rewards from the replay of its calls."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent_loop.backends.hf import TransformersBackend
    from agent_loop.episode.loop import run_episode

    model = AutoModelForCausalLM.from_pretrained(tiny_mid, dtype=torch.float32)
    task = get_task("keydoor")
    backend = TransformersBackend(model, pad_token_id=tiny_tokenizer.pad_token_id or 0)
    config = LoopConfig(max_turns=MAX_TURNS, max_tokens=48, max_response_tokens=768, temperature=1.0)
    t = asyncio.run(run_episode(task, 0, backend, tiny_tokenizer, config, SEED))
    turns = t.metrics["turns"]
    assert turns >= 1 and t.finish_reason in ("stop", "max_turns", "length") and "error" not in t.metrics
    assert len(t.turn_rewards) == turns and t.reward in (0.0, 1.0)
    episode = task.make_episode(0, SEED)
    assert len(task.turn_states(episode, t.messages, t.tool_calls)) == turns
    assert all(r in (0.0, STEP_REWARD, -STEP_REWARD) or abs(r) >= STEP_REWARD for r in t.turn_rewards)
    assert sum(t.turn_rewards) == pytest.approx(sum(s for s in task.turn_rewards(episode, t.messages, t.tool_calls)))
    assert len(t.response_ids) == len(t.spans) == len(t.turn_ids) == len(t.logprobs)
