"""The records every part of the rollout side shares (docs/design.md sections 2 and 5): an episode to
play, the tool calls made in it, and the Trajectory it becomes (what the JSONL files hold).

Kept in one small file so that tools, tasks, the loop, the runners and the inspector agree on one
shape of data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from masking.kinds import SpanKind

# finish_reason values of a Trajectory (docs/design.md section 5)
FINISH_REASONS = ("stop", "max_turns", "length", "observation_overflow", "error")

# error kinds of a tool call, each counted in Trajectory.metrics["tool_errors"]
TOOL_ERROR_KINDS = ("malformed_json", "unknown_tool", "invalid_arguments", "exception", "timeout")



def episode_session_id(task_name: str, seed: int, index: int) -> str:
    """The session id of episode ``index`` of task ``task_name`` under ``seed`` (``"name:seed:index"``): the one
    key the loop sends with each of an episode's requests and records in ``info["session_id"]``.

    Backends key per-episode state by it: the HTTP backend keeps an episode on one server, and the warm start's
    replay backend (:class:`agent_loop.recipes.warmstart.ReplayBackend`) answers an episode's k-th request with its
    demonstration's k-th turn. Everyone who needs an episode's key calls this, so a change here changes them all.
    """
    return f"{task_name}:{seed}:{index}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _numpy_value(value: Any) -> Any:
    """A numpy (or torch) scalar or array as plain JSON values; TypeError for anything else."""
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _clean(value: Any, counts: Counter) -> Any:
    """``value`` as strict JSON values: non-finite numbers -> None, lone surrogates -> U+FFFD, numpy values ->
    their Python values, anything else -> its ``str``; each repair counted in ``counts``."""
    if isinstance(value, str):
        value, replaced = _SURROGATE.subn("\ufffd", value)
        counts["surrogates"] += replaced
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        counts["non_finite"] += 1
        return None
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, dict):
        return {_clean(k if isinstance(k, str) else str(k), counts): _clean(v, counts) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v, counts) for v in value]
    try:
        return _clean(_numpy_value(value), counts)
    except TypeError:
        counts["unserialisable"] += 1
        return _clean(str(value), counts)


def json_values(value: Any) -> tuple[Any, dict[str, int]]:
    """``value`` made of strict JSON values (the replacements of :func:`strict_json`) and the repairs made."""
    counts: Counter = Counter()
    value = _clean(value, counts)
    return value, {k: v for k, v in counts.items() if v}


def strict_json(data: Any) -> tuple[str, dict[str, int]]:
    """``data`` as strict JSON text (no NaN/Infinity tokens, encodable as UTF-8) and the repairs made.

    Numpy/torch scalars and arrays become their values (not a repair). What strict JSON cannot hold is
    replaced and counted: a NaN or infinite number by ``null`` (``non_finite``), a lone surrogate by
    U+FFFD (``surrogates``), any other object by its ``str`` (``unserialisable``).
    """
    try:  # the common case: one C-speed pass
        text = json.dumps(data, ensure_ascii=False, allow_nan=False, default=_numpy_value)
        text.encode("utf-8")
        return text, {}
    except (ValueError, TypeError, UnicodeEncodeError):
        pass
    counts: Counter = Counter()
    text = json.dumps(_clean(data, counts), ensure_ascii=False, allow_nan=False)
    return text, {k: v for k, v in counts.items() if v}


def _finite_numbers(values) -> bool:
    """Whether every value is a finite real number (bools, strings and None are not)."""
    kinds = set(map(type, values))
    if not all(issubclass(k, numbers.Real) and k is not bool for k in kinds):
        return False
    return all(map(math.isfinite, values))


@dataclass
class ToolCallRecord:
    """One tool call the model made, and what came of it."""

    name: str
    arguments: Any  # dict when the call parsed; the raw text otherwise
    turn: int
    result: str | None = None
    error_kind: str | None = None  # one of TOOL_ERROR_KINDS, None on success
    error: str | None = None  # human-readable message (also what the model reads)
    latency_s: float = 0.0
    call_id: str | None = None  # unique in the episode (ChatFormatter.call_id); the tool message's tool_call_id
    result_chars: int | None = None  # the result's original length in characters, when it was cut to a budget


@dataclass
class Trajectory:
    """One episode, unpadded. Lists are per response token unless said otherwise."""

    prompt_ids: list[int]
    response_ids: list[int]
    spans: list[int]  # masking.SpanKind values
    turn_ids: list[int]  # index of the assistant turn a token belongs to
    logprobs: list[float]  # sampling logprob on ASSISTANT tokens, 0.0 elsewhere
    messages: list[dict]  # the chat as messages, tool calls and tool results included
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    reward: float = 0.0  # outcome reward
    turn_rewards: list[float] | None = None  # optional reward per assistant turn
    finish_reason: str = "stop"
    truncated: bool = False
    metrics: dict = field(default_factory=dict)  # timings, token counts, tool error counts
    info: dict = field(default_factory=dict)  # task name, episode index, seed, answer, success, model path
    # per response token, the returns and advantages a training step used on this episode (the trainer's
    # rollouts/step_NNNNNN.jsonl); None in rollout files and for episodes a step did not train on
    returns: list[float] | None = None
    advantages: list[float] | None = None
    # per response token, the policy version (trainer step of the weights) that sampled it on ASSISTANT tokens,
    # -1 elsewhere; None when the backend reports no version. An episode that ran across a weight update
    # (agent_loop/runners/producer.py: partial rollouts) holds several versions
    policy_versions: list[int] | None = None

    def check(self) -> None:
        """Raise ValueError if the per-token lists disagree in length, hold a span kind other than
        ASSISTANT/OBSERVATION, or a reward has no ASSISTANT token to sit on (it would be lost)."""
        n = len(self.response_ids)
        for name in ("spans", "turn_ids", "logprobs", "returns", "advantages", "policy_versions"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries but response_ids has {n}")
        for pos, kind in enumerate(self.spans):
            if kind not in (SpanKind.ASSISTANT, SpanKind.OBSERVATION):
                raise ValueError(f"spans[{pos}] = {kind!r}, expected 1 (ASSISTANT) or 2 (OBSERVATION)")
        if (self.reward or any(self.turn_rewards or [])) and SpanKind.ASSISTANT not in self.spans:
            raise ValueError("a nonzero reward but no ASSISTANT token to put it on")
        if self.turn_rewards is not None:
            turns = {t for t, s in zip(self.turn_ids, self.spans) if s == SpanKind.ASSISTANT}
            if len(self.turn_rewards) != len(turns):
                raise ValueError(f"turn_rewards has {len(self.turn_rewards)} entries for {len(turns)} assistant turns")
        self._check_values()

    def _check_values(self) -> None:
        """Raise ValueError for a value of the wrong kind (a record written by another program or edited by hand;
        the loop's records always pass): ids that are not integers, a logprob, return, advantage, reward or turn
        reward that is not a finite number (``null`` where NaN was written), info or metrics not an object."""
        for name in ("prompt_ids", "response_ids", "turn_ids"):
            kinds = set(map(type, getattr(self, name)))  # one C-speed pass; the few kinds checked after
            if not all(issubclass(k, numbers.Integral) and k is not bool for k in kinds):
                raise ValueError(f"{name} holds a value that is not an integer")
        for name in ("logprobs", "returns", "advantages", "turn_rewards"):
            values = getattr(self, name)
            if values is not None and not _finite_numbers(values):
                raise ValueError(f"{name} holds a value that is not a finite number")
        if not _finite_numbers([self.reward]):
            raise ValueError(f"reward {self.reward!r} is not a finite number")
        if not isinstance(self.finish_reason, str) or not isinstance(self.info, dict) or not isinstance(self.metrics, dict):
            raise ValueError("finish_reason must be a string, info and metrics JSON objects")

    @property
    def success(self) -> bool:
        """Whether the task judged the episode a success (recorded by the loop; reward > 0 for old records)."""
        recorded = self.info.get("success")
        return bool(recorded) if recorded is not None else self.reward > 0

    @property
    def session_id(self) -> str:
        """The session (one episode) this record is a segment of: ``info["session_id"]``, which the loop and the
        proxy both record; for an older record, the loop's key of its episode (:func:`episode_session_id`)."""
        recorded = self.info.get("session_id")
        if recorded is not None:
            return str(recorded)
        return episode_session_id(self.info.get("task"), self.info.get("seed"), self.info.get("index"))

    @property
    def segment(self) -> int:
        """This record's place in its session: 0, 1, ... (a session whose agent rewrote its history has a segment
        per context the model saw; the loop's own episodes have one)."""
        return int(self.info.get("segment", 0))

    def to_json(self) -> str:
        """The record as one line of strict JSON (:func:`strict_json`); what had to be replaced is counted in
        the line's ``metrics["json_repairs"]`` (the Trajectory itself is left as it is)."""
        data = dataclasses.asdict(self)
        text, repairs = strict_json(data)
        if not repairs:
            return text
        warnings.warn("values JSON cannot hold (NaN/inf numbers, lone surrogates, objects) were replaced in the "
                      "records written; each record counts its own in metrics.json_repairs", stacklevel=2)
        data["metrics"] = {**data["metrics"], "json_repairs": repairs}
        return strict_json(data)[0]

    @classmethod
    def from_dict(cls, data: dict) -> "Trajectory":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        missing = {"prompt_ids", "response_ids", "spans", "turn_ids", "logprobs", "messages"} - set(data)
        if unknown or missing:
            raise ValueError(f"not a Trajectory: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        data = dict(data)
        data["tool_calls"] = [ToolCallRecord(**c) for c in data.get("tool_calls", [])]
        return cls(**data)

    @classmethod
    def from_json(cls, line: str) -> "Trajectory":
        return cls.from_dict(json.loads(line))


def count_sessions(trajectories) -> int:
    """How many episodes (sessions) the records ``trajectories`` hold: a session's segments count once."""
    return len({t.session_id for t in trajectories})


def in_episode_order(trajectories) -> list[Trajectory]:
    """The records by episode index (``info["index"]``), a session's segments in order."""
    return sorted(trajectories, key=lambda t: (t.info["index"], t.segment))


@dataclass
class Episode:
    """One instance of a task: the opening chat, the tools it may use, and what is needed to score it."""

    messages: list[dict]
    tools: list[Callable]  # plain Python functions (sync or async) with type hints and a docstring
    answer: Any = None
    info: dict = field(default_factory=dict)
    # the tool format (agent_loop.episode.tool_formats.ToolFormat) the loop reads this episode's calls in,
    # set when it starts playing; rewards ask it whether a final answer still calls a tool
    tool_format: Any = None
    # what answers each assistant turn (agent_loop.episode.contracts.TurnEnvironment: a library's environment,
    # agent_loop.ecosystem); None: the tool environment of ``tools``. Made per episode; the loop closes it
    environment: Any = None
