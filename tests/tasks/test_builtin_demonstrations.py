"""The built-in tasks' demonstrations (``demonstrate``, for ``agent-loop warmstart --task NAME``), with the real
tokenizers and chat templates (the tiny agent's and Qwen2.5's) through the real agent loop.

Checks: every demonstration replays exactly (the loop's record of it is the demonstration; the template is
exact turn by turn) and scores 1.0 with the task's own reward; a model that writes the same turns as text
(written out by hand here, not by the demonstration code) gets the very same tokens and messages; chain's two
calls depend on each other (the lookup's key is what the calculator returned); a wrong answer in place of the
demonstrated one scores 0 with the same reward, so the check above could fail.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.builtin import calculator
from agent_loop.tasks.registry import get_task
from agent_loop.training.demonstrations import has_demonstrations, replay
from masking import SpanKind

EPISODES = range(6)
SEED = 5
NAMES = ("arithmetic", "lookup", "chain")


def call_text(name: str, arguments: dict) -> str:
    """A Hermes/Qwen tool call as a model writes it (both templates here render calls so)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def turns_by_hand(name: str, episode) -> list[str]:
    """The text of each assistant turn of ``episode``'s ideal play, written from the episode's info alone."""
    info = episode.info
    if name == "arithmetic":
        return [call_text("calculator", {"expression": info["expression"]}), f"The answer is {episode.answer}."]
    if name == "lookup":
        return [call_text("lookup", {"key": info["key"]}), f"The code is {episode.answer}."]
    return [call_text("calculator", {"expression": info["expression"]}), call_text("lookup", {"key": info["key"]}),
            f"The code is {episode.answer}."]


@pytest.fixture(params=["tiny", "qwen"])
def tokenizer(request, tiny_tokenizer, qwen_tokenizer):
    return {"tiny": tiny_tokenizer, "qwen": qwen_tokenizer}[request.param]


@pytest.mark.parametrize("name", NAMES)
def test_demonstrations_replay_exactly_and_succeed_with_the_tasks_reward(name, tokenizer):
    task = get_task(name)
    assert has_demonstrations(task)
    replayed = replay(task, tokenizer, EPISODES, SEED, progress=False)
    assert [t.info["index"] for t in replayed] == list(EPISODES)
    for trajectory in replayed:
        episode = task.make_episode(trajectory.info["index"], SEED)
        assert trajectory.finish_reason == "stop" and trajectory.metrics["template_exact"]
        assert trajectory.reward == 1.0 and trajectory.success
        # the task's own reward on the loop's record, called here directly
        assert task.reward(episode, trajectory.messages, trajectory.tool_calls) == 1.0
        assert all(c.error_kind is None for c in trajectory.tool_calls)
        expected = turns_by_hand(name, episode)
        assert [m["role"] for m in trajectory.messages[1:]] == ["assistant", "tool"] * (len(expected) - 1) + ["assistant"]
        assert trajectory.messages[-1]["content"] == expected[-1]
        assert SpanKind.OBSERVATION in trajectory.spans and SpanKind.ASSISTANT in trajectory.spans


@pytest.mark.parametrize("name", NAMES)
def test_a_model_writing_the_demonstrated_turns_gets_the_same_record(name, tokenizer):
    task = get_task(name)
    episodes = {task.make_episode(i, SEED).messages[0]["content"]: task.make_episode(i, SEED) for i in EPISODES}

    def script(prompt):  # a model that writes the ideal turns as text
        text = tokenizer.decode(prompt)
        episode = next(e for question, e in episodes.items() if question in text)
        turn = text.count("<|im_start|>assistant") - 1
        return tokenizer.encode(turns_by_hand(name, episode)[turn], add_special_tokens=False)

    config = LoopConfig(max_turns=3, max_tokens=64, max_response_tokens=1024)
    played = asyncio.run(run_rollouts(task, ScriptedBackend(script), tokenizer, EPISODES, config, seed=SEED,
                                      progress=False))
    replayed = replay(task, tokenizer, EPISODES, SEED, progress=False)
    for loop, demo in zip(played, replayed):
        assert loop.success and loop.metrics["template_exact"]
        assert demo.prompt_ids == loop.prompt_ids and demo.response_ids == loop.response_ids
        assert demo.spans == loop.spans and demo.turn_ids == loop.turn_ids and demo.messages == loop.messages
        assert [c.result for c in demo.tool_calls] == [c.result for c in loop.tool_calls]


def test_chain_demonstrations_make_two_dependent_calls(tiny_tokenizer):
    task = get_task("chain")
    for trajectory in replay(task, tiny_tokenizer, EPISODES, SEED, progress=False):
        episode = task.make_episode(trajectory.info["index"], SEED)
        first, second = trajectory.tool_calls
        assert (first.name, second.name) == ("calculator", "lookup")
        assert first.result == calculator(episode.info["expression"]) == second.arguments["key"]
        assert second.result.splitlines()[-1] == f"code: {episode.answer}"
        assert trajectory.metrics["task"] == {"tool_returned_answer": 1.0, "first_call_right": 1.0}


@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_final_answer_scores_zero_with_the_same_reward(name, tiny_tokenizer):
    task = get_task(name)
    trajectory = replay(task, tiny_tokenizer, range(1), SEED, progress=False)[0]
    episode = task.make_episode(0, SEED)
    wrong = [*trajectory.messages[:-1], {"role": "assistant", "content": f"The answer is {episode.answer + 1}."}]
    assert task.reward(episode, wrong, trajectory.tool_calls) == 0.0
