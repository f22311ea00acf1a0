"""Rewards: the built-in rules, the final-answer rule they read, and the scoring of an episode by a
weighted sum of reward functions (docs/design.md section 6a; README "Rewards").

A reward function takes, by name, any of :data:`REWARD_ARGUMENTS` and returns a number; one that
raises or returns a non-number is recorded on the episode (``info["reward_error"]``), never a crashed
run. Rules by name (:func:`get_rule`): ``exact``, ``contains``, ``number``, ``regex:PATTERN``.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, Callable, Sequence

from agent_loop.episode.tool_formats import ANY_CALL_MARKERS
from agent_loop.types import Episode, ToolCallRecord

REWARD_ARGUMENTS = ("completion", "answer", "messages", "tool_calls", "row", "episode")
TURN_REWARD_ARGUMENTS = ("turn", "message", "tool_calls", "answer", "row", "messages", "episode")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number in a text (regex ``-?\\d+(\\.\\d+)?``, thousands separators not allowed), or None."""
    found = _NUMBER.findall(text or "")
    return float(found[-1]) if found else None


def exact_match(completion: str, answer: Any) -> float:
    """1.0 if the final answer equals the reference answer, surrounding whitespace ignored."""
    return float(completion.strip() == str(answer).strip())


def contains_match(completion: str, answer: Any) -> float:
    """1.0 if the reference answer appears in the final answer."""
    return float(str(answer).strip() in completion)


def number_match(completion: str, answer: Any) -> float:
    """1.0 if the last number of the final answer equals the (numeric) reference answer (:func:`last_number`)."""
    return float(last_number(completion) == float(answer))


def regex_match(pattern: str) -> Callable[..., float]:
    """A rule: the last match of ``pattern`` in the final answer (its first group, if it has one) must equal
    the reference answer; without a reference answer (None), any match scores 1.0 (a format reward)."""
    compiled = re.compile(pattern)

    def rule(completion: str, answer: Any) -> float:
        matches = list(compiled.finditer(completion))
        if not matches:
            return 0.0
        if answer is None:
            return 1.0
        last = matches[-1]
        found = last.group(1) if compiled.groups else last.group(0)
        return float((found or "").strip() == str(answer).strip())

    rule.__name__ = f"regex:{pattern}"
    return rule


RULES: dict[str, Callable[..., float]] = {"exact": exact_match, "contains": contains_match, "number": number_match}


def get_rule(spec: str) -> Callable[..., float]:
    """A built-in rule by name: ``exact``, ``contains``, ``number`` or ``regex:PATTERN``."""
    if spec.startswith("regex:"):
        return regex_match(spec.removeprefix("regex:"))
    if spec not in RULES:
        raise ValueError(f"unknown reward rule {spec!r}; built-in rules: {', '.join(RULES)}, regex:PATTERN")
    return RULES[spec]


def argument_picker(fn: Callable, available: Sequence[str], what: str) -> Callable[[dict], dict]:
    """Check now that ``fn`` takes only names from ``available``; return a picker of its keyword arguments."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise TypeError(f"{what} {fn!r} has no inspectable signature") from None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return lambda values: values
    names = []
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) or (p.name not in available and p.default is p.empty):
            raise TypeError(f"{what} {function_name(fn)!r}: cannot pass its parameter {p.name!r}; "
                            f"it may take any of {', '.join(available)} (by name)")
        if p.name in available:
            names.append(p.name)
    return lambda values: {name: values[name] for name in names}


def function_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def as_reward(value: Any) -> float:
    """A reward function's return value as a finite float (bools, ints, numpy and torch scalars are fine)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} {value!r}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"returned {number}, not a finite number")
    return number


def final_answer(messages: list[dict], tool_format=None) -> str:
    """The text of the last assistant message, or "" if there is none or it still calls a tool: it has
    ``tool_calls``, or its text holds a call marker of ``tool_format`` (the episode's
    :class:`~agent_loop.episode.tool_formats.ToolFormat`; unknown: any format's)."""
    replies = [m for m in messages if m.get("role") == "assistant"]
    text = (replies[-1].get("content") or "") if replies else ""
    markers = tool_format.call_markers if tool_format is not None else ANY_CALL_MARKERS
    if not replies or replies[-1].get("tool_calls") or any(m in text for m in markers):
        return ""
    return text


def reward_terms(reward: Callable | str | Sequence[Callable | str], weights: Sequence[float] | None = None) -> list[tuple]:
    """``(name, fn, weight, picker)`` per reward function or rule of ``reward`` (one, or a list), for
    :func:`score_episode`. ValueError/TypeError now, for a bad rule, weight count or signature."""
    specs = list(reward) if isinstance(reward, (list, tuple)) else [reward]
    if not specs:
        raise ValueError("give at least one reward function or rule")
    functions = [get_rule(s) if isinstance(s, str) else s for s in specs]
    for fn in functions:
        if not callable(fn):
            raise TypeError(f"a reward must be a callable or a rule name, got {fn!r}")
    weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
    if len(weights) != len(functions):
        raise ValueError(f"{len(weights)} reward_weights for {len(functions)} reward functions")
    names = [function_name(fn) for fn in functions]
    names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
    return [(n, fn, w, argument_picker(fn, REWARD_ARGUMENTS, "reward function")) for n, fn, w in zip(names, functions, weights)]


def score_episode(rewards: list[tuple], episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
    """``sum(weight * fn(...))`` over ``rewards`` (``(name, fn, weight, picker)``); on any failure 0.0 and
    ``episode.info["reward_error"]`` (never a partial sum). Parts go to ``info["rewards"]`` when there are several."""
    values = {"completion": final_answer(messages, episode.tool_format), "answer": episode.answer, "messages": messages,
              "tool_calls": tool_calls, "row": episode.info.get("row", {}), "episode": episode}
    parts = {}
    for name, fn, _, pick in rewards:
        try:
            parts[name] = as_reward(fn(**pick(values)))
        except Exception as error:  # a user's reward bug is recorded on the episode, not a crashed run
            episode.info["reward_error"] = f"reward function {name!r} raised {type(error).__name__}: {error}"
            return 0.0
    if len(parts) > 1:
        episode.info["rewards"] = parts
    return sum(weight * parts[name] for name, _, weight, _ in rewards)
