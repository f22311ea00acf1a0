"""The loop's options: budgets, sampling and template handling of one episode (docs/design.md section 5).

Declared once here; every field is a flag and a config-file key of both ``agent-loop rollout`` and
``agent-loop train`` (``agent_loop.config`` says how declarations become options).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from agent_loop.config import STRICT_NUMBERS
from agent_loop.config import integer as _count  # a whole-number option: (help, lowest value)

HISTORY_MODES = ("strict", "keep_seen")
MISMATCH_POLICIES = ("record", "error")


@dataclass
class LoopConfig:
    """What one episode may spend and how it samples (docs/design.md section 5)."""

    __pydantic_config__ = STRICT_NUMBERS

    max_turns: _count("assistant turns per episode") = 4
    max_response_tokens: _count("assistant + observation tokens per episode (they share the context)") = 1024
    max_tokens: _count("tokens per assistant turn") = 256
    max_observation_tokens: _count("tokens per tool observation; longer results are truncated and marked") = 256
    max_parallel_tool_calls: _count("tool calls run at once within a turn") = 4
    tool_timeout_s: Annotated[float, Field(gt=0, description="seconds a tool call may run before it ends in a "
                                           "timeout error observation")] = 10.0
    reward_timeout_s: Annotated[float, Field(gt=0, description="seconds the task's reward, turn rewards, metrics "
                                             "and success of one episode may take (on a thread of their own); "
                                             "longer: the episode ends with an error, reward 0")] = 60.0
    temperature: Annotated[float, Field(ge=0, description="sampling temperature; 0 = greedy")] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, description="nucleus sampling mass; 1 = off")] = 1.0
    top_k: _count("sample among the k likeliest tokens; 0 = off", low=0) = 0
    backend_retries: _count("extra attempts when a generation request raises (a backend that retries by "
                            "itself, http, gets none)", low=0) = 2
    retry_backoff_s: Annotated[float, Field(ge=0, description="seconds before the first of those retries; "
                                            "doubled for each next one")] = 0.5
    history_mode: Annotated[Literal[HISTORY_MODES], Field(
        description="chat templates that rewrite earlier turns: strict refuses them; keep_seen runs them on the "
                    "tokens the model saw and records the drift (docs/templates.md)")] = "strict"
    on_template_mismatch: Annotated[Literal[MISMATCH_POLICIES], Field(
        description="a turn whose tokens differ from a fresh one-go render of the episode's messages: record it in "
                    "the trajectory's metrics, or end the episode with an error")] = "record"

    def __post_init__(self):  # the choices hold for configs built in code too
        if self.history_mode not in HISTORY_MODES:
            raise ValueError(f"history_mode must be 'strict' or 'keep_seen', got {self.history_mode!r}")
        if self.on_template_mismatch not in MISMATCH_POLICIES:
            raise ValueError(f"on_template_mismatch must be 'record' or 'error', got {self.on_template_mismatch!r}")
