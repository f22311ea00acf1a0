"""The recording proxy without HTTP: sessions, one checked token-in/token-out generation per call, finished
sessions handed on as Trajectories.

Rules (docs/agents.md): one call at a time per session (a second concurrent call is refused with 409, never
queued, so the order of a session's turns is the agent's); a session idle for ``idle_timeout_s`` is closed and
written (counted as ``idle_closed``); at most ``max_sessions`` are open (a new one beyond is refused with 503),
so memory is bounded by the open sessions; a finished session is dropped from memory once handed on.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from agent_loop.backends.base import Backend, BadOutputError, SamplingParams, check_backend, check_result
from agent_loop.episode.loop import formatter_for, model_limits, request_seed
from agent_loop.episode.tool_formats import tool_format_for_template
from agent_loop.proxy.session import Session, trajectories
from agent_loop.proxy.wire import ApiError, ChatRequest
from agent_loop.tasks.rewards import as_reward
from agent_loop.types import Trajectory

_ENDED_MEMORY = 4096  # ids of recently ended sessions, to tell "ended" from "unknown"


@dataclass
class ProxySettings:
    """How the proxy samples and keeps sessions."""

    model_name: str = "policy"
    max_tokens: int = 256  # per call when the request gives none
    temperature: float = 1.0  # when the request gives none
    top_p: float = 1.0
    seed: int = 0  # per-call seeds derive from it, the session id and the turn (request_seed)
    idle_timeout_s: float = 600.0
    max_sessions: int = 1024
    one_request_sessions: bool = False  # a call without a session id is a session of its own, ended after it


@dataclass
class Completion:
    """One answered call."""

    content: str
    calls: list[dict]
    finish: str
    token_ids: list[int]
    logprobs: list[float]
    prompt_ids: list[int]
    session_id: str


@dataclass
class Proxy:
    """Sessions over ``backend`` (any of ours) and ``tokenizer``; ``on_finish(trajectories)`` gets every finished
    session's segments (the server writes them as JSON Lines)."""

    backend: Backend
    tokenizer: object
    settings: ProxySettings = field(default_factory=ProxySettings)
    on_finish: Callable[[list[Trajectory]], None] | None = None
    sessions: OrderedDict = field(default_factory=OrderedDict)
    ended: OrderedDict = field(default_factory=OrderedDict)  # recently ended id -> whether it got a reward
    counts: Counter = field(default_factory=Counter)

    def __post_init__(self):
        check_backend(self.backend)
        self.vocab_size, self.context = model_limits(self.tokenizer)

    # -- sessions ---------------------------------------------------------------------------------

    def open(self, session_id: str, row: dict | None = None) -> Session:
        """The open session ``session_id``, opened now if new (503 past ``max_sessions``; 409 if it has ended)."""
        if session_id in self.sessions:
            self.sessions.move_to_end(session_id)
            return self.sessions[session_id]
        if session_id in self.ended:
            raise ApiError(409, f"session {session_id!r} has ended; use a new session id for a new episode",
                           code="session_ended")
        if len(self.sessions) >= self.settings.max_sessions:
            self.counts["refused_full"] += 1
            raise ApiError(503, f"{len(self.sessions)} sessions are open (max_sessions); end some "
                           "(POST /v1/sessions/{id}/end) or wait for idle ones to close", kind="server_error",
                           code="too_many_sessions")
        session = self.sessions[session_id] = Session(session_id, row=row)
        self.counts["opened"] += 1
        return session

    def session(self, session_id: str) -> Session:
        if session_id in self.sessions:
            return self.sessions[session_id]
        if session_id in self.ended:
            raise ApiError(409, f"session {session_id!r} has already ended", code="session_ended")
        raise ApiError(404, f"no session {session_id!r}", code="session_not_found")

    def set_reward(self, session_id: str, reward) -> None:
        """Attach the episode's reward (once: a second one is refused with 409)."""
        session = self.session(session_id)
        try:
            value = as_reward(reward, "reward")
        except (TypeError, ValueError) as error:
            raise ApiError(400, f"reward: {error}", param="reward") from None
        if session.reward is not None:
            raise ApiError(409, f"session {session_id!r} already has reward {session.reward:g}",
                           code="reward_already_set")
        session.reward = value

    def end(self, session_id: str, *, closed_by: str = "end", scorer=None, info: dict | None = None) -> list[Trajectory]:
        """Close the session and hand on its Trajectories (none if it made no call). ``scorer(messages, tool_call_records)``
        of the last segment gives the reward when none was posted."""
        session = self.session(session_id)
        del self.sessions[session_id]
        self.ended[session_id] = True
        while len(self.ended) > _ENDED_MEMORY:
            self.ended.popitem(last=False)
        self.counts[f"closed_{closed_by}"] += 1
        self.counts["rewrites"] += session.counts["rewrites"]
        self.counts["template_drift"] += session.counts["template_drift"]
        if not session.segments:
            return []
        reward = session.reward
        if reward is None and scorer is not None:
            last = session.segments[-1].state
            reward = scorer(last.messages, last.records)
        row = session.row or {}
        out = trajectories(session, reward=reward or 0.0, closed_by=closed_by, tokenizer=self.tokenizer,
                           task=row.get("task", "proxy"), index=row.get("index", 0), seed=row.get("seed", 0),
                           info=info)
        if self.on_finish is not None:
            self.on_finish(out)
        return out

    def close_idle(self, now: float | None = None) -> int:
        """End the sessions idle for longer than ``idle_timeout_s`` (not those in a call); how many."""
        now = time.monotonic() if now is None else now
        idle = [s.id for s in self.sessions.values()
                if not s.lock.locked() and now - s.last_used > self.settings.idle_timeout_s]
        for session_id in idle:
            self.end(session_id, closed_by="idle")
        return len(idle)

    def close_all(self) -> None:
        for session_id in list(self.sessions):
            self.end(session_id, closed_by="shutdown")

    # -- one call ---------------------------------------------------------------------------------

    async def complete(self, request: ChatRequest, session_id: str | None) -> Completion:
        """Answer one call: render, extend or rewrite the session, generate, parse; the session changes only if
        the generation completes (a cancelled call leaves it as it was)."""
        if request.model != self.settings.model_name:
            raise ApiError(404, f"model {request.model!r} is not served here (this proxy serves "
                           f"{self.settings.model_name!r})", param="model", code="model_not_found")
        one_off = session_id is None
        if one_off and not self.settings.one_request_sessions:
            raise ApiError(400, "no session id: send an X-Session-Id header (or use the session id as the API key, "
                           "or set user / metadata.session_id); or start the proxy with --one-request-sessions",
                           code="missing_session_id")
        session = self.open(session_id or f"one-{uuid.uuid4().hex}")
        if session.lock.locked():
            self.counts["refused_busy"] += 1
            raise ApiError(409, f"session {session.id!r} already has a call in progress: a session's calls are "
                           "answered one at a time (send the next after the last answer)", code="session_busy")
        async with session.lock:
            session.last_used = time.monotonic()
            try:
                return await self._complete_locked(request, session)
            finally:
                session.last_used = time.monotonic()
                if one_off and session.id in self.sessions:
                    self.end(session.id, closed_by="one_request")

    async def _complete_locked(self, request: ChatRequest, session: Session) -> Completion:
        formatter = formatter_for(self.tokenizer, request.tools, "keep_seen")
        pending = session.plan(request.messages, request.tools, formatter)
        context = self.backend.context_length or self.context
        room = request.max_tokens or self.settings.max_tokens
        if context is not None:
            room = min(room, context - len(pending.prompt))
        if room < 1:
            raise ApiError(400, f"the prompt of {len(pending.prompt)} tokens leaves no room in the model's context of "
                           f"{context} tokens", param="messages", code="context_length_exceeded")
        turn = session.counts["calls"]
        sampling = SamplingParams(
            max_tokens=room, temperature=self.settings.temperature if request.temperature is None else request.temperature,
            top_p=self.settings.top_p if request.top_p is None else request.top_p,
            stop_token_ids=formatter.end_of_turn_ids,
            seed=request.seed if request.seed is not None else request_seed(self.settings.seed, hash_id(session.id), turn))
        try:
            result = check_result(await self.backend.generate(pending.prompt, sampling, session_id=session.id),
                                  sampling, self.vocab_size)
        except BadOutputError as bad:
            raise ApiError(502, f"the backend answered badly: {bad}", kind="server_error", code="bad_backend_output")
        except (asyncio.CancelledError, ApiError):
            raise
        except Exception as error:  # a backend failure is this call's, never the proxy's
            raise ApiError(502, f"the backend failed: {type(error).__name__}: {error}", kind="server_error",
                           code="backend_error") from None
        tool_format = formatter.tool_format or tool_format_for_template(formatter.template_text)
        parse = tool_format.parser_for(request.tools) if request.tools and request.parse_tools else None
        content, calls, finish = session.commit(pending, result, self.tokenizer, parse)
        return Completion(content, calls, finish, result.token_ids, result.logprobs, pending.prompt, session.id)


def hash_id(session_id: str) -> int:
    """A stable integer for a session id (request_seed's episode index)."""
    return zlib.crc32(session_id.encode("utf-8"))
