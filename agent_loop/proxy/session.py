"""A session (one episode of someone else's agent) as the proxy records it: its token sequence, checked call by call.

Each call's messages either *extend* the session (they start with every message of the previous call plus the
assistant message the proxy answered, with the same tools): then the new messages become an OBSERVATION span
derived as our loop derives it (:meth:`ChatFormatter.observation`, ``history_mode="keep_seen"``: where the
template re-renders earlier text differently, e.g. strips reasoning, the tokens the model saw are kept and the
drift is recorded and counted), and the next prompt is the previous prompt plus its completion plus that
observation, token for token. Or they *rewrite* the history (a message dropped, summarised or edited, other
tools, a retried call): then the session starts a new **segment** on a fresh render of these messages
(prime-rl's fallback), so nothing is trained on context the model never saw; rewrites are counted.
Every segment is one :class:`~agent_loop.types.Trajectory`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

from agent_loop.episode.chat import ChatFormatter, Observation, assistant_message
from agent_loop.episode.info import episode_info
from agent_loop.episode.loop import _EpisodeState
from agent_loop.types import ToolCallRecord, Trajectory
from masking.kinds import SpanKind


def message_key(message: dict) -> str:
    """What must be equal for two messages to be the same turn (ids, text, tool calls and arguments)."""
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return json.dumps([message["role"], message.get("content") or "", calls, message.get("tool_call_id")],
                      sort_keys=True, default=str)


@dataclass
class Segment:
    """One stretch of a session whose tokens extend each other: a Trajectory in the making."""

    formatter: ChatFormatter
    tools_key: str
    prompt_ids: list[int]
    state: _EpisodeState
    keys: list[str] = field(default_factory=list)  # message_key of every message the next call must start with
    stop_id: int | None = None  # the end-of-turn token the last completion sampled (None: cut by length)
    sampled: str = ""  # the last completion's text without its stop token
    finish: str = "stop"  # the last completion's OpenAI finish_reason

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.state.response_ids)


@dataclass
class Pending:
    """What one call will add to its session if its generation completes (nothing is changed before)."""

    segment: Segment
    new_segment: bool
    prompt: list[int]
    messages: list[dict]  # the request's messages, names of tool results filled in
    observation: Observation | None = None
    new_messages: list[dict] = field(default_factory=list)


@dataclass
class Session:
    """One episode of an agent: its segments, reward and counters (one call at a time: ``lock``)."""

    id: str
    row: dict | None = None  # the episode's row when the session was opened by ``--agent``
    segments: list[Segment] = field(default_factory=list)
    reward: float | None = None
    counts: Counter = field(default_factory=Counter)  # calls, rewrites, template_drift
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)

    def with_names(self, messages: list[dict]) -> list[dict]:
        """Tool results with the name of the call they answer, as our loop writes them (templates may show it)."""
        names = {r.call_id: r.name for s in self.segments for r in s.state.records}
        return [{"role": "tool", "name": names.get(m["tool_call_id"], "tool"), "tool_call_id": m["tool_call_id"],
                 "content": m["content"]} if m["role"] == "tool" and "name" not in m else m for m in messages]

    def plan(self, messages: list[dict], tools: list[dict], formatter: ChatFormatter) -> Pending:
        """The prompt of a call with these (normalised) messages: an extension of the current segment, else a
        new segment (a rewrite when there was one)."""
        messages = self.with_names(messages)
        tools_key = json.dumps(tools, sort_keys=True)
        current = self.segments[-1] if self.segments else None
        if current is not None and current.tools_key == tools_key and len(messages) > len(current.keys) \
                and [message_key(m) for m in messages[: len(current.keys)]] == current.keys:
            new = messages[len(current.keys):]
            obs = formatter.observation(current.state.messages, current.state.seen, new, current.stop_id,
                                        current.sampled)
            return Pending(current, False, current.prompt_ids + current.state.response_ids + obs.ids, messages, obs, new)
        ids, seen = formatter.prompt(messages)
        state = _EpisodeState(messages=[dict(m) for m in messages], seen=seen)
        state.calls_made = sum(s.state.calls_made for s in self.segments)  # call ids stay unique in the session
        return Pending(Segment(formatter, tools_key, ids, state), True, ids, messages)

    def commit(self, pending: Pending, result, tokenizer, parse) -> tuple[str, list[dict], str]:
        """Add a completed call to the session; returns its content, tool calls (``{"id", "name", "arguments"}``)
        and OpenAI finish reason."""
        seg, state = pending.segment, pending.segment.state
        self.counts["calls"] += 1
        if pending.new_segment:
            self.counts["rewrites"] += bool(self.segments)
            self.segments.append(seg)
        else:
            _add_observation(seg, pending)
            self.counts["template_drift"] += pending.observation.mismatch is not None
        turn = len(state.turn_tokens)
        state.append(result.token_ids, SpanKind.ASSISTANT, turn, result.logprobs, result.policy_version)
        state.turn_tokens.append({"assistant": len(result.token_ids), "observation": 0})
        stopped = result.finish_reason == "stop" and result.token_ids[-1] in seg.formatter.end_of_turn_ids
        text = tokenizer.decode(result.token_ids[: -1 if stopped else None], skip_special_tokens=False)
        content, calls = _parsed(seg, parse, text, turn)
        state.messages.append(assistant_message(content, calls or None))
        seg.keys = [message_key(m) for m in pending.messages] + [message_key(state.messages[-1])]
        seg.stop_id, seg.sampled = (result.token_ids[-1] if stopped else None), text
        seg.finish = "length" if result.finish_reason == "length" else "tool_calls" if calls else "stop"
        return content, calls, seg.finish


def _parsed(seg: Segment, parse, text: str, turn: int) -> tuple[str, list[dict]]:
    """The completion's content and tool calls (ids as our loop makes them); a call that does not parse leaves
    the whole turn as text, as the loop keeps it."""
    state = seg.state
    parsed = parse(text) if parse is not None else None
    if parsed is None or parsed.errors or not parsed.calls:
        return (text if parsed is None or parsed.errors else parsed.content), []
    calls = []
    for i, call in enumerate(parsed.calls):
        call_id = seg.formatter.call_id(call.name, state.calls_made + i)
        calls.append({"id": call_id, "name": call.name, "arguments": call.arguments})
        state.records.append(ToolCallRecord(call.name, call.arguments, turn, call_id=call_id))
    state.calls_made += len(calls)
    return parsed.content, calls


def _add_observation(seg: Segment, pending: Pending) -> None:
    """The agent's messages since the last call, as the OBSERVATION span after the last assistant turn."""
    state, obs = seg.state, pending.observation
    turn = len(state.turn_tokens) - 1
    state.append(obs.ids, SpanKind.OBSERVATION, turn)
    state.turn_tokens[-1]["observation"] = len(obs.ids)
    state.messages += pending.new_messages
    state.seen = obs.rendered
    if obs.mismatch is not None:
        state.template_diffs.append({"turn": turn, **obs.mismatch})
    results = {m["tool_call_id"]: m["content"] for m in pending.new_messages if m["role"] == "tool"}
    for record in state.records:
        if record.result is None and record.call_id in results:
            record.result = results[record.call_id]


def trajectories(session: Session, *, reward: float, closed_by: str, tokenizer, task: str = "proxy",
                 index: int = 0, seed: int = 0, info: dict | None = None) -> list[Trajectory]:
    """The session's segments as Trajectories, each with the session's reward (the last segment is the episode's
    end; earlier ones end where the agent rewrote its history)."""
    out = []
    for n, seg in enumerate(session.segments):
        state = seg.state
        if seg.finish == "stop":  # the final render must start with what the model saw (as the loop checks)
            final = seg.formatter.final_mismatch(state.messages, state.seen)
            if final is not None:
                state.template_diffs.append({"turn": len(state.turn_tokens) - 1, **final})
        last = n == len(session.segments) - 1
        metrics = {
            "turns": len(state.turn_tokens), "turn_tokens": state.turn_tokens,
            "assistant_tokens": sum(t["assistant"] for t in state.turn_tokens),
            "observation_tokens": sum(t["observation"] for t in state.turn_tokens),
            "tool_calls": len(state.records), "template_exact": not state.template_diffs, "template_mismatch": 0,
            "template_drift": len(state.template_diffs),
            "template_first_diff": state.template_diffs[0] if state.template_diffs else None,
            "proxy": {"segments": len(session.segments), "segment": n, "rewrites": session.counts["rewrites"],
                      "calls": session.counts["calls"], "closed_by": closed_by},
        }
        record_info = episode_info(task, index, seed, success=reward > 0, tokenizer=tokenizer,
                                   identity={"session_id": session.id, "segment": n}, extra=info)
        finish = ("history_rewrite" if not last else seg.finish if seg.finish != "tool_calls" else "agent_ended")
        out.append(Trajectory(
            prompt_ids=seg.prompt_ids, response_ids=state.response_ids, spans=state.spans, turn_ids=state.turn_ids,
            logprobs=state.logprobs, messages=state.messages, tool_calls=state.records, reward=float(reward),
            finish_reason=finish, truncated=seg.finish == "length", metrics=metrics, info=record_info,
            policy_versions=state.policy_versions if any(v >= 0 for v in state.policy_versions) else None))
    return out
