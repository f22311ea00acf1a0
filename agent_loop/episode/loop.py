"""The agent loop: generate an assistant turn, let the episode's environment answer it, append the observation
tokens, repeat.

The environment (:class:`~agent_loop.episode.contracts.TurnEnvironment`: ``Episode.environment``, else the
tool environment of ``Episode.tools``) receives every assistant turn and returns observation messages, a
per-turn reward, done/truncated and metadata; running tool calls is one such environment, not a path of
its own. Token-in, token-out (docs/design.md sections 4-5): the prompt is rendered once; assistant tokens
are kept exactly as sampled; observation tokens are the chat template's delta, with the template tokens that
follow the model's end-of-turn token counted as OBSERVATION, whichever environment wrote the messages.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import inspect
import json
import os
import queue
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent_loop.backends.base import (
    Backend,
    BadOutputError,
    GenerationResult,
    SamplingParams,
    check_backend,
    check_result,
    is_fatal,
)
from agent_loop.backends.retry import backoff_delay
from agent_loop.episode.chat import ChatFormatter, Observation, TemplateError, assistant_message
from agent_loop.episode.context import head_length, latest_turn, load_summarizer, summarized, windowed, with_summary
from agent_loop.episode.contracts import (
    AssistantTurn,
    StepLimits,
    StepResult,
    Task,
    TurnEnvironment,
    as_reward,
    as_task,
    checked_step,
    turn_state_keys,
)
from agent_loop.episode.info import episode_info
from agent_loop.episode.loop_config import POLICY_SUMMARIZER, LoopConfig
from agent_loop.episode.tool_formats import NO_TOOLS, tool_format_for_template
from agent_loop.episode.tools import TRUNCATION_MARK, ToolEnvironment, cut_text
from agent_loop.types import Episode, ToolCallRecord, Trajectory, episode_session_id
from masking.kinds import SpanKind

# A tool result is cut to this many characters per observation token before it is tokenized, so
# truncation costs O(max_observation_tokens), not O(the result's size).
CHARS_PER_TOKEN_BUDGET = 16


def request_seed(seed: int, index: int, turn: int) -> int:
    """A stable per-request sampling seed, so an episode replays the same whatever runs beside it. The policy's
    summary after turn ``k`` asks with ``turn = -1 - k``, a number no turn has."""
    digest = hashlib.blake2b(f"{seed}:{index}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# One formatter per (tokenizer, tool schemas): it caches its template probes across episodes.
_FORMATTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def formatter_for(tokenizer, schemas: list[dict], history_mode: str = "strict") -> ChatFormatter:
    """The shared formatter of ``tokenizer`` with these tool schemas in ``history_mode`` (one of
    :data:`~agent_loop.episode.chat.FORMATTER_MODES`; its template probes are cached)."""
    by_schemas = _FORMATTERS.setdefault(tokenizer, {})
    key = (json.dumps(schemas, sort_keys=True), history_mode)
    if key not in by_schemas:
        by_schemas[key] = ChatFormatter(tokenizer, tools=schemas, history_mode=history_mode)
    return by_schemas[key]


_LIMITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_limits(tokenizer) -> tuple[int, int | None]:
    """``(vocabulary size, context length or None)`` of the model beside ``tokenizer``: the larger of the
    tokenizer's length and config.json's ``vocab_size`` (embedding rows are often padded), and config.json's
    ``max_position_embeddings`` (read once per tokenizer; no config.json: the tokenizer's length, no limit)."""
    if tokenizer not in _LIMITS:
        config: dict = {}
        folder = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            config = config.get("text_config") or config
        except (OSError, ValueError, AttributeError):
            config = {}
        vocab = max(len(tokenizer), int(config.get("vocab_size") or 0))
        context = config.get("max_position_embeddings")
        _LIMITS[tokenizer] = (vocab, int(context) if context else None)
    return _LIMITS[tokenizer]


SLOW_NOTICE_S = 5.0  # a bounded call still running after this many seconds is announced (its ``notice``)


class _DaemonThreads:
    """Daemon threads for :func:`call_bounded`, reused: a new thread's ``start()`` blocks the event loop until
    the thread runs (on a loaded machine, a context switch per call; the verl benchmark measured ~5 ms per
    episode's scoring). A call that never returns keeps its own thread only; at most ``keep`` wait idle."""

    def __init__(self, keep: int = 64):
        self.keep = keep
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has none of the parent's threads

    def _reset(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads that are (or are about to be) waiting in _jobs.get()

    def submit(self, job, name: str) -> None:
        """Run ``job()`` (which must not raise) on an idle thread, else on a new one named ``name``."""
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._work, args=(job,), name=name, daemon=True).start()

    def _work(self, job) -> None:
        jobs = self._jobs
        while True:
            job()
            with self._lock:
                if self._idle >= self.keep or jobs is not self._jobs:
                    return
                self._idle += 1
            job = jobs.get()


_THREADS = _DaemonThreads()


async def call_bounded(fn, timeout_s: float | None, name: str, *, notice=None):
    """``fn()`` on a daemon thread of its own (an idle one reused, else a new one), awaited for at most ``timeout_s`` (TimeoutError after; None: no bound).
    ``notice(seconds)`` is called once if it is still running after :data:`SLOW_NOTICE_S` seconds and its bound
    is longer than that (so that a call that hangs is not a silent wait).

    Its own thread, not the default executor: a call that never returns keeps only that thread (which
    does not keep the process alive) and never the event loop or another episode's call."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value, error) -> None:
        if not future.done():  # given up on (timed out or cancelled): drop the late answer
            future.set_exception(error) if error is not None else future.set_result(value)

    def work() -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:  # noqa: BLE001  (even SystemExit from user code ends this call only)
            value, error = None, exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}")
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop has closed meanwhile: nobody waits for this answer
            pass

    _THREADS.submit(work, name)
    if notice is not None and (timeout_s is None or timeout_s > SLOW_NOTICE_S):
        done, _ = await asyncio.wait({future}, timeout=SLOW_NOTICE_S)  # never raises: fn's own TimeoutError stays its
        if not done:
            notice(SLOW_NOTICE_S)
            timeout_s = None if timeout_s is None else timeout_s - SLOW_NOTICE_S
    async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it swallows a cancel that meets the answer
        return await future


def slow_reward_notice(where: str, timeout_s: float):
    """``call_bounded``'s notice for a reward still running: one warning line naming the episode (``where``) and
    when it ends."""
    def notice(after_s: float) -> None:
        warnings.warn(f"{where}: its reward has not returned after {after_s:g} s; at {timeout_s:g} s "
                      f"(--reward-timeout-s), {timeout_s - after_s:g} s from now, the episode ends with an error and "
                      "reward 0", stacklevel=2)
    return notice


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
                await asyncio.sleep(backoff_delay(attempt, base_s=config.retry_backoff_s))  # few retries: no cap
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
    """What an episode has built so far: the current segment's context (its prompt and messages) and the response
    tokens with their spans, turns and logprobs; the session's turns, tool calls and whole chat; the segments
    closed before the current one (:func:`_new_segment`: snapshots of this state)."""

    messages: list[dict]  # the current segment's context: what its prompt and tokens render
    prompt_ids: list[int] = field(default_factory=list)
    chat: list[dict] = field(default_factory=list)  # the session's every message, in order (what the task scores)
    first_turn: int = 0  # the session's turn that opens the current segment (its turn 0)
    first_record: int = 0  # where the current segment's tool calls start in ``records``
    started: float = 0.0  # when the current segment started (perf_counter)
    closed: list["_EpisodeState"] = field(default_factory=list)  # the segments before the current one
    response_ids: list[int] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)  # the sampling weights' version; -1 off ASSISTANT
    records: list[ToolCallRecord] = field(default_factory=list)
    turn_tokens: list[dict] = field(default_factory=list)  # per turn: assistant and observation token counts
    timings: Counter = field(default_factory=Counter)
    observation_truncations: int = 0
    error: str | None = None
    seen: str = ""  # the one-go render of the messages so far, up to the current generation prompt
    calls_made: int = 0  # tool calls so far: their ids are unique in the episode
    template_diffs: list[dict] = field(default_factory=list)  # turns whose fresh render differs from what was seen
    rerender_diffs: list[dict] = field(default_factory=list)  # assistant turns the template renders otherwise than sampled
    last_turn: tuple[str, int | None] = ("", None)  # the last assistant turn's sampled text and stop token
    step_rewards: list[float | None] = field(default_factory=list)  # per assistant turn: its step's reward, if any
    steps: list[dict] = field(default_factory=list)  # steps with a reward or metadata (Trajectory.info["steps"])
    env_error: str | None = None  # why the environment's step failed (the episode ends with "error")
    summary: dict | None = None  # the policy's summary that closes this segment (metrics["context"]["summary"])

    def append(self, ids: list[int], kind: SpanKind, turn: int, logprobs: list[float] | None = None,
               version: int | None = None) -> None:
        self.response_ids += ids
        self.spans += [int(kind)] * len(ids)
        self.turn_ids += [turn - self.first_turn] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.policy_versions += [-1 if version is None else version] * len(ids)


@dataclass
class _Context:
    """The fixed parts of one episode: who generates, how chat is formatted and parsed, which tools run."""

    backend: Backend
    tokenizer: object
    formatter: ChatFormatter
    parser: object
    env: TurnEnvironment
    config: LoopConfig
    session_id: str
    seed: int
    index: int
    vocab_size: int | None = None  # the model's (model_limits): a sampled id must be below it
    context_length: int | None = None  # the model's, when the backend does not know its own
    summarize: Callable[[list[dict]], str] | None = None  # context="summarize": the summarizer (messages -> text)
    summary_reserve: int = 0  # --summarizer policy: the tokens every turn leaves for the request and the summary


def _context_limit(ctx: _Context) -> int | None:
    """The tokens one context may hold: the model's (the backend's, else config.json's), cut to
    ``max_context_tokens`` when that is set; None: unknown and unset."""
    limits = [n for n in (ctx.backend.context_length or ctx.context_length, ctx.config.max_context_tokens) if n]
    return min(limits, default=None)


def _template_diff(config: LoopConfig, state: _EpisodeState, turn: int, mismatch: dict | None) -> None:
    """Record where a fresh one-go render differs from what the model saw (an error if the config says so)."""
    if mismatch is None:
        return
    if config.on_template_mismatch == "error" and config.history_mode == "strict":
        raise TemplateError(f"turn {turn}: the chat template's one-go render of this episode differs from the "
                            f"tokens the model saw: {mismatch}")
    state.template_diffs.append({"turn": turn - state.first_turn, **mismatch})


def _final_checks(ctx: _Context, state: _EpisodeState) -> None:
    """A finished chat's one-go render: it starts with the last generation prompt, and shows the last turn as sampled."""
    last, formatter = len(state.turn_tokens) - 1, ctx.formatter
    fresh = formatter.render_text(state.messages)  # one render for both checks
    if ctx.config.context != "drop_reasoning":  # there, a render that rewrites the last turn would start a segment
        _template_diff(ctx.config, state, last, formatter.final_mismatch(state.messages, state.seen, fresh=fresh))
    rerender = formatter.final_rerender(state.messages, state.seen, *state.last_turn, fresh=fresh)
    if rerender is not None:
        state.rerender_diffs.append({"turn": last - state.first_turn, **rerender})


async def _generate_turn(ctx: _Context, state: _EpisodeState, turn: int) -> tuple[GenerationResult | None, SamplingParams]:
    """Turn ``turn``'s checked generation (None: ``state.error`` says why) and the sampling it asked for.

    The prompt must leave room in the model's context (else an error before anything is generated, however
    long the prompt: no backend builds tensors for it), and a turn asks for no more tokens than that room;
    under ``--summarizer policy`` it leaves ``summary_reserve`` tokens of it (and of the segment's response
    budget) for the summary that may follow it."""
    config, reserve = ctx.config, ctx.summary_reserve
    prompt = state.prompt_ids + state.response_ids
    room = config.max_tokens
    context = _context_limit(ctx)
    if context is not None:
        room = min(room, context - len(prompt) - reserve)
    budget = config.max_response_tokens - len(state.response_ids) - reserve
    sampling = _sampling(ctx, min(room, budget), request_seed(ctx.seed, ctx.index, turn))
    if room < 1 or budget < 1:  # only a segment's first prompt can (later ones end in observation_overflow first)
        state.error = _no_room(ctx, turn, len(prompt), context, in_context=room < 1)
        return None, sampling
    return await _checked_generation(ctx, state, prompt, sampling, f"turn {turn}"), sampling


def _sampling(ctx: _Context, max_tokens: int, seed: int) -> SamplingParams:
    """The episode's sampling settings for one request of at most ``max_tokens`` tokens."""
    config = ctx.config
    return SamplingParams(max_tokens=max_tokens, temperature=config.temperature, top_p=config.top_p,
                          top_k=config.top_k, stop_token_ids=ctx.formatter.end_of_turn_ids, seed=seed)


def _no_room(ctx: _Context, turn: int, prompt_length: int, context: int | None, *, in_context: bool) -> str:
    """Why turn ``turn`` cannot generate: its prompt of ``prompt_length`` tokens fills the ``context`` limit
    (``in_context``), else the segment's response budget is spent, beside the policy's summary where one is kept."""
    config, reserve = ctx.config, ctx.summary_reserve
    beside = (f", beside the {reserve} tokens each turn keeps for the policy's summary and its request "
              "(--summary-tokens)") if reserve else ""
    if not in_context:
        return (f"ContextLengthError: turn {turn}: --max-response-tokens {config.max_response_tokens} leaves no "
                f"room{beside}")
    limit = "--max-context-tokens" if context == config.max_context_tokens else "the model's context"
    return (f"ContextLengthError: turn {turn}: the prompt of {prompt_length} tokens leaves no room in {limit} of "
            f"{context} tokens{beside}")


async def _checked_generation(ctx: _Context, state: _EpisodeState, prompt: list[int], sampling: SamplingParams,
                              what: str) -> GenerationResult | None:
    """The backend's answer to ``prompt`` after retries, checked whichever backend sent it (a bad answer is not
    retried); None where there is none (``state.error`` says why; ``what`` names the request in a bad answer's)."""
    t0 = time.perf_counter()
    result, state.error = await _generate_with_retries(ctx.backend, prompt, sampling, ctx.session_id, ctx.config)
    state.timings["generate_s"] += time.perf_counter() - t0
    if result is not None:
        try:
            check_result(result, sampling, ctx.vocab_size)
        except BadOutputError as bad:
            result, state.error = None, f"BadOutputError: {what}: {ctx.backend.describe(ctx.session_id)} {bad}"
    return result


def _sampled_text(ctx: _Context, result: GenerationResult, sampling: SamplingParams) -> tuple[str, int | None]:
    """A generation's text as sampled (special tokens kept) without its end-of-turn token, and that token (None:
    the generation was cut)."""
    stopped = result.finish_reason == "stop" and result.token_ids[-1] in sampling.stop_token_ids
    text = ctx.tokenizer.decode(result.token_ids[: -1 if stopped else None], skip_special_tokens=False)
    return text, result.token_ids[-1] if stopped else None


async def _play_turn(ctx: _Context, state: _EpisodeState, turn: int) -> str | None:
    """One assistant turn and the environment's answer to it; the finish reason if the episode ends here."""
    result, sampling = await _generate_turn(ctx, state, turn)
    if result is None:
        return "error"
    state.append(result.token_ids, SpanKind.ASSISTANT, turn, result.logprobs, result.policy_version)
    state.turn_tokens.append({"assistant": len(result.token_ids), "observation": 0})
    state.step_rewards.append(None)

    text, stop_id = _sampled_text(ctx, result, sampling)
    state.last_turn = (text, stop_id)
    assistant = _assistant_turn(ctx, state, turn, text, result.finish_reason)
    step = await _step(ctx, state, assistant)
    if step is None:
        return "error"
    state.records += step.tool_calls
    state.step_rewards[-1] = step.reward
    if step.reward is not None or step.metadata:
        state.steps.append({"turn": turn, "reward": step.reward, "done": step.done, "truncated": step.truncated,
                            "metadata": step.metadata})
    if result.finish_reason == "length":
        return "length"
    if step.done:
        return "stop"
    if assistant.final or step.truncated:
        return "max_turns"  # no turn left to read the observation (the loop's limit, or the environment's)
    if not step.observations:
        state.env_error = (f"EnvironmentError: turn {turn}: {type(ctx.env).__name__}'s step neither ended the "
                           "episode (done) nor gave an observation")
        return "error"
    return await _observe(ctx, state, turn, step.observations, stop_id, text)


def _assistant_turn(ctx: _Context, state: _EpisodeState, turn: int, text: str, finish_reason: str) -> AssistantTurn:
    """Parse the turn's tool calls, record its assistant message, and say what the environment is given."""
    formatter, parsed = ctx.formatter, ctx.parser(text)
    ids = [formatter.call_id(c.name, state.calls_made + i) for i, c in enumerate(parsed.calls)]
    ids += [formatter.call_id("", state.calls_made + len(ids) + i) for i in range(len(parsed.errors))]
    state.calls_made += len(ids)
    if parsed.errors:  # calls that did not parse have no structured form: keep the turn as sampled text
        message = assistant_message(text)
    else:
        calls = [{"name": c.name, "arguments": c.arguments, "id": i} for c, i in zip(parsed.calls, ids)]
        message = assistant_message(parsed.content, calls or None, reasoning=parsed.reasoning)
    state.messages.append(message)
    state.chat.append(message)
    final = finish_reason == "length" or turn == ctx.config.max_turns - 1
    return AssistantTurn(turn, text, parsed.content, parsed.calls + parsed.errors, ids, final, finish_reason)


async def _step(ctx: _Context, state: _EpisodeState, turn: AssistantTurn) -> StepResult | None:
    """The environment's checked answer to ``turn``, bounded in time (None: ``state.env_error`` says why).

    A sync step runs on a daemon thread of its own (a hung one keeps only that thread); an async one is
    awaited under the same bound unless the environment bounds its own work (``bounds_its_steps``)."""
    config, env = ctx.config, ctx.env
    limits = StepLimits(config.tool_timeout_s, config.max_parallel_tool_calls,
                        config.max_observation_tokens * CHARS_PER_TOKEN_BUDGET)
    name = type(env).__name__
    t0 = time.perf_counter()
    try:
        if inspect.iscoroutinefunction(env.step):
            pending = env.step(turn, limits)
            async with asyncio.timeout(None if env.bounds_its_steps else limits.timeout_s):
                result = await pending
        else:
            result = await call_bounded(lambda: env.step(turn, limits), limits.timeout_s, f"step-{name}")
        return checked_step(result, limits, cut_text)
    except TimeoutError:
        state.env_error = (f"EnvironmentTimeout: turn {turn.index}: {name}'s step took longer than "
                           f"{limits.timeout_s:g} s (tool_timeout_s)")
    except Exception as error:  # the environment's failure ends this episode, never the run
        state.env_error = f"EnvironmentError: turn {turn.index}: {name}'s step failed: {type(error).__name__}: {error}"
    finally:
        state.timings["tools_s"] += time.perf_counter() - t0
    return None


async def _observe(ctx: _Context, state: _EpisodeState, turn: int, messages: list[dict], stop_id: int | None,
                   text: str) -> str | None:
    """Append the observation of ``messages`` (rendered by the chat template after the episode so far, checked
    against a fresh one-go render, cut to the observation budget); "observation_overflow" if it does not fit.
    Where the context policy rewrites the history (:func:`_rewritten`, or the policy's own summary:
    :func:`_summarize_by_policy`), a new segment starts instead."""
    config, formatter = ctx.config, ctx.formatter
    obs, new_messages, cut = _fit_observation(formatter, state, messages, stop_id, text, config.max_observation_tokens)
    state.observation_truncations += cut
    room = _response_room(ctx, state)
    overflow = len(state.response_ids) + len(obs.ids) >= room
    if config.summarizer == POLICY_SUMMARIZER and _summary_due(ctx, state, obs, room):
        return await _summarize_by_policy(ctx, state, turn, obs, new_messages, room)
    if (kept := _rewritten(ctx, state, obs, new_messages, overflow)) is not None:
        state.chat += new_messages
        _new_segment(ctx, state, kept)
        return None
    _record_observation(ctx, state, turn, obs, new_messages)
    state.chat += new_messages
    if overflow:
        return "observation_overflow"  # no room left (budget or model context) for the observation and a next turn
    state.append(obs.ids, SpanKind.OBSERVATION, turn)
    state.turn_tokens[-1]["observation"] = len(obs.ids)
    return None


def _response_room(ctx: _Context, state: _EpisodeState) -> int:
    """The response tokens the current segment may hold: ``max_response_tokens``, less where the context left after
    its prompt is smaller."""
    context = _context_limit(ctx)
    budget = ctx.config.max_response_tokens
    return budget if context is None else min(budget, context - len(state.prompt_ids))


def _record_observation(ctx: _Context, state: _EpisodeState, turn: int, obs: Observation, messages: list[dict]) -> None:
    """``messages`` join the segment's context as the template rendered them (``obs``: its template diffs recorded,
    its render what the model has seen); their tokens are the caller's to append."""
    state.messages += messages
    _template_diff(ctx.config, state, turn, obs.mismatch)
    if obs.rerender is not None:
        state.rerender_diffs.append({"turn": turn - state.first_turn, **obs.rerender})
    state.seen = obs.rendered


def _rewritten(ctx: _Context, state: _EpisodeState, obs: Observation, new_messages: list[dict],
               overflow: bool) -> list[dict] | None:
    """The messages of the next segment's context where the context policy rewrites the history after this
    observation (``obs`` of ``new_messages``; ``overflow``: it does not fit), else None (docs/design.md section 5):
    ``window``: the head and the last ``context_window`` turns, once there are more; ``drop_reasoning``: every
    message, where the template's one-go render rewrites what the model saw; ``summarize``: the head with a
    summary of the turns, where the observation does not fit or the context would pass ``context_budget``."""
    config, messages = ctx.config, state.messages + new_messages
    if config.context == "window":
        return windowed(messages, config.context_window)
    if config.context == "drop_reasoning":
        return messages if obs.mismatch is not None else None
    if config.context == "summarize" and ctx.summarize is not None:  # else the policy's: _summarize_by_policy
        size = len(state.prompt_ids) + len(state.response_ids) + len(obs.ids)
        if overflow or (config.context_budget and size > config.context_budget):
            return summarized(messages, ctx.summarize)
    return None


def _summary_due(ctx: _Context, state: _EpisodeState, obs: Observation, room: int) -> bool:
    """Whether the policy writes its summary after this observation (``obs``): where it leaves a next turn no room
    beside the summary's reserve (a later summary might not fit; an observation that does not fit at all is such a
    case), or where prompt + response + observation would pass ``context_budget``."""
    size = len(state.response_ids) + len(obs.ids)
    budget = ctx.config.context_budget
    return size + ctx.summary_reserve >= room or bool(budget and len(state.prompt_ids) + size > budget)


async def _summarize_by_policy(ctx: _Context, state: _EpisodeState, turn: int, obs: Observation, results: list[dict],
                               room: int) -> str | None:
    """The policy writes the summary of the segment after turn ``turn`` and the next segment starts on it
    (docs/design.md section 5, "Context policies"). The request (``summary_prompt``, a user message) is
    OBSERVATION tokens of turn ``turn``, after the turn's tool ``results`` (``obs``: their observation) where the
    summary still fits ``room`` with them, else right after the assistant turn; the summary is ASSISTANT tokens of
    a turn of its own, with its logprobs. The next segment: the head with the summary, then the latest turn (the
    assistant message and ``results``) verbatim. The task's chat gets ``results``, never the request or the
    summary. "observation_overflow" where the summary has no room even so (``state.summary`` says why), "error"
    where the backend fails (``state.error``)."""
    latest, head = latest_turn(state.messages) + results, state.messages[:head_length(state.messages)]
    state.chat += results
    asked, placed = _summary_request(ctx, state, results, room)
    if asked is None:
        _record_observation(ctx, state, turn, obs, results)
        state.summary = {"overflow": f"turn {turn}: no room for the policy's summary of {ctx.config.summary_size()} "
                                     f"tokens and its request in the {room - len(state.response_ids)} response tokens "
                                     "left; raise --max-response-tokens or lower --summary-tokens"}
        return "observation_overflow"
    _record_observation(ctx, state, turn, asked, placed)
    state.append(asked.ids, SpanKind.OBSERVATION, turn)
    state.turn_tokens[-1]["observation"] = len(asked.ids)
    sampling = _sampling(ctx, ctx.config.summary_size(), request_seed(ctx.seed, ctx.index, -1 - turn))
    result = await _checked_generation(ctx, state, state.prompt_ids + state.response_ids, sampling,
                                       f"turn {turn}'s summary")
    if result is None:
        state.error = f"SummaryError: turn {turn}: the policy's summary failed: {state.error}"
        return "error"
    state.append(result.token_ids, SpanKind.ASSISTANT, turn + 1, result.logprobs, result.policy_version)
    summary, stop_id = _sampled_text(ctx, result, sampling)
    state.messages.append(assistant_message(summary))  # the segment's messages render its tokens, summary included
    rerender = ctx.formatter.final_rerender(state.messages, state.seen, summary, stop_id)
    if rerender is not None:
        state.rerender_diffs.append({"turn": turn + 1 - state.first_turn, **rerender})
    state.summary = {"turn": turn + 1 - state.first_turn, "request_tokens": len(asked.ids),
                     "tokens": len(result.token_ids), "finish": result.finish_reason, "after_results": len(placed) > 1}
    _new_segment(ctx, state, with_summary(head, summary, latest))
    return None


def _summary_request(ctx: _Context, state: _EpisodeState, results: list[dict],
                     room: int) -> tuple[Observation | None, list[dict]]:
    """The observation of the summary request and the messages it renders: ``results`` and the request where the
    summary fits ``room`` after them, else the request alone (right after the latest assistant turn, whose room every
    turn keeps: ``summary_reserve``); (None, []) where neither fits."""
    request = {"role": "user", "content": ctx.config.summary_prompt}
    text, stop_id = state.last_turn
    for placed in (results + [request], [request]):
        asked = ctx.formatter.observation(state.messages, state.seen, placed, stop_id, text)
        if len(state.response_ids) + len(asked.ids) + ctx.config.summary_size() <= room:
            return asked, placed
    return None, []


def _new_segment(ctx: _Context, state: _EpisodeState, messages: list[dict]) -> None:
    """Close the current segment (a snapshot of ``state`` joins ``state.closed``) and start the next one on a fresh
    render of ``messages``: its own prompt, tokens, template checks and timings; the session's turns, tool calls,
    rewards and chat go on. A snapshot keeps the lists it had: they are replaced here, never emptied."""
    state.closed.append(copy.copy(state))
    state.messages = [dict(m) for m in messages]
    state.prompt_ids, state.seen = ctx.formatter.prompt(state.messages)
    state.response_ids, state.spans, state.turn_ids, state.logprobs, state.policy_versions = [], [], [], [], []
    state.template_diffs, state.rerender_diffs, state.observation_truncations = [], [], 0
    state.timings, state.started = Counter(), time.perf_counter()
    state.first_turn, state.first_record = len(state.turn_tokens), len(state.records)
    state.summary = None


def environment_of(episode: Episode) -> TurnEnvironment:
    """What answers the episode's turns: its own ``environment``, else the tool environment of its ``tools``."""
    env = episode.environment
    if env is None:
        return ToolEnvironment(episode.tools)
    if not isinstance(env, TurnEnvironment):
        raise TypeError(f"Episode.environment must be a TurnEnvironment (agent_loop.episode.contracts), got "
                        f"{type(env).__name__}")
    if episode.tools:
        raise ValueError("an episode has tools or an environment, not both: give the tools to its environment "
                         "(agent_loop.episode.tools.ToolEnvironment)")
    return env


async def _close(env: TurnEnvironment, timeout_s: float) -> str | None:
    """Close the episode's environment (sync or async, bounded by ``timeout_s``); why it failed, or None."""
    try:
        if inspect.iscoroutinefunction(env.close):
            async with asyncio.timeout(timeout_s):
                await env.close()
        else:
            await call_bounded(env.close, timeout_s, f"close-{type(env).__name__}")
    except TimeoutError:
        return f"EnvironmentTimeout: closing {type(env).__name__} took longer than {timeout_s:g} s"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


async def run_episode(
    task: Task,
    index: int,
    backend: Backend,
    tokenizer,
    config: LoopConfig | None = None,
    seed: int = 0,
    *,
    prompt_check=None,
) -> Trajectory:
    """Play episode ``index`` of ``task`` against ``backend`` and return its Trajectory: :func:`run_session` for a
    caller that takes one record per episode. An episode whose context policy rewrote its history (several
    segments) is a ValueError saying so: its segments train as one sample only where sessions are carried."""
    segments = await run_session(task, index, backend, tokenizer, config, seed, prompt_check=prompt_check)
    if len(segments) > 1:
        raise ValueError(f"episode {index} of {as_task(task).name}: context={(config or LoopConfig()).context!r} "
                         f"rewrote its history into {len(segments)} segments, and this caller takes one Trajectory per "
                         "episode (run_episode): it does not carry sessions; use run_session (the local runner and "
                         "the trainer's synchronous rollouts do) or context='keep'")
    return segments[0]


async def run_session(
    task: Task,
    index: int,
    backend: Backend,
    tokenizer,
    config: LoopConfig | None = None,
    seed: int = 0,
    *,
    prompt_check=None,
) -> list[Trajectory]:
    """Play episode ``index`` of ``task`` against ``backend`` and return its session: one Trajectory per segment
    (one, unless ``config.context`` rewrote the history: docs/design.md section 5), in segment order.

    ``prompt_check(prompt_ids)``, if given, sees the first prompt as soon as it is rendered, before anything is
    generated; what it raises ends the call (the verl AgentLoop refuses a prompt longer than verl's
    ``prompt_length`` so, without rendering the prompt a second time)."""
    config, task, backend = config or LoopConfig(), as_task(task), check_backend(backend)
    started = time.perf_counter()
    episode = task.make_episode(index, seed)
    env = environment_of(episode)
    try:
        ctx, state = _begin(task, episode, env, index, backend, tokenizer, config, seed)
        if prompt_check is not None:
            prompt_check(state.prompt_ids)
        finish_reason = "max_turns"
        for turn in range(config.max_turns):
            if (ended := await _play_turn(ctx, state, turn)) is not None:
                finish_reason = ended
                break
        if finish_reason == "stop":  # the last turn's generation prompt, as a one-go render of the finished chat writes it
            _final_checks(ctx, state)
        score = await _score(task, episode, state, config.reward_timeout_s,
                             where=f"episode {index} of {task.name} (seed {seed})")
    finally:
        close_error = await _close(env, config.tool_timeout_s)
    if close_error is not None:
        episode.info["environment_close_error"] = close_error
    if score.error is not None:  # the episode was played (its tokens are kept); its score is what failed
        finish_reason = "error"
        episode.info["reward_error"] = score.error
    return _finish(task, episode, ctx, state, finish_reason, score, time.perf_counter() - started)


def _begin(task: Task, episode: Episode, env: TurnEnvironment, index: int, backend: Backend, tokenizer,
           config: LoopConfig, seed: int) -> tuple[_Context, _EpisodeState]:
    """The episode's fixed parts and its state before the first turn (the prompt rendered once)."""
    formatter = formatter_for(tokenizer, env.tool_schemas,
                              "new_segment" if config.context == "drop_reasoning" else config.history_mode)
    # a task (or the verl AgentLoop's tool_format option) may fix the format; else the template's
    episode.tool_format = episode.tool_format or formatter.tool_format or (
        NO_TOOLS if not env.tool_schemas else tool_format_for_template(formatter.template_text))
    state = _EpisodeState(messages=[dict(m) for m in episode.messages], started=time.perf_counter())
    state.chat = list(state.messages)
    state.prompt_ids, state.seen = formatter.prompt(state.messages)
    ctx = _Context(
        backend=backend, tokenizer=tokenizer, formatter=formatter,
        parser=episode.tool_format.parser_for(env.tool_schemas), env=env, config=config,
        session_id=episode_session_id(task.name, seed, index),  # one per episode: multi-server backends keep it on one server
        seed=seed, index=index,
    )
    ctx.vocab_size, ctx.context_length = model_limits(tokenizer)
    if config.summarizer == POLICY_SUMMARIZER:  # the loop asks the policy itself (_summarize_by_policy)
        ctx.summary_reserve = _request_tokens(formatter, state, config.summary_prompt) + config.summary_size()
    elif config.context == "summarize":
        ctx.summarize = load_summarizer(config.summarizer)
    return ctx, state


def _request_tokens(formatter: ChatFormatter, state: _EpisodeState, prompt: str) -> int:
    """The tokens of the policy's summary request right after an assistant turn: the observation of it after an
    empty turn that follows the prompt (the template's tokens around a user message do not depend on the turn)."""
    history = state.messages + [assistant_message("")]
    request = {"role": "user", "content": prompt}
    return len(formatter.observation(history, state.seen, [request], formatter.end_of_turn_ids[0], "").ids)


def with_step_rewards(reward: float, turn_rewards: list[float] | None,
                      step_rewards: list[float | None]) -> tuple[float, list[float] | None]:
    """The episode's outcome and turn rewards with its environment's per-turn rewards added.

    The last turn's step reward joins the outcome reward (both sit on the episode's last ASSISTANT token), each
    earlier turn's joins that turn's reward; so the return of every token is what the environment's rewards
    give, and ``Trajectory.reward`` is the environment's final reward (plus the task's own). An environment
    that gives no per-turn reward (every entry None: the tool environment) changes nothing."""
    if all(r is None for r in step_rewards):
        return reward, turn_rewards
    values = [r or 0.0 for r in step_rewards]
    per_turn = values[:-1] + [0.0]
    if turn_rewards is not None:
        per_turn = [a + b for a, b in zip(turn_rewards, per_turn, strict=True)]
    return reward + values[-1], per_turn


@dataclass
class _Score:
    reward: float = 0.0
    turn_rewards: list[float] | None = None
    task_metrics: dict = field(default_factory=dict)
    success: bool = False
    error: str | None = None  # why scoring failed (then the rest are the defaults)
    turn_states: list | None = None  # the task's state key per assistant turn (Task.turn_states), or None


async def _score(task: Task, episode: Episode, state: _EpisodeState, timeout_s: float, *,
                 where: str = "an episode") -> _Score:
    """The task's reward, turn rewards, metrics and success of a played episode, computed on a thread of their
    own for at most ``timeout_s`` (a reward that hangs ends this episode only, the event loop never waits on
    it, and after a few seconds a warning names the episode, ``where``); a hook that raises or times out gives
    the error and a zero reward."""
    def score() -> _Score:  # a reward that is NaN, infinite or not a number fails like one that raises
        reward = as_reward(task.reward(episode, state.chat, state.records), f"{task.name}'s reward")
        turns = task.turn_rewards(episode, state.chat, state.records)
        reward, turns = with_step_rewards(reward, turns and [as_reward(r, f"{task.name}'s turn reward") for r in turns],
                                          state.step_rewards)
        assistant_turns = sum(t["assistant"] > 0 for t in state.turn_tokens)
        states = turn_state_keys(task.turn_states(episode, state.chat, state.records), assistant_turns,
                                 f"{task.name}'s turn_states")
        return _Score(reward, turns, task.episode_metrics(episode, state.chat, state.records) or {},
                      bool(task.success(episode, reward)), turn_states=states)

    try:
        return await call_bounded(score, timeout_s, f"reward-{task.name}", notice=slow_reward_notice(where, timeout_s))
    except asyncio.TimeoutError:
        return _Score(error=f"RewardTimeout: scoring {task.name} episode took longer than {timeout_s:g} s "
                            "(reward_timeout_s); reward 0")
    except Exception as error:
        return _Score(error=f"{type(error).__name__}: {error}")


def _finish(task: Task, episode: Episode, ctx: _Context, state: _EpisodeState, finish_reason: str, score: _Score,
            elapsed_s: float) -> list[Trajectory]:
    """Assemble the episode's records: one Trajectory per segment, in order. Every segment holds the session's
    reward, success and episode info (the session is scored once, on its whole chat); its own turns' turn
    rewards, turn states, steps, tool calls and token counts (turns numbered from 0 in each segment, as the
    proxy's are); the last one the session's finish reason, earlier ones "history_rewrite"."""
    segments = [*state.closed, state]
    ends = [(s.first_turn, s.first_record, s.started) for s in segments[1:]]
    ends.append((len(state.turn_tokens), len(state.records), None))
    out, earlier_s = [], 0.0
    for n, (seg, (end_turn, end_record, next_started)) in enumerate(zip(segments, ends)):
        last = seg is state
        total_s = elapsed_s - earlier_s if last else next_started - seg.started
        earlier_s += total_s
        out.append(_segment_record(task, episode, ctx, seg, n, len(segments), score, end_turn, end_record,
                                   finish_reason if last else "history_rewrite", total_s, last))
    return out


def _summary_turn(seg: _EpisodeState, turn_rewards: list[float] | None, turn_states: list | None, first: int,
                  end_turn: int) -> tuple[list[float] | None, list | None]:
    """The session's turn rewards and turn states of the segment's turns ``first`` to ``end_turn``, and of the policy's
    summary that closes it, a turn of its own: reward 0 (the session's return reaches it through the later turns'),
    state ``("summary", the state of the turn it follows)`` (GiGPO compares it with summaries after that state)."""
    turn_rewards = turn_rewards[first:end_turn] if turn_rewards is not None else None
    turn_states = turn_states[first:end_turn] if turn_states is not None else None
    if seg.summary is None or "turn" not in seg.summary:
        return turn_rewards, turn_states
    return (turn_rewards and [*turn_rewards, 0.0],
            turn_states and [*turn_states, ("summary", turn_states[-1])])


def _segment_record(task: Task, episode: Episode, ctx: _Context, seg: _EpisodeState, n: int, count: int, score: _Score,
                    end_turn: int, end_record: int, finish_reason: str, total_s: float, last: bool) -> Trajectory:
    """Segment ``n`` of ``count`` (``seg``: its state; its turns end at the session's turn ``end_turn``, its tool
    calls at ``end_record``) as a Trajectory: what :func:`_finish` says it holds."""
    first = seg.first_turn
    turn_tokens = seg.turn_tokens[first:end_turn]
    records = seg.records[seg.first_record:end_record]
    if first:
        records = [dataclasses.replace(r, turn=r.turn - first) for r in records]
    task_metrics = score.task_metrics if last else None  # the session's: counted once
    metrics = {
        "turns": len(turn_tokens),
        "turn_tokens": turn_tokens,
        "assistant_tokens": sum(t["assistant"] for t in turn_tokens),
        "observation_tokens": sum(t["observation"] for t in turn_tokens),
        "tool_calls": len(records),
        "tool_errors": dict(Counter(r.error_kind for r in records if r.error_kind)),
        "observation_truncations": seg.observation_truncations,
        "generate_s": seg.timings["generate_s"],
        "tools_s": seg.timings["tools_s"],
        "total_s": total_s,
        # template exactness (docs/templates.md): did every observation extend a fresh one-go render of the
        # episode's messages? Counted as mismatches (strict) or drift (history_mode="keep_seen").
        "template_exact": not seg.template_diffs,
        "template_mismatch": 0 if ctx.config.history_mode == "keep_seen" else len(seg.template_diffs),
        "template_drift": len(seg.template_diffs) if ctx.config.history_mode == "keep_seen" else 0,
        "template_first_diff": seg.template_diffs[0] if seg.template_diffs else None,
        # assistant turns whose recorded message the template renders otherwise than the model sampled them (what a
        # trainer rendering the messages again would see): {"turn", "char", "sampled", "rendered"} of the first
        "template_rerender_diffs": len(seg.rerender_diffs),
        "template_rerender_first": seg.rerender_diffs[0] if seg.rerender_diffs else None,
    }
    if task_metrics:  # the task's own numbers about the episode, averaged by the trainer
        metrics["task"] = task_metrics
    if last and seg.error:
        metrics["backend_error"] = seg.error
    if last and (seg.env_error or score.error):
        metrics["error"] = seg.env_error or score.error
    if ctx.config.context != "keep":  # how the session's history was managed (docs/design.md section 5)
        metrics["context"] = {"policy": ctx.config.context, "segment": n, "segments": count,
                              **({"summary": seg.summary} if seg.summary else {})}
    # steps: the environment's per-turn rewards, done/truncated and metadata, as it gave them
    steps = [{**s, "turn": s["turn"] - first} for s in seg.steps if first <= s["turn"] < end_turn]
    turn_rewards, turn_states = _summary_turn(seg, score.turn_rewards, score.turn_states, first, end_turn)
    info = episode_info(task.name, ctx.index, ctx.seed, success=score.success, tokenizer=ctx.tokenizer,
                        identity={"answer": episode.answer, "session_id": ctx.session_id, "segment": n},
                        extra={**episode.info, **({"steps": steps} if steps else {}),
                               **({"turn_states": turn_states} if turn_states is not None else {})})
    return Trajectory(
        prompt_ids=seg.prompt_ids, response_ids=seg.response_ids, spans=seg.spans, turn_ids=seg.turn_ids,
        logprobs=seg.logprobs, messages=seg.messages, tool_calls=records, reward=score.reward,
        turn_rewards=turn_rewards,
        finish_reason=finish_reason, truncated=finish_reason == "length", metrics=metrics, info=info,
        policy_versions=seg.policy_versions if any(v >= 0 for v in seg.policy_versions) else None,
    )
