"""Rewards: the built-in rules, the final-answer rule they read, and the scoring of an episode by a
weighted sum of reward functions (docs/design.md section 6a; docs/bring_your_own.md "Rewards").

A reward function takes, by name, any of :data:`REWARD_ARGUMENTS` and returns a number; one that
raises or returns a non-number raises :class:`RewardError` from :func:`score_episode`, so the loop's
scoring ends that episode with finish "error" (reward 0, ``info["reward_error"]``; a training step
drops it), never a crashed run. Rules by name (:func:`get_rule`): ``exact``, ``contains``, ``number``
(:func:`number_close`: thousands separators and scientific notation read, a stated tolerance),
``regex:PATTERN``.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import sysconfig
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Sequence

from agent_loop.episode.contracts import as_reward  # the loop's check too: declared below both
from agent_loop.episode.tool_formats import ANY_CALL_MARKERS
from agent_loop.types import Episode, ToolCallRecord

REWARD_ARGUMENTS = ("completion", "answer", "messages", "tool_calls", "row", "episode")
TURN_REWARD_ARGUMENTS = ("turn", "message", "tool_calls", "answer", "row", "messages", "episode")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# the ``number`` rule's numerals: a sign (ASCII or U+2212), ASCII digits with optional comma thousands groups (each
# group exactly 3 digits), an optional fraction (or a bare ".5"), an optional exponent ("1e3", "2.5E-4")
_NUMERAL = re.compile(r"[-\u2212]?(?:(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?", re.ASCII)
# The ``number`` rule's tolerance, declared once: a reference answer that is an integer must be met exactly
# (3501 is not 3500, at any size); any other must be met within NUMBER_REL_TOL relative (a model that
# rounds 198.447 to 198.45, or 1/3 to 0.3333) or NUMBER_ABS_TOL absolute (a reference near 0).
NUMBER_REL_TOL = 1e-3
NUMBER_ABS_TOL = 1e-9


class RewardError(Exception):
    """A reward function raised or returned a non-number (the message names it, and where in the user's code it
    raised: ``(at FILE:LINE)``); the loop ends the episode with finish "error" and this message in
    ``info["reward_error"]``."""


# files that are not the user's: this package and Python's own libraries (a reward's error names its user frame)
_NOT_USER = tuple(str(Path(p).resolve()) for p in {str(Path(__file__).resolve().parents[1]),
                  *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))})


def user_frame(error: BaseException) -> str | None:
    """``FILE:LINE`` of the deepest frame of ``error``'s traceback in the user's code (not agent_loop, not
    Python's libraries or site-packages), or None when there is none (a built-in rule's own error)."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = str(Path(frame.filename).resolve())
        if not path.startswith(_NOT_USER) and not frame.filename.startswith("<frozen"):
            return f"{frame.filename}:{frame.lineno}"
    return None


def raised(what: str, error: BaseException) -> RewardError:
    """The RewardError for ``what`` (``reward function 'name'``) having raised ``error``: its type, message and
    the place in the user's code it raised from."""
    where = user_frame(error)
    return RewardError(f"{what} raised {type(error).__name__}: {error}" + (f" (at {where})" if where else ""))


def last_number(text: str) -> float | None:
    """The last number in a text (regex ``-?\\d+(\\.\\d+)?``, thousands separators not allowed), or None.

    The built-in tasks' strict reading (their answers are plain integers); the ``number`` rule reads more
    (:func:`numbers_in`)."""
    found = _NUMBER.findall(text or "")
    return float(found[-1]) if found else None


def numbers_in(text: str) -> list[float]:
    """Every number in ``text``, in order: ``3,500`` is 3500.0 (commas only between groups of 3 digits;
    ``1,2345`` is 1 and 2345), ``1e3`` and ``2.5E-4`` are read, ``-`` or U+2212 is a sign. A number too
    large for a float is ``inf``."""
    return [float(m.replace(",", "").replace("\u2212", "-")) for m in _NUMERAL.findall(text or "")]


def reference_number(answer: Any) -> float:
    """A reference answer as a number: a number, or a text holding exactly one (``"$3,500"``, ``"72 apples"``).
    ValueError for anything else or a non-finite value."""
    if isinstance(answer, str):
        found = numbers_in(answer)
        if len(found) != 1:
            raise ValueError(f"reference answer {answer!r} is not one number (the number rule needs one)")
        value = found[0]
    elif isinstance(answer, bytes) or not hasattr(answer, "__float__"):
        raise ValueError(f"reference answer {answer!r} is not a number (the number rule needs one)")
    else:
        value = float(answer)
    if not math.isfinite(value):
        raise ValueError(f"reference answer {answer!r} is not a finite number")
    return value


def exact_match(completion: str, answer: Any) -> float:
    """1.0 if the final answer equals the reference answer, surrounding whitespace ignored."""
    return float(completion.strip() == str(answer).strip())


def contains_match(completion: str, answer: Any) -> float:
    """1.0 if the reference answer appears in the final answer."""
    return float(str(answer).strip() in completion)


def number_match(completion: str, answer: Any) -> float:
    """1.0 if the last number of the final answer equals the (numeric) reference answer exactly
    (:func:`last_number`): the built-in tasks' rule."""
    return float(last_number(completion) == float(answer))


def number_close(completion: str, answer: Any, *, rel_tol: float = NUMBER_REL_TOL,
                 abs_tol: float = NUMBER_ABS_TOL) -> float:
    """The ``number`` rule: 1.0 if the last number of the final answer (:func:`numbers_in`) meets the reference
    answer (:func:`reference_number`): exactly when the reference is an integer, else within ``rel_tol``
    relative or ``abs_tol`` absolute (``math.isclose``). "198.45" meets 198.447, "3,500" and "3.5e3" meet
    3500, "3501" does not. A reference that is not a number raises ValueError (an error episode)."""
    reference = reference_number(answer)
    found = numbers_in(completion)
    if not found:
        return 0.0
    if reference.is_integer():
        return float(found[-1] == reference)
    return float(math.isclose(found[-1], reference, rel_tol=rel_tol, abs_tol=abs_tol))


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


RULES: dict[str, Callable[..., float]] = {"exact": exact_match, "contains": contains_match, "number": number_close}


def get_rule(spec: str) -> Callable[..., float]:
    """A built-in rule by name: ``exact``, ``contains``, ``number`` or ``regex:PATTERN``."""
    if spec.startswith("regex:"):
        return regex_match(spec.removeprefix("regex:"))
    if spec not in RULES:
        raise ValueError(f"unknown reward rule {spec!r}; built-in rules: {', '.join(RULES)}, regex:PATTERN")
    return RULES[spec]


def argument_picker(fn: Callable, available: Sequence[str], what: str) -> Callable[[dict], dict]:
    """Check now that ``fn`` takes only names from ``available``; return a picker of its keyword arguments."""
    # a plain function's signature is read once (verl's AgentLoop builds a task per row with the same rewards);
    # a bound method or callable object is read each time, so the cache never keeps its instance alive
    read = _argument_names if isinstance(fn, types.FunctionType) else _argument_names.__wrapped__
    names = read(fn, tuple(available), what)
    if names is None:
        return lambda values: values
    return lambda values: {name: values[name] for name in names}


@functools.lru_cache(maxsize=256)
def _argument_names(fn: Callable, available: tuple[str, ...], what: str) -> tuple[str, ...] | None:
    """The names of ``available`` that ``fn`` takes (None: it takes ``**kwargs``, so all); TypeError for a
    parameter that cannot be passed by one of those names."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise TypeError(f"{what} {fn!r} has no inspectable signature") from None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    names = []
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) or (p.name not in available and p.default is p.empty):
            raise TypeError(f"{what} {function_name(fn)!r}: cannot pass its parameter {p.name!r}; "
                            f"it may take any of {', '.join(available)} (by name)")
        if p.name in available:
            names.append(p.name)
    return tuple(names)


def function_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


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
    """``sum(weight * fn(...))`` over ``rewards`` (``(name, fn, weight, picker)``). Parts go to ``info["rewards"]``
    when there are several. A function that raises or returns a non-number raises :class:`RewardError` naming
    it (never a partial sum): the loop's scoring makes that an error episode, which training drops."""
    values = {"completion": final_answer(messages, episode.tool_format), "answer": episode.answer, "messages": messages,
              "tool_calls": tool_calls, "row": episode.info.get("row", {}), "episode": episode}
    parts = {}
    for name, fn, _, pick in rewards:
        try:
            parts[name] = as_reward(fn(**pick(values)))
        except Exception as error:  # a user's reward bug: this episode fails (agent_loop.episode.loop._score)
            raise raised(f"reward function {name!r}", error) from error
    if len(parts) > 1:
        episode.info["rewards"] = parts
    return sum(weight * parts[name] for name, _, weight, _ in rewards)
