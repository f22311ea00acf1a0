"""The built-in tasks: rewards a person can check by hand (docs/design.md section 7).

- ``arithmetic``: "What is 37*12+5?" with a ``calculator`` tool.
- ``lookup``: "What is the code of "river"?" with a ``lookup`` tool over a per-episode table.
- ``chain``: "Give the code of the record with this number. What is 37*12+5?": ``calculator``, then
  ``lookup`` of the value, which returns a long record (about 130 tokens of fields, the code last): the
  outcome depends on the first action, two observations back (issue 17's credit-through-observations task).

Reward rule (all three tasks), precisely: take the last assistant message; if it still asks for a tool
(it has ``tool_calls``, or its text holds a call marker of the episode's tool format, e.g. ``<tool_call>``)
the reward is 0.0. Otherwise take the LAST number in its text (regex ``-?\\d+(\\.\\d+)?``, thousands
separators not allowed); the reward is 1.0 if that number equals the episode's ``answer`` exactly, else
0.0. "The answer is 449." scores 1.0 for answer 449; "449 or 450" scores 0.0.

The outcome depends on what the model did before a tool observation: the calculator returns the
value of the expression the model wrote, and the model is meant to copy that value into its answer.

Demonstrations (``demonstrate``, for ``agent-loop warmstart --task NAME``): each task's ideal episode, the
tool calls it needs with the right arguments, then "The answer is N." (arithmetic) or "The code is N."
(lookup, chain). A real model gets the arithmetic wrong on its own ("17 + 25 = 32"), so the calculator is
what it must learn to use; chain's two calls depend on each other (the lookup key is the calculator's value).
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Callable

from agent_loop.episode.contracts import Task, episode_rng
from agent_loop.tasks.rewards import final_answer, last_number, number_match
from agent_loop.types import Episode, ToolCallRecord

_BINARY_OPS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPRESSION_CHARS = 200
_MAX_ABS_VALUE = 10**12  # keeps results printable and powers cheap


def _evaluate(node: ast.AST) -> int | float:
    """Evaluate an arithmetic AST node of numbers, + - * / // % ** and parentheses; nothing else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError(f"power too large: {left} ** {right}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY_OPS[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > _MAX_ABS_VALUE:
            raise ValueError(f"result out of range: {value}")
        return value
    raise ValueError(f"unsupported element {type(node).__name__!r}: only numbers, + - * / // % ** and parentheses")


def format_number(value: int | float) -> str:
    """Integers (and integral floats) without a decimal point; other floats rounded to 6 places."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return str(round(value, 6))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The arithmetic expression.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({error.msg})") from None
    try:
        return format_number(_evaluate(tree.body))
    except (OverflowError, ZeroDivisionError) as error:
        raise ValueError(f"cannot evaluate {expression!r}: {error}") from None


def tool_returned_answer(answer: int | float, tool_calls: list[ToolCallRecord]) -> bool:
    """Whether some tool call returned the answer: the action before the observation was right (the
    calculator got the right expression, the lookup the right key)."""
    return any(c.result is not None and last_number(c.result) == float(answer) for c in tool_calls)


def answer_reward(messages: list[dict], answer: int | float, tool_format=None) -> float:
    """1.0 if the last assistant message is a final answer (it calls no tool in ``tool_format``) whose last
    number equals ``answer`` exactly (``number_match``; the ``number`` rule of DatasetTask allows a tolerance)."""
    return number_match(final_answer(messages, tool_format), answer)


# The reward and the metrics the three built-in tasks share (each class names them as its own).
def _answer_reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
    return answer_reward(messages, episode.answer, episode.tool_format)


def _answer_metrics(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> dict:
    return {"tool_returned_answer": float(tool_returned_answer(episode.answer, tool_calls))}


def solved(calls: list[tuple[str, dict]], answer: str) -> list[dict]:
    """A demonstration (``Task.demonstrate``): one assistant turn per ``(tool name, arguments)`` in ``calls``
    (their results are left out: warm start runs the tools), then the final answer ``answer``."""
    turns = [{"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": arguments}]}
             for name, arguments in calls]
    return turns + [{"role": "assistant", "content": answer}]


class ArithmeticTask(Task):
    """Multi-step integer arithmetic that the model is meant to solve with the ``calculator`` tool.

    Expressions have two operators drawn from + - * on numbers 2..99, for example "37*12+5".
    """

    name = "arithmetic"
    reward = _answer_reward
    episode_metrics = _answer_metrics

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        rng = episode_rng(self.name, seed, index)
        a, b, c = (rng.randint(2, 99) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        # no spaces: with Qwen-style pre-tokenization every digit and operator is then one token
        expression = f"{a}{op1}{b}{op2}{c}"
        question = f"What is {expression}?"
        return Episode(
            messages=[{"role": "user", "content": question}],
            tools=[calculator],
            answer=int(calculator(expression)),
            info={"task": self.name, "index": index, "seed": seed, "expression": expression},
        )

    def demonstrate(self, episode: Episode, rng: random.Random) -> list[dict]:
        """``calculator(expression)``, then "The answer is N."."""
        return solved([("calculator", {"expression": episode.info["expression"]})], f"The answer is {episode.answer}.")


# Keys are short common words: the tiny tokenizer learns each as one piece the model can copy
# (random 6-character keys were not learned, docs/platform.md).
LOOKUP_KEYS = (
    "apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "garden", "rocket",
    "silver", "forest", "window", "planet", "orange", "pencil", "mirror", "castle", "island", "dragon",
    "bridge", "carrot", "violet", "winter", "summer", "falcon", "harbor", "meadow", "copper", "marble",
)
LOOKUP_TABLE_SIZE = 5


def make_lookup_tool(table: dict[str, str]) -> Callable[[str], str]:
    """A ``lookup`` tool over one episode's table."""

    def lookup(key: str) -> str:
        """Look up the code stored under a key.

        Args:
            key: The key.
        """
        if key not in table:
            raise ValueError(f"unknown key {key!r}; known keys: {', '.join(sorted(table))}")
        return table[key]

    return lookup


class LookupTask(Task):
    """Key-value lookup: a per-episode table of word keys and random 3-digit codes behind a ``lookup`` tool.

    The model cannot know the code without calling ``lookup`` with the key named in the question.
    """

    name = "lookup"
    reward = _answer_reward
    episode_metrics = _answer_metrics

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        rng = episode_rng(self.name, seed, index)
        keys = rng.sample(LOOKUP_KEYS, LOOKUP_TABLE_SIZE)
        table = {key: str(rng.randint(100, 999)) for key in keys}
        key = rng.choice(keys)
        question = f'What is the code of "{key}"?'
        return Episode(
            messages=[{"role": "user", "content": question}],
            tools=[make_lookup_tool(table)],
            answer=int(table[key]),
            info={"task": self.name, "index": index, "seed": seed, "key": key, "table": table},
        )

    def demonstrate(self, episode: Episode, rng: random.Random) -> list[dict]:
        """``lookup(key)``, then "The code is N."."""
        return solved([("lookup", {"key": episode.info["key"]})], f"The code is {episode.answer}.")


# The fields of a chain record before its code (one per line).
RECORD_FIELDS = (
    "owner", "shelf", "weight", "height", "width", "depth", "batch", "stock", "price", "level", "zone", "count",
)


def make_record(rng: random.Random, key: str, code: int) -> str:
    """A record as a catalogue tool might return it, one ``name: value`` line per field in a fixed order:
    ``key``, a 3-digit number for each of RECORD_FIELDS, then ``code``."""
    lines = [f"key: {key}"] + [f"{name}: {rng.randint(100, 999)}" for name in RECORD_FIELDS] + [f"code: {code}"]
    return "\n".join(lines)


class ChainTask(Task):
    """Compute, then look up: "Give the code of the record with this number. What is 37*12+5?".

    Tools: ``calculator`` and ``lookup``, over a per-episode table of LOOKUP_TABLE_SIZE records (see
    :func:`make_record`) whose keys are the expression's value and nearby numbers. The ideal episode is
    three turns: ``calculator("37*12+5")`` (returns 449), ``lookup("449")`` (a record of about 130 tokens),
    the answer "The code is 417.". Whether the answer can be right is decided by the first action, whose
    credit has to travel back through both observations, the long record included. ``episode_metrics``
    adds ``first_call_right`` (the first tool call returned the record's number) to
    ``tool_returned_answer`` (the right record was looked up: its last number is the code).
    """

    name = "chain"
    reward = _answer_reward

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        rng = episode_rng(self.name, seed, index)
        a, b, c = (rng.randint(2, 99) for _ in range(3))
        expression = f"{a}{rng.choice('+-*')}{b}{rng.choice('+-*')}{c}"  # as in arithmetic
        key = calculator(expression)
        keys = {key}
        while len(keys) < LOOKUP_TABLE_SIZE:  # numbers a slightly wrong expression gives
            keys.add(str(int(key) + rng.choice((-1, 1)) * rng.randint(1, 99)))
        codes = {k: rng.randint(100, 999) for k in sorted(keys)}
        table = {k: make_record(rng, k, code) for k, code in codes.items()}
        # the question ends as an arithmetic one does, so the first call is copied the same way
        question = f"Give the code of the record with this number. What is {expression}?"
        return Episode(
            messages=[{"role": "user", "content": question}],
            tools=[calculator, make_lookup_tool(table)],
            answer=codes[key],
            info={"task": self.name, "index": index, "seed": seed, "expression": expression, "key": key, "table": table},
        )

    def demonstrate(self, episode: Episode, rng: random.Random) -> list[dict]:
        """Two dependent calls: ``calculator(expression)`` (returns the key), ``lookup(key)``, then "The code is N."."""
        info = episode.info
        return solved([("calculator", {"expression": info["expression"]}), ("lookup", {"key": info["key"]})],
                      f"The code is {episode.answer}.")

    def episode_metrics(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> dict:
        first = tool_calls[0] if tool_calls else None
        right = first is not None and first.name == "calculator" and first.result == episode.info["key"]
        return {**_answer_metrics(self, episode, messages, tool_calls), "first_call_right": float(right)}
