"""The chain task (issue 17): lookup, then compute. Episodes, tools, reward and metrics through the real loop
with a scripted model and the tiny agent's real tokenizer; the chain stage's data. No training here."""

import asyncio
import re

import pytest
from transformers.utils import get_json_schema

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.builtin import LOOKUP_TABLE_SIZE, RECORD_FIELDS, ChainTask, calculator
from agent_loop.tasks.registry import get_task
from agent_loop.tiny.chain import CHAIN_SHARE, MID_STEPS, PHASES, chain_agent_path, chain_task_for
from agent_loop.tiny.data import dialogue, encode_batch, ideal_calls, render
from agent_loop.types import SpanKind

EPISODES = 6
# the ablation's budget (examples/ablation_returns.py --task chain --max-response-tokens 512)
CONFIG = dict(max_turns=3, max_tokens=48, max_response_tokens=512)


def fields(record: str) -> dict[str, str]:
    return dict(line.split(": ") for line in record.splitlines())


def test_chain_episode_by_hand():
    task = get_task("chain")
    episode = task.make_episode(4, seed=2)
    key, table, expression = episode.info["key"], episode.info["table"], episode.info["expression"]
    calc, lookup = episode.tools
    assert (calc, lookup.__name__) == (calculator, "lookup")
    assert re.fullmatch(r"\d+[-+*]\d+[-+*]\d+", expression) and key == calculator(expression)
    assert episode.messages == [
        {"role": "user", "content": f"Give the code of the record with this number. What is {expression}?"}]
    assert len(table) == LOOKUP_TABLE_SIZE and key in table
    assert all(0 < abs(int(k) - int(key)) < 100 for k in table if k != key)  # near misses of a wrong expression
    record = fields(lookup(key))
    assert list(record) == ["key", *RECORD_FIELDS, "code"] and record["key"] == key
    assert all(re.fullmatch(r"\d{3}", value) for name, value in record.items() if name != "key")
    assert episode.answer == int(record["code"])
    assert len({fields(r)["code"] for r in table.values()}) > 1  # another record, most likely another code
    assert [get_json_schema(t)["function"]["name"] for t in episode.tools] == ["calculator", "lookup"]


def episodes_by_question(seed: int = 0) -> dict[str, object]:
    task = ChainTask()
    return {task.make_episode(i, seed).messages[0]["content"]: task.make_episode(i, seed) for i in range(EPISODES)}


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def play(tokenizer, policy) -> list:
    """Play EPISODES chain episodes through the real loop; ``policy(episode, text, turn)`` writes each reply."""
    episodes = episodes_by_question()

    def script(prompt):
        text = tokenizer.decode(prompt)
        question = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text).group(1)
        turn = text.count("<|im_start|>assistant") - 1
        return tokenizer.encode(policy(episodes[question], text, turn), add_special_tokens=False)

    return asyncio.run(run_rollouts(ChainTask(), ScriptedBackend(script), tokenizer, range(EPISODES),
                                    LoopConfig(**CONFIG), progress=False))


def looked_up_code(text: str) -> str:
    return re.findall(r"code: (\d+)", text)[-1]


def ideal(episode, text, turn):
    if turn == 0:
        return call("calculator", f'{{"expression": "{episode.info["expression"]}"}}')
    if turn == 1:
        value = re.findall(r"<tool_response>\n(-?\d+)\n</tool_response>", text)[-1]
        return call("lookup", f'{{"key": "{value}"}}')
    return f"The code is {looked_up_code(text)}."


def test_ideal_episodes_succeed_with_long_first_observations(tiny_tokenizer):
    for t in play(tiny_tokenizer, ideal):
        assert t.reward == 1.0 and t.success and t.finish_reason == "stop"
        assert t.metrics["task"] == {"tool_returned_answer": 1.0, "first_call_right": 1.0}
        assert [c.name for c in t.tool_calls] == ["calculator", "lookup"] and t.metrics["turns"] == 3
        first, second = (turn["observation"] for turn in t.metrics["turn_tokens"][:2])
        assert first < 25 and 100 <= second <= 250  # a short result, then a realistic record
        assert t.metrics["observation_truncations"] == 0
        # the credit path: first action, short observation, second action, ~130 observation tokens, answer
        kinds = [k for i, k in enumerate(t.spans) if i == 0 or k != t.spans[i - 1]]
        assert kinds == [SpanKind.ASSISTANT, SpanKind.OBSERVATION] * 2 + [SpanKind.ASSISTANT]


def test_the_first_action_decides(tiny_tokenizer):
    """A wrong expression gives another number: its record (or an unknown key) fails the episode, however
    right everything after it is."""

    def wrong_expression(episode, text, turn):
        if turn == 0:
            return call("calculator", f'{{"expression": "{episode.info["expression"]}+1"}}')
        return ideal(episode, text, turn)

    for t in play(tiny_tokenizer, wrong_expression):
        assert t.reward == 0.0 and not t.success
        assert t.metrics["task"] == {"tool_returned_answer": 0.0, "first_call_right": 0.0}
        assert t.tool_calls[1].name == "lookup" and t.tool_calls[1].arguments["key"] != t.info["key"]

    def wrong_record(episode, text, turn):  # the right value, then another record of the table
        if turn == 1:
            other = next(k for k in episode.info["table"] if k != episode.info["key"])
            return call("lookup", f'{{"key": "{other}"}}')
        return ideal(episode, text, turn)

    results = play(tiny_tokenizer, wrong_record)
    for t in results:
        assert t.metrics["task"]["first_call_right"] == 1.0 and t.reward == t.metrics["task"]["tool_returned_answer"]
    assert sum(t.reward for t in results) < len(results)  # codes of other records rarely coincide


def test_wrong_field_or_no_tool_fails(tiny_tokenizer):
    def wrong_field(episode, text, turn):  # copies the record's "price" instead of its code
        if turn == 2:
            price = re.findall(r"price: (\d+)", text)[-1]
            return f"The code is {price}."
        return ideal(episode, text, turn)

    for t in play(tiny_tokenizer, wrong_field):
        assert t.metrics["task"] == {"tool_returned_answer": 1.0, "first_call_right": 1.0}
        assert t.reward == float(re.findall(r"price: (\d+)", t.messages[-2]["content"])[-1] == str(t.info["answer"]))

    def guess(episode, text, turn):  # answers without a tool
        return "The code is 500."

    for t in play(tiny_tokenizer, guess):
        assert t.reward == float(t.info["answer"] == 500)
        assert t.metrics["task"] == {"tool_returned_answer": 0.0, "first_call_right": 0.0}
        assert t.tool_calls == [] and t.metrics["turns"] == 1


def test_chain_dialogues_fit_the_tiny_agents_context(tiny_tokenizer):
    """Ideal chain dialogues (the chain stage's training data) fit the model's 1024 positions, and their
    response part the ablation's 512-token budget."""
    texts = [render(tiny_tokenizer, *dialogue("chain", i, 11)) for i in range(64)]
    input_ids, _, labels = encode_batch(tiny_tokenizer, texts)
    lengths = (input_ids != tiny_tokenizer.pad_token_id).sum(dim=1)
    assert int(lengths.max()) < 1024
    prompt = render(tiny_tokenizer, *dialogue("chain", 0, 11))
    prompt_tokens = len(tiny_tokenizer(prompt[: prompt.index("<|im_start|>assistant")])["input_ids"])
    assert int(lengths.max()) - prompt_tokens < CONFIG["max_response_tokens"]
    assert (labels != -100).sum(dim=1).min() > 30  # three assistant turns are supervised


def test_chain_dialogue_is_the_ideal_episode():
    messages, tools = dialogue("chain", 3, 1)
    episode = ChainTask().make_episode(3, 1)
    assert ideal_calls("chain", episode.info) == [("calculator", {"expression": episode.info["expression"]}),
                                                  ("lookup", {"key": episode.info["key"]})]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert messages[2]["content"] == episode.info["key"]
    assert messages[4]["content"] == episode.info["table"][episode.info["key"]]
    assert messages[5]["content"] == f"The code is {episode.answer}."
    assert [t["function"]["name"] for t in tools] == ["calculator", "lookup"]


def test_chain_stage_mix_is_deterministic_and_keeps_the_default_tasks():
    names = [chain_task_for(i, 5) for i in range(2000)]
    assert names == [chain_task_for(i, 5) for i in range(2000)]
    assert names.count("chain") / len(names) == pytest.approx(CHAIN_SHARE, abs=0.04)
    assert {"arithmetic", "lookup"} <= set(names)


def test_chain_stage_settings():
    assert max(MID_STEPS) <= PHASES[-1][0]  # the mid candidates lie in the last phase
    with pytest.raises(ValueError, match="unknown stage 'best'; choose one of"):
        chain_agent_path("best")
