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
from dataclasses import dataclass, field

from agent_loop.backends.base import Backend, GenerationResult, SamplingParams, check_backend, is_fatal
from agent_loop.episode.chat import ChatFormatter, Observation, TemplateError
from agent_loop.episode.config import LoopConfig
from agent_loop.episode.tool_formats import tool_format_for_template
from agent_loop.episode.tools import TRUNCATION_MARK, ToolExecutor, tool_messages
from agent_loop.tasks.base import Task, as_task
from agent_loop.types import Episode, ToolCallRecord, Trajectory
from masking.kinds import SpanKind

# A tool result is cut to this many characters per observation token before it is tokenized, so
# truncation costs O(max_observation_tokens), not O(the result's size).
CHARS_PER_TOKEN_BUDGET = 16


def request_seed(seed: int, index: int, turn: int) -> int:
    """A stable per-request sampling seed, so an episode replays the same whatever runs beside it."""
    digest = hashlib.blake2b(f"{seed}:{index}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# One formatter per (tokenizer, tool schemas): it caches its template probes across episodes.
_FORMATTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def formatter_for(tokenizer, schemas: list[dict], history_mode: str = "strict") -> ChatFormatter:
    """The shared formatter of ``tokenizer`` with these tool schemas (its template probes are cached)."""
    by_schemas = _FORMATTERS.setdefault(tokenizer, {})
    key = (json.dumps(schemas, sort_keys=True), history_mode)
    if key not in by_schemas:
        by_schemas[key] = ChatFormatter(tokenizer, tools=schemas, history_mode=history_mode)
    return by_schemas[key]


async def _generate_with_retries(backend: Backend, prompt: list[int], sampling: SamplingParams, session_id: str,
                                 config: LoopConfig) -> tuple[GenerationResult | None, str | None]:
    error = None
    retries = 0 if backend.retries_itself else config.backend_retries  # one layer of retries
    for attempt in range(retries + 1):
        try:
            return await backend.generate(prompt, sampling, session_id=session_id), None
        except Exception as exc:  # any backend failure: retry, then end the episode with "error"
            if is_fatal(exc):
                raise  # e.g. every server down past the deadline: the run stops (agent_loop.runners.local)
            error = f"{type(exc).__name__}: {exc}"
            if attempt < retries:
                await asyncio.sleep(config.retry_backoff_s * 2**attempt)
    return None, error


def _fit_observation(formatter: ChatFormatter, state: "_EpisodeState", messages: list[dict], stop_id: int | None,
                     sampled: str, limit: int) -> tuple[Observation, list[dict], bool]:
    """The observation of ``messages`` after the episode so far, with the longest tool result cut (and marked)
    until it fits ``limit`` tokens."""
    def observe(new):
        return formatter.observation(state.messages, state.seen, new, stop_id, sampled)

    obs = observe(messages)
    truncated = False
    for _ in range(8):  # each pass removes at least the excess; template tokens can shift by a few
        if len(obs.ids) <= limit:
            break
        longest = max(range(len(messages)), key=lambda i: len(messages[i]["content"]))
        content_ids = formatter.tokenizer.encode(messages[longest]["content"], add_special_tokens=False)
        keep = max(0, len(content_ids) - (len(obs.ids) - limit) - len(TRUNCATION_MARK))
        shortened = formatter.tokenizer.decode(content_ids[:keep]) + TRUNCATION_MARK
        if not content_ids or shortened == messages[longest]["content"]:
            break  # nothing left to cut but the template's own tokens
        messages = [dict(m) for m in messages]
        messages[longest]["content"] = shortened
        obs, truncated = observe(messages), True
    return obs, messages, truncated


@dataclass
class _EpisodeState:
    """What an episode has built so far: the response tokens with their spans, turns and logprobs."""

    messages: list[dict]
    response_ids: list[int] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    records: list[ToolCallRecord] = field(default_factory=list)
    turn_tokens: list[dict] = field(default_factory=list)  # per turn: assistant and observation token counts
    timings: Counter = field(default_factory=Counter)
    observation_truncations: int = 0
    error: str | None = None
    seen: str = ""  # the one-go render of the messages so far, up to the current generation prompt
    calls_made: int = 0  # tool calls so far: their ids are unique in the episode
    template_diffs: list[dict] = field(default_factory=list)  # turns whose fresh render differs from what was seen

    def append(self, ids: list[int], kind: SpanKind, turn: int, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.spans += [int(kind)] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@dataclass
class _Context:
    """The fixed parts of one episode: who generates, how chat is formatted and parsed, which tools run."""

    backend: Backend
    tokenizer: object
    formatter: ChatFormatter
    parser: object
    toolbox: ToolExecutor
    config: LoopConfig
    prompt_ids: list[int]
    session_id: str
    seed: int
    index: int


def _template_diff(config: LoopConfig, state: _EpisodeState, turn: int, mismatch: dict | None) -> None:
    """Record where a fresh one-go render differs from what the model saw (an error if the config says so)."""
    if mismatch is None:
        return
    if config.on_template_mismatch == "error" and config.history_mode == "strict":
        raise TemplateError(f"turn {turn}: the chat template's one-go render of this episode differs from the "
                            f"tokens the model saw: {mismatch}")
    state.template_diffs.append({"turn": turn, **mismatch})


async def _play_turn(ctx: _Context, state: _EpisodeState, turn: int) -> str | None:
    """One assistant turn and the observation of its tool calls; the finish reason if the episode ends here."""
    config, formatter = ctx.config, ctx.formatter
    sampling = SamplingParams(
        max_tokens=min(config.max_tokens, config.max_response_tokens - len(state.response_ids)),
        temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
        stop_token_ids=formatter.end_of_turn_ids, seed=request_seed(ctx.seed, ctx.index, turn),
    )
    t0 = time.perf_counter()
    result, state.error = await _generate_with_retries(
        ctx.backend, ctx.prompt_ids + state.response_ids, sampling, ctx.session_id, config)
    state.timings["generate_s"] += time.perf_counter() - t0
    if result is None:
        return "error"
    state.append(result.token_ids, SpanKind.ASSISTANT, turn, result.logprobs)
    state.turn_tokens.append({"assistant": len(result.token_ids), "observation": 0})

    stopped = result.finish_reason == "stop" and result.token_ids[-1] in sampling.stop_token_ids
    text = ctx.tokenizer.decode(result.token_ids[: -1 if stopped else None], skip_special_tokens=False)
    parsed = ctx.parser(text)
    ids = [formatter.call_id(c.name, state.calls_made + i) for i, c in enumerate(parsed.calls)]
    ids += [formatter.call_id("", state.calls_made + len(ids) + i) for i in range(len(parsed.errors))]
    state.calls_made += len(ids)
    if parsed.errors:  # calls that did not parse have no structured form: keep the turn as sampled text
        state.messages.append(formatter.assistant_message(text))
    else:
        state.messages.append(formatter.assistant_message(
            parsed.content, [{"name": c.name, "arguments": c.arguments, "id": i} for c, i in zip(parsed.calls, ids)] or None))
    if result.finish_reason == "length":
        return "length"
    if not parsed.calls and not parsed.errors:
        return "stop"
    if turn == config.max_turns - 1:
        return "max_turns"  # no turn left to read the results

    t0 = time.perf_counter()
    outcomes = await ctx.toolbox.execute(parsed.calls + parsed.errors, turn=turn, timeout_s=config.tool_timeout_s,
                                         max_parallel=config.max_parallel_tool_calls,
                                         max_result_chars=config.max_observation_tokens * CHARS_PER_TOKEN_BUDGET)
    state.timings["tools_s"] += time.perf_counter() - t0
    for record, call_id in zip(outcomes, ids):
        record.call_id = call_id
    state.records += outcomes
    obs, new_messages, cut = _fit_observation(formatter, state, tool_messages(outcomes),
                                              result.token_ids[-1] if stopped else None, text, config.max_observation_tokens)
    state.observation_truncations += cut
    state.messages += new_messages
    _template_diff(config, state, turn, obs.mismatch)
    state.seen = obs.rendered
    if len(state.response_ids) + len(obs.ids) >= config.max_response_tokens:
        return "observation_overflow"  # no room left for the observation and a next turn
    state.append(obs.ids, SpanKind.OBSERVATION, turn)
    state.turn_tokens[-1]["observation"] = len(obs.ids)
    return None


async def run_episode(
    task: Task,
    index: int,
    backend: Backend,
    tokenizer,
    config: LoopConfig | None = None,
    seed: int = 0,
) -> Trajectory:
    """Play episode ``index`` of ``task`` against ``backend`` and return its Trajectory."""
    config, task, backend = config or LoopConfig(), as_task(task), check_backend(backend)
    started = time.perf_counter()
    episode = task.make_episode(index, seed)
    toolbox = ToolExecutor(episode.tools)
    formatter = formatter_for(tokenizer, toolbox.schemas, config.history_mode)
    episode.tool_format = formatter.tool_format or tool_format_for_template(formatter.template_text)
    state = _EpisodeState(messages=[dict(m) for m in episode.messages])
    prompt_ids, state.seen = formatter.prompt(state.messages)
    ctx = _Context(
        backend=backend, tokenizer=tokenizer, formatter=formatter,
        parser=episode.tool_format.parser_for(toolbox.schemas), toolbox=toolbox,
        config=config, prompt_ids=prompt_ids,
        session_id=f"{task.name}:{seed}:{index}",  # one per episode: multi-server backends keep it on one server
        seed=seed, index=index,
    )
    finish_reason = "max_turns"
    for turn in range(config.max_turns):
        if (ended := await _play_turn(ctx, state, turn)) is not None:
            finish_reason = ended
            break
    return _finish(task, episode, ctx, state, finish_reason, time.perf_counter() - started)


def _finish(task: Task, episode: Episode, ctx: _Context, state: _EpisodeState, finish_reason: str,
            elapsed_s: float) -> Trajectory:
    """Score the episode and assemble its Trajectory record."""
    if finish_reason == "stop":  # the last turn's generation prompt, as a one-go render of the finished chat writes it
        _template_diff(ctx.config, state, len(state.turn_tokens) - 1, ctx.formatter.final_mismatch(state.messages, state.seen))
    reward = float(task.reward(episode, state.messages, state.records))
    turn_rewards = task.turn_rewards(episode, state.messages, state.records)
    task_metrics = task.episode_metrics(episode, state.messages, state.records)
    metrics = {
        "turns": len(state.turn_tokens),
        "turn_tokens": state.turn_tokens,
        "assistant_tokens": sum(t["assistant"] for t in state.turn_tokens),
        "observation_tokens": sum(t["observation"] for t in state.turn_tokens),
        "tool_calls": len(state.records),
        "tool_errors": dict(Counter(r.error_kind for r in state.records if r.error_kind)),
        "observation_truncations": state.observation_truncations,
        "generate_s": state.timings["generate_s"],
        "tools_s": state.timings["tools_s"],
        "total_s": elapsed_s,
        # template exactness (docs/templates.md): did every observation extend a fresh one-go render of the
        # episode's messages? Counted as mismatches (strict) or drift (history_mode="keep_seen").
        "template_exact": not state.template_diffs,
        "template_mismatch": 0 if ctx.config.history_mode == "keep_seen" else len(state.template_diffs),
        "template_drift": len(state.template_diffs) if ctx.config.history_mode == "keep_seen" else 0,
        "template_first_diff": state.template_diffs[0] if state.template_diffs else None,
    }
    if task_metrics:  # the task's own numbers about the episode, averaged by the trainer
        metrics["task"] = task_metrics
    if state.error:
        metrics["backend_error"] = state.error
    info = {"task": task.name, "index": ctx.index, "seed": ctx.seed, "answer": episode.answer,
            "success": bool(task.success(episode, reward)), **episode.info}
    name_or_path = getattr(ctx.tokenizer, "name_or_path", None)
    if name_or_path:
        info["model_path"] = str(name_or_path)
    return Trajectory(
        prompt_ids=ctx.prompt_ids, response_ids=state.response_ids, spans=state.spans, turn_ids=state.turn_ids,
        logprobs=state.logprobs, messages=state.messages, tool_calls=state.records, reward=reward,
        turn_rewards=turn_rewards, finish_reason=finish_reason, truncated=finish_reason == "length",
        metrics=metrics, info=info,
    )
