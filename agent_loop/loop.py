"""The agent loop: generate an assistant turn, run its tool calls, append the observation tokens, repeat.

Token-in, token-out (docs/design.md sections 4-5): the prompt is rendered once; assistant tokens are kept
exactly as sampled; observation tokens are the chat template's delta, with the template tokens that
follow the model's end-of-turn token counted as OBSERVATION.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import weakref
from collections import Counter
from dataclasses import dataclass

from agent_loop.chat import ChatFormatter
from agent_loop.parsers import parser_for_template
from agent_loop.tools import ToolExecutor, tool_messages
from agent_loop.types import Backend, GenerationResult, SamplingParams, Task, ToolCallRecord, Trajectory
from masking.spans import SpanKind

TRUNCATION_MARK = " ...[truncated]"


@dataclass
class LoopConfig:
    """Budgets of one episode (docs/design.md section 5)."""

    max_turns: int = 4  # assistant turns
    max_response_tokens: int = 1024  # assistant + observation tokens: they share the context
    max_tokens: int = 256  # per assistant turn
    max_observation_tokens: int = 256  # per observation; longer tool results are truncated and marked
    max_parallel_tool_calls: int = 4
    tool_timeout_s: float = 10.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    backend_retries: int = 2  # extra attempts when the backend raises
    retry_backoff_s: float = 0.5


def request_seed(seed: int, index: int, turn: int) -> int:
    """A stable per-request sampling seed, so an episode replays the same whatever runs beside it."""
    digest = hashlib.blake2b(f"{seed}:{index}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# One formatter per (tokenizer, tool schemas): it caches its template probes across episodes.
_FORMATTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _formatter(tokenizer, schemas: list[dict]) -> ChatFormatter:
    by_schemas = _FORMATTERS.setdefault(tokenizer, {})
    key = json.dumps(schemas, sort_keys=True)
    if key not in by_schemas:
        by_schemas[key] = ChatFormatter(tokenizer, tools=schemas)
    return by_schemas[key]


async def _generate_with_retries(backend: Backend, prompt: list[int], sampling: SamplingParams, session_id: str,
                                 config: LoopConfig) -> tuple[GenerationResult | None, str | None]:
    error = None
    for attempt in range(config.backend_retries + 1):
        try:
            return await backend.generate(prompt, sampling, session_id=session_id), None
        except Exception as exc:  # any backend failure: retry, then end the episode with "error"
            error = f"{type(exc).__name__}: {exc}"
            if attempt < config.backend_retries:
                await asyncio.sleep(config.retry_backoff_s * 2**attempt)
    return None, error


def _fit_observation(formatter: ChatFormatter, messages: list[dict], limit: int) -> tuple[list[int], list[dict], bool]:
    """Observation ids for ``messages``, with the longest tool result cut (and marked) until they fit ``limit``."""
    ids = formatter.observation_ids(messages)
    truncated = False
    for _ in range(8):  # each pass removes at least the excess; template tokens can shift by a few
        if len(ids) <= limit:
            break
        longest = max(range(len(messages)), key=lambda i: len(messages[i]["content"]))
        content_ids = formatter.tokenizer.encode(messages[longest]["content"], add_special_tokens=False)
        keep = max(0, len(content_ids) - (len(ids) - limit) - len(TRUNCATION_MARK))
        shortened = formatter.tokenizer.decode(content_ids[:keep]) + TRUNCATION_MARK
        if not content_ids or shortened == messages[longest]["content"]:
            break  # nothing left to cut but the template's own tokens
        messages = [dict(m) for m in messages]
        messages[longest]["content"] = shortened
        ids, truncated = formatter.observation_ids(messages), True
    return ids, messages, truncated


async def run_episode(
    task: Task,
    index: int,
    backend: Backend,
    tokenizer,
    config: LoopConfig | None = None,
    seed: int = 0,
) -> Trajectory:
    """Play episode ``index`` of ``task`` against ``backend`` and return its Trajectory."""
    config = config or LoopConfig()
    started = time.perf_counter()
    episode = task.make_episode(index, seed)
    toolbox = ToolExecutor(episode.tools)
    formatter = _formatter(tokenizer, toolbox.schemas)
    parser = parser_for_template(formatter.chat_template or tokenizer.chat_template)
    messages = [dict(m) for m in episode.messages]
    prompt_ids = formatter.prompt_ids(messages)
    session_id = f"{task.name}:{seed}:{index}"  # one per episode: multi-server backends keep it on one server

    response_ids: list[int] = []
    spans: list[int] = []
    turn_ids: list[int] = []
    logprobs: list[float] = []
    records: list[ToolCallRecord] = []
    turn_tokens: list[dict] = []
    timings = Counter()
    finish_reason, truncated, error = "max_turns", False, None
    observation_truncations = 0

    for turn in range(config.max_turns):
        budget = config.max_response_tokens - len(response_ids)
        sampling = SamplingParams(
            max_tokens=min(config.max_tokens, budget), temperature=config.temperature, top_p=config.top_p,
            top_k=config.top_k, stop_token_ids=formatter.end_of_turn_ids, seed=request_seed(seed, index, turn),
        )
        t0 = time.perf_counter()
        result, error = await _generate_with_retries(backend, prompt_ids + response_ids, sampling, session_id, config)
        timings["generate_s"] += time.perf_counter() - t0
        if result is None:
            finish_reason = "error"
            break
        response_ids += result.token_ids
        spans += [SpanKind.ASSISTANT] * len(result.token_ids)
        turn_ids += [turn] * len(result.token_ids)
        logprobs += result.logprobs
        turn_tokens.append({"assistant": len(result.token_ids), "observation": 0})

        stopped = result.finish_reason == "stop" and result.token_ids[-1] in sampling.stop_token_ids
        text = tokenizer.decode(result.token_ids[: -1 if stopped else None], skip_special_tokens=False)
        parsed = parser(text)
        if parsed.errors:  # calls that did not parse have no structured form: keep the turn as sampled text
            messages.append(formatter.assistant_message(text))
        else:
            messages.append(formatter.assistant_message(
                parsed.content, [{"name": c.name, "arguments": c.arguments} for c in parsed.calls] or None))
        if result.finish_reason == "length":
            finish_reason, truncated = "length", True
            break
        if not parsed.calls and not parsed.errors:
            finish_reason = "stop"
            break
        if turn == config.max_turns - 1:
            break  # no turn left to read the results: finish "max_turns"

        t0 = time.perf_counter()
        outcomes = await toolbox.execute(parsed.calls + parsed.errors, turn=turn, timeout_s=config.tool_timeout_s,
                                         max_parallel=config.max_parallel_tool_calls)
        timings["tools_s"] += time.perf_counter() - t0
        records += outcomes
        new_messages = tool_messages(outcomes)
        observation, new_messages, cut = _fit_observation(formatter, new_messages, config.max_observation_tokens)
        observation_truncations += cut
        messages += new_messages
        if len(response_ids) + len(observation) >= config.max_response_tokens:
            finish_reason = "observation_overflow"  # no room left for the observation and a next turn
            break
        response_ids += observation
        spans += [SpanKind.OBSERVATION] * len(observation)
        turn_ids += [turn] * len(observation)
        logprobs += [0.0] * len(observation)
        turn_tokens[-1]["observation"] = len(observation)

    reward = float(task.reward(episode, messages, records))
    turn_rewards_fn = getattr(task, "turn_rewards", None)
    turn_rewards = turn_rewards_fn(episode, messages, records) if turn_rewards_fn else None
    tool_errors = Counter(r.error_kind for r in records if r.error_kind)
    metrics = {
        "turns": len(turn_tokens),
        "turn_tokens": turn_tokens,
        "assistant_tokens": sum(t["assistant"] for t in turn_tokens),
        "observation_tokens": sum(t["observation"] for t in turn_tokens),
        "tool_calls": len(records),
        "tool_errors": dict(tool_errors),
        "observation_truncations": observation_truncations,
        "generate_s": timings["generate_s"],
        "tools_s": timings["tools_s"],
        "total_s": time.perf_counter() - started,
    }
    if error:
        metrics["backend_error"] = error
    info = {"task": task.name, "index": index, "seed": seed, "answer": episode.answer,
            "success": reward > 0, **episode.info}
    name_or_path = getattr(tokenizer, "name_or_path", None)
    if name_or_path:
        info["model_path"] = str(name_or_path)
    return Trajectory(
        prompt_ids=prompt_ids, response_ids=response_ids, spans=[int(s) for s in spans], turn_ids=turn_ids,
        logprobs=logprobs, messages=messages, tool_calls=records, reward=reward, turn_rewards=turn_rewards,
        finish_reason=finish_reason, truncated=truncated, metrics=metrics, info=info,
    )
