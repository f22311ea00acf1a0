"""Context policies: what the loop keeps of an episode's history when it rewrites it (docs/design.md section 5,
"Context policies"; ``LoopConfig.context``).

Each function here takes the episode's current context (its messages: the head -- system prompt and task --
then turns, an assistant message and the observation messages after it) and returns the messages of the next
context. The loop renders them afresh as the prompt of a new *segment* of the episode's session; nothing here
touches tokens.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from agent_loop.episode.plugin_import import PluginError, import_object

SUMMARY_HEADER = "Summary of your earlier turns:"
SUMMARY_MARK = f"\n\n{SUMMARY_HEADER}\n"  # where a summary joins the task
NO_RESULTS = "(no tool results)"  # the digest of a history without tool results
SUMMARY_CHARS = 4096  # the default digest keeps its most recent lines within this many characters


def head_length(messages: list[dict]) -> int:
    """How many messages open the chat before its first turn: up to and including the first user message (the
    task), with any system message before it."""
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is None:
        raise ValueError("the episode's messages have no user message (the task): a context policy keeps the "
                         "system prompt and the task, and needs one")
    return first_user + 1


def turn_starts(messages: list[dict]) -> list[int]:
    """The index of each turn's assistant message after the head (a turn: the assistant message and the
    observation messages after it, up to the next assistant message)."""
    head = head_length(messages)
    return [i for i in range(head, len(messages)) if messages[i].get("role") == "assistant"]


def windowed(messages: list[dict], turns: int) -> list[dict] | None:
    """The head and the last ``turns`` turns of ``messages``; None when they hold no more turns than that (nothing
    to cut)."""
    starts = turn_starts(messages)
    if len(starts) <= turns:
        return None
    return messages[: head_length(messages)] + messages[starts[-turns]:]


def digest(messages: list[dict], max_chars: int = SUMMARY_CHARS) -> str:
    """The default summary: one line per tool call and result of ``messages``, in order (``name(arguments) ->
    result``), after the lines of an earlier summary among them (:func:`earlier_summary`), the most recent kept
    within ``max_chars`` (a first line says how many earlier ones were left out, counting those an earlier digest
    left out). Deterministic: the same messages give the same text."""
    calls = {c.get("id"): c["function"] for m in messages for c in m.get("tool_calls") or []}
    lines, left_out = [], 0
    for m in messages:
        if (earlier := earlier_summary(m)) is not None:
            for line in earlier.splitlines():
                counted = re.fullmatch(r"\((\d+) earlier results left out\)", line)
                if counted:
                    left_out += int(counted.group(1))
                elif line != NO_RESULTS:
                    lines.append(line)
        if m.get("role") != "tool":
            continue
        call = calls.get(m.get("tool_call_id"), {"name": m.get("name", "tool"), "arguments": {}})
        arguments = call["arguments"] if isinstance(call["arguments"], str) else json.dumps(call["arguments"],
                                                                                             sort_keys=True)
        lines.append(f"- {call['name']}({arguments}) -> {m.get('content')}")
    kept, size = [], 0
    for line in reversed(lines):
        if size + len(line) + 1 > max_chars:
            break
        kept.append(line)
        size += len(line) + 1
    left_out += len(lines) - len(kept)
    return "\n".join(([f"({left_out} earlier results left out)"] if left_out else []) + kept[::-1]) or NO_RESULTS


def earlier_summary(message: dict) -> str | None:
    """The summary a task message carries from an earlier rewrite (the text after :data:`SUMMARY_HEADER`), else
    None."""
    content = message.get("content")
    opening = f"{SUMMARY_HEADER}\n"
    if message.get("role") != "user" or not isinstance(content, str) or opening not in content:
        return None
    return content.split(opening, 1)[1]


def summarized(messages: list[dict], summarize: Callable[[list[dict]], str]) -> list[dict]:
    """The head of ``messages`` with the summary of what it replaces (:func:`with_summary`): ``summarize`` gets the
    messages being replaced, the turns after the head, opened by the earlier summary where the task carries one
    (a user message: :data:`SUMMARY_HEADER` and its text), so a summary of summaries loses nothing it kept."""
    head = head_length(messages)
    earlier = earlier_summary(messages[head - 1])
    opened = [] if earlier is None else [{"role": "user", "content": f"{SUMMARY_HEADER}\n{earlier}"}]
    summary = summarize(opened + [dict(m) for m in messages[head:]])
    if not isinstance(summary, str):
        raise TypeError(f"the summarizer returned {type(summary).__name__}, not the summary text (str)")
    return with_summary(messages[:head], summary)


def with_summary(head: list[dict], summary: str, kept: list[dict] = ()) -> list[dict]:
    """``head`` (the system prompt and the task) with ``summary`` appended to the task (its last message, the first
    user message) under :data:`SUMMARY_HEADER`, then the ``kept`` messages as they were: the system prompt and one
    user message open the chat, which every template renders (a second user message in a row is not). An earlier
    summary in the task is replaced, never stacked: the context stays bounded however many times it is rewritten."""
    out = [dict(m) for m in head]
    task = (out[-1].get("content") or "").split(SUMMARY_MARK, 1)[0]
    out[-1]["content"] = f"{task}{SUMMARY_MARK}{summary}"
    return out + [dict(m) for m in kept]


def latest_turn(messages: list[dict]) -> list[dict]:
    """The last turn of ``messages``: its last assistant message after the head and every message after it."""
    starts = turn_starts(messages)
    return [dict(m) for m in messages[starts[-1]:]] if starts else []


def load_summarizer(spec: str | None) -> Callable[[list[dict]], str]:
    """``--summarizer module:function`` (None: :func:`digest`; its form is checked by ``LoopConfig``), checked to be
    callable; PluginError saying why not."""
    if spec is None:
        return digest
    _, function = import_object(spec, "--summarizer")
    if not callable(function):
        raise PluginError(f"--summarizer {spec!r} is not a function ({type(function).__name__})")
    return function
