"""The records every part of the rollout side shares (docs/design.md sections 2 and 5): an episode to
play, the tool calls made in it, and the Trajectory it becomes (what the JSONL files hold).

Kept in one small file so that tools, tasks, the loop, the runners and the inspector agree on one
shape of data.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from masking.kinds import SpanKind

# finish_reason values of a Trajectory (docs/design.md section 5)
FINISH_REASONS = ("stop", "max_turns", "length", "observation_overflow", "error")

# error kinds of a tool call, each counted in Trajectory.metrics["tool_errors"]
TOOL_ERROR_KINDS = ("malformed_json", "unknown_tool", "invalid_arguments", "exception", "timeout")


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

    def check(self) -> None:
        """Raise ValueError if the per-token lists disagree in length, hold a span kind other than
        ASSISTANT/OBSERVATION, or a reward has no ASSISTANT token to sit on (it would be lost)."""
        n = len(self.response_ids)
        for name in ("spans", "turn_ids", "logprobs"):
            if len(getattr(self, name)) != n:
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

    @property
    def success(self) -> bool:
        """Whether the task judged the episode a success (recorded by the loop; reward > 0 for old records)."""
        recorded = self.info.get("success")
        return bool(recorded) if recorded is not None else self.reward > 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

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
