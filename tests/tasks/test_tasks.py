"""The built-in tasks: deterministic episodes, a safe calculator, rewards checked by hand."""

import json
import re

import pytest
from transformers.utils import get_json_schema

from agent_loop.tasks.builtin import (
    LOOKUP_KEYS,
    ArithmeticTask,
    LookupTask,
    answer_reward,
    calculator,
    make_lookup_tool,
)
from agent_loop.tasks.registry import TASKS, get_task


def reference_value(expression: str) -> int:
    """Plain serial evaluation of "a op b op c" with * before + and -, left to right."""
    tokens = re.findall(r"\d+|[-+*]", expression)
    numbers, operators = [int(tokens[0])], []
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            numbers[-1] *= int(number)
        else:
            operators.append(op)
            numbers.append(int(number))
    total = numbers[0]
    for op, number in zip(operators, numbers[1:]):
        total = total + number if op == "+" else total - number
    return total


def final(text: str) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "expression, value",
    [("37 * 12 + 5", "449"), ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("7 / 2", "3.5"), ("-3 + 1", "-2"),
     ("2 ** 10", "1024"), ("10 / 4 * 2", "5"), ("17 // 5", "3"), ("17 % 5", "2"), (" 1 + 1 ", "2")],
)
def test_calculator_by_hand(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('echo hacked')", "unsupported element 'Call'"),
        ("os.system", "unsupported element 'Attribute'"),
        ("x + 1", "unsupported element 'Name'"),
        ("'a' * 3", "unsupported element 'Constant'"),
        ("lambda: 1", "unsupported element 'Lambda'"),
        ("[1, 2]", "unsupported element 'List'"),
        ("True + 1", "unsupported element 'Constant'"),
        ("1 +", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("9 ** 999", "power too large"),
        ("99999999 * 99999999", "result out of range"),
        ("1 + " * 100 + "1", "longer than 200 characters"),
    ],
)
def test_calculator_rejects_with_clear_error(expression, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        calculator(expression)


def test_calculator_rejects_non_string():
    with pytest.raises(ValueError, match="must be a string"):
        calculator(12)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_episodes_are_deterministic_and_vary(name):
    task = get_task(name)
    first, again = task.make_episode(3, seed=7), task.make_episode(3, seed=7)
    assert first.messages == again.messages and first.answer == again.answer and first.info == again.info
    variants = {(task.make_episode(i, seed=7).messages[0]["content"], task.make_episode(i, seed=7).answer) for i in range(50)}
    assert len(variants) > 40
    assert task.make_episode(3, seed=8).messages != first.messages or task.make_episode(3, seed=8).answer != first.answer
    assert first.info["task"] == name and first.info["index"] == 3 and first.info["seed"] == 7


def test_arithmetic_answers_match_a_serial_reference():
    task = ArithmeticTask()
    for index in range(200):
        episode = task.make_episode(index)
        expression = episode.info["expression"]
        assert episode.messages == [{"role": "user", "content": f"What is {expression}?"}]
        assert episode.answer == reference_value(expression)
        assert episode.tools == [calculator]


def test_arithmetic_reward_by_hand():
    task = ArithmeticTask()
    episode = task.make_episode(0)
    episode.answer = 449  # as for "37 * 12 + 5"
    assert task.reward(episode, final("The answer is 449."), []) == 1.0
    assert task.reward(episode, final("449"), []) == 1.0
    assert task.reward(episode, final("37 * 12 + 5 = 449.0"), []) == 1.0
    assert task.reward(episode, final("449 or 450"), []) == 0.0  # the last number counts
    assert task.reward(episode, final("The answer is 448."), []) == 0.0
    assert task.reward(episode, final("I do not know."), []) == 0.0
    assert task.reward(episode, final(""), []) == 0.0
    assert task.reward(episode, [{"role": "user", "content": "449"}], []) == 0.0  # no assistant reply
    call = {"role": "assistant", "content": "449", "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "449"}}}]}
    assert task.reward(episode, [call], []) == 0.0  # still calling a tool: no final answer
    assert task.reward(episode, final('<tool_call>\n{"name": "calculator", "arguments": {"expression": "449"}}\n</tool_call>'), []) == 0.0
    episode.answer = -77
    assert answer_reward(final("The answer is -77."), -77) == 1.0
    assert answer_reward(final("The answer is 77."), -77) == 0.0


def test_arithmetic_outcome_depends_on_the_tool_call():
    """What the model writes before the observation decides the result it can copy (issue 6's ablation)."""
    task = ArithmeticTask()
    episode = task.make_episode(5)
    right = calculator(episode.info["expression"])
    wrong = calculator(episode.info["expression"] + "+1")
    assert task.reward(episode, final(f"The answer is {right}."), []) == 1.0
    assert task.reward(episode, final(f"The answer is {wrong}."), []) == 0.0


def test_lookup_episode_and_reward_by_hand():
    task = LookupTask()
    episode = task.make_episode(0, seed=1)
    key, table = episode.info["key"], episode.info["table"]
    assert episode.messages == [{"role": "user", "content": f'What is the code of "{key}"?'}]
    assert key in table and set(table) <= set(LOOKUP_KEYS)
    (lookup,) = episode.tools
    assert lookup.__name__ == "lookup"
    assert lookup(key) == table[key] == str(episode.answer)
    assert 100 <= episode.answer <= 999
    assert task.reward(episode, final(f"The code is {table[key]}."), []) == 1.0
    assert task.reward(episode, final(f"The code is {int(table[key]) + 1}."), []) == 0.0
    with pytest.raises(ValueError, match="unknown key 'nothing'; known keys: "):
        lookup("nothing")


def test_lookup_tables_are_per_episode():
    task = LookupTask()
    tables = [task.make_episode(i).info["table"] for i in range(20)]
    assert len({json.dumps(t, sort_keys=True) for t in tables}) == 20
    tool = make_lookup_tool({"apple": "123"})
    assert tool("apple") == "123"


def test_tool_schemas_from_type_hints_and_docstrings():
    assert get_json_schema(calculator) == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The arithmetic expression."}},
                "required": ["expression"],
            },
            "return": {"type": "string"},
        },
    }
    schema = get_json_schema(LookupTask().make_episode(0).tools[0])
    assert schema["function"]["name"] == "lookup"
    assert schema["function"]["parameters"]["properties"] == {"key": {"type": "string", "description": "The key."}}
    assert schema["function"]["parameters"]["required"] == ["key"]


def test_get_task():
    assert set(TASKS) == {"arithmetic", "lookup", "chain", "keydoor"}
    assert isinstance(get_task("arithmetic"), ArithmeticTask) and get_task("lookup").name == "lookup"
    with pytest.raises(ValueError, match="unknown task 'chess'; choose one of"):
        get_task("chess")


def test_the_final_answer_rule_asks_the_episodes_tool_format():
    from agent_loop.episode.tool_formats import find_tool_format
    from agent_loop.tasks.rewards import final_answer

    def messages(text):
        return [{"role": "user", "content": "?"}, {"role": "assistant", "content": text}]

    hermes, mistral = find_tool_format("<tool_call>"), find_tool_format("[TOOL_CALLS]")
    assert final_answer(messages('[TOOL_CALLS][{"name": "f"}] 5'), mistral) == ""  # still calls a tool in Mistral
    assert final_answer(messages("[TOOL_CALLS] 5"), hermes) == "[TOOL_CALLS] 5"  # plain text in Hermes
    assert final_answer(messages("<tool_call> 5"), hermes) == ""
    assert final_answer(messages("[TOOL_CALLS] 5"), None) == ""  # unknown format: any family's markers
    assert final_answer(messages("The answer is 5."), None) == "The answer is 5."
    episode = ArithmeticTask().make_episode(0)
    episode.tool_format = mistral
    assert ArithmeticTask().reward(episode, messages(f"[TOOL_CALLS] {episode.answer}"), []) == 0.0
    episode.tool_format = hermes
    assert ArithmeticTask().reward(episode, messages(f"[TOOL_CALLS] {episode.answer}"), []) == 1.0


def test_a_task_object_gets_the_default_hooks_and_grouping_keeps_its_own():
    from agent_loop.episode.contracts import Task, as_task
    from agent_loop.tasks.grouping import GroupedTask

    class Plain:  # a task that does not subclass Task
        name = "plain"

        def make_episode(self, index, seed=0):
            return ArithmeticTask().make_episode(index, seed)

        def reward(self, episode, messages, tool_calls):
            return -1.0

        def success(self, episode, reward):
            return True

    wrapped = as_task(Plain())
    episode = wrapped.make_episode(0)
    assert isinstance(wrapped, Task) and wrapped.name == "plain"
    assert wrapped.success(episode, -1.0) is True  # its own hook
    assert wrapped.turn_rewards(episode, [], []) is None and wrapped.episode_metrics(episode, [], []) == {}
    grouped = GroupedTask(ArithmeticTask(), group_size=2, question_seed=0)
    assert grouped.episode_metrics(episode, [], []) == {"tool_returned_answer": 0.0}
    assert grouped.success(episode, 0.0) is False and grouped.success(episode, 1.0) is True
    with pytest.raises(TypeError, match="not a task"):
        as_task(object())
