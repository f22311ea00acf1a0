"""The loop's options: budgets, sampling and template handling of one episode (docs/design.md section 5).

Declared once here; every field is a flag and a config-file key of both ``agent-loop rollout`` and
``agent-loop train`` (``agent_loop.options`` says how declarations become options).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from agent_loop.options import STRICT_NUMBERS, OptionError
from agent_loop.options import integer as _count  # a whole-number option: (help, lowest value)

HISTORY_MODES = ("strict", "keep_seen")
MISMATCH_POLICIES = ("record", "error")
# how the loop manages a history that outgrows its context (docs/design.md section 5, "Context policies")
CONTEXT_POLICIES = ("keep", "drop_reasoning", "window", "summarize")
POLICY_SUMMARIZER = "policy"  # --summarizer policy: the policy writes the summary itself (beside module:function)
SUMMARY_PROMPT = ("Summarize the conversation so far for yourself: what you did, what the tools returned that you "
                  "still need, and what is left to do. Reply with the summary only.")


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
    context: Annotated[Literal[CONTEXT_POLICIES], Field(
        description="when the history changes: keep (one context per episode; past the budget the episode ends in "
                    "observation_overflow), drop_reasoning (render the history as the template does at inference, "
                    "earlier reasoning dropped), window (keep the system prompt, the task and the last "
                    "--context-window turns), summarize (at --context-budget a summary replaces the turns so far); "
                    "each rewrite starts a new segment of the episode's session (docs/design.md section 5)")] = "keep"
    max_context_tokens: _count("tokens of one context, prompt and response (a turn asks for no more than is left, "
                               "an observation that does not fit ends the episode in observation_overflow or, under "
                               "a --context policy, starts a new segment); 0 = the model's own context", low=0) = 0
    context_window: _count("turns (an assistant turn and its observation) --context window keeps") = 2
    context_budget: _count("tokens of prompt and response at which --context summarize rewrites the history; 0 = "
                           "only where the next observation would not fit (observation_overflow)", low=0) = 0
    summarizer: Annotated[str | None, Field(
        description="module:function that turns the messages being replaced into the summary text for --context "
                    "summarize (messages -> str), or policy: the policy writes it, asked with --summary-prompt; "
                    "default: a digest of the tool results so far")] = None
    summary_prompt: Annotated[str, Field(
        description="the user message that asks the policy for its summary (--summarizer policy). The request is "
                    "OBSERVATION and the summary ASSISTANT tokens of the segment they close, trained: the session's "
                    "return reaches them, so the policy learns to write summaries that let the session succeed; "
                    "the task never sees them (docs/design.md section 5)")] = SUMMARY_PROMPT
    summary_tokens: _count("tokens of the policy's summary (--summarizer policy); every turn leaves room for it and "
                           "its request, and the history is rewritten before that room is gone; 0 = --max-tokens",
                           low=0) = 0

    def __post_init__(self):  # the choices hold for configs built in code too
        if self.history_mode not in HISTORY_MODES:
            raise ValueError(f"history_mode must be 'strict' or 'keep_seen', got {self.history_mode!r}")
        if self.on_template_mismatch not in MISMATCH_POLICIES:
            raise ValueError(f"on_template_mismatch must be 'record' or 'error', got {self.on_template_mismatch!r}")
        if self.context not in CONTEXT_POLICIES:
            raise ValueError(f"context must be one of {', '.join(CONTEXT_POLICIES)}, got {self.context!r}")
        if self.context == "drop_reasoning" and self.history_mode != "strict":
            raise OptionError("context", "starts a new segment where the template rewrites earlier turns; {history_mode} "
                              "keep_seen (run on with the drift recorded) is the other answer: pick one", self.context)
        for name in ("summarizer", "context_budget"):
            if getattr(self, name) and self.context != "summarize":
                raise OptionError(name, f"is for {{context}} summarize, not {self.context}", getattr(self, name))
        if self.summarizer is not None and self.summarizer != POLICY_SUMMARIZER and ":" not in self.summarizer:
            raise OptionError("summarizer", "expected module:function (a function of the messages being replaced "
                              f"that returns the summary text) or {POLICY_SUMMARIZER}", self.summarizer)
        self._check_policy_summary()

    def summary_size(self) -> int:
        """The most tokens the policy's summary may take (``summary_tokens``, else ``max_tokens``)."""
        return self.summary_tokens or self.max_tokens

    def _check_policy_summary(self) -> None:
        """``summary_prompt`` and ``summary_tokens`` go with ``--summarizer policy``, whose summary must leave room
        for a turn in one segment's budget."""
        policy = self.summarizer == POLICY_SUMMARIZER
        if self.summary_tokens and not policy:
            raise OptionError("summary_tokens", f"is for {{summarizer}} {POLICY_SUMMARIZER}", self.summary_tokens)
        if self.summary_prompt != SUMMARY_PROMPT and not policy:
            raise OptionError("summary_prompt", f"is for {{summarizer}} {POLICY_SUMMARIZER} (the request for the "
                              "policy's summary)")
        if not policy:
            return
        if not self.summary_prompt.strip():
            raise OptionError("summary_prompt", "is empty: it is the request that asks the policy for its summary")
        for name in ("max_response_tokens", "max_context_tokens"):
            limit = getattr(self, name)
            if limit and self.summary_size() >= limit:
                raise OptionError("summary_tokens", f"the policy's summary of up to {self.summary_size()} tokens "
                                  f"(0: {{max_tokens}}) leaves no room for a turn in {{{name}}} {limit}",
                                  self.summary_tokens)
