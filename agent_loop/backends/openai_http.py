"""OpenAI-compatible HTTP backend: token ids in, sampled token ids and logprobs out, over one or more servers.

Talks to vLLM's `/v1/completions` with a token-id prompt and `return_token_ids` (vLLM >= 0.10.2),
so the loop stays token-in/token-out (docs/design.md sections 4 and 6): nothing is decoded and
re-encoded on the way. One pooled `aiohttp.ClientSession`; a clear error on a model-name mismatch
(checked against `/v1/models`) or on a server that does not return token ids.

Several servers, health-aware: requests that carry the same `session_id` (one trajectory) go to the
server that served its first turn, so that server's prefix cache holds the conversation so far; a
new session, or a request without one, goes to the live server with the fewest requests in flight.
A server that refuses connections, times out or stalls is marked down: its sessions move to a live
server (each request carries the whole conversation's tokens, so nothing is lost but the cache),
and it is probed (`/v1/models`) every `probe_interval_s` until it answers again.

Faults: each request retries transient failures (connection errors, timeouts, stalls, HTTP 5xx and
429, a 200 answer whose body is not JSON or has no `choices`) with capped exponential backoff, on
another live server where there is one. `retry_deadline_s` (default 300 s: longer than a server
restart) bounds the whole wait of one request, its attempts and backoff together (an answer that never
comes on a server that still answers probes ends there too); `timeout_s` (600 s) bounds one attempt. This is the only layer of retries
(`retries_itself`: the agent loop does not retry on top). A request with no answer for
`stall_timeout_s` whose server does not answer a probe either is logged, cancelled and retried
elsewhere. When every server has been down for longer than `retry_deadline_s`, requests raise
:class:`ServersUnavailableError` (``fatal``): the runner stops the run instead of writing thousands
of error episodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import aiohttp

from agent_loop.backends.base import Backend, BackendSettings, FatalBackendError, GenerationResult, SamplingParams
from agent_loop.backends.retry import backoff_delay

TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
log = logging.getLogger(__name__)


class HTTPBackendError(RuntimeError):
    """A server answered, but not with something this backend can use (or it kept failing)."""


class ServersUnavailableError(HTTPBackendError, FatalBackendError):
    """Every server has been down for longer than the retry deadline: the run should stop."""


class _TransientError(Exception):
    """A failure worth retrying: the server may be starting, overloaded or restarting."""


class _Stalled(Exception):
    """A request got no answer for `stall_timeout_s` and its server does not answer a probe either."""


# failures after which a server is marked down (HTTP 5xx/429 only slow it down: the server is there)
_DOWN_ERRORS = (aiohttp.ClientConnectionError, asyncio.TimeoutError, _Stalled)
_RETRYABLE = (_TransientError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, _Stalled)


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    down_since: float | None = None  # monotonic time it was marked down; None while up
    next_probe: float = 0.0
    probing: bool = False
    max_model_len: int | None = None  # as /v1/models says (vLLM lists it)

    @property
    def up(self) -> bool:
        return self.down_since is None


async def _read_json(response: aiohttp.ClientResponse, url: str) -> dict:
    """The JSON object a server answered; _TransientError for HTTP 5xx/429 and for a 200 whose body is not one
    (worth another try), HTTPBackendError for any other refusal."""
    if response.status in TRANSIENT_STATUS:
        raise _TransientError(f"HTTP {response.status}: {(await response.text())[:500]}")
    if response.status != 200:
        raise HTTPBackendError(f"{url} rejected the request: HTTP {response.status}: {(await response.text())[:2000]}")
    text = await response.text()
    try:  # a 200 with a cut or garbled body: a proxy or a server in trouble; worth another try
        body = json.loads(text)
    except ValueError as error:
        raise _TransientError(f"{url} answered HTTP 200 with a body that is not JSON ({error}; "
                              f"{len(text)} characters: {text[:200]!r})") from None
    if not isinstance(body, dict):
        raise _TransientError(f"{url} answered HTTP 200 with JSON that is not an object: {text[:200]!r}")
    return body


async def _served_models(http: aiohttp.ClientSession, server: _Server, timeout: aiohttp.ClientTimeout) -> list[str]:
    """The model names ``server`` lists in ``/v1/models``; records its ``max_model_len`` when it lists one."""
    url = f"{server.url}/v1/models"
    async with http.get(url, timeout=timeout) as response:
        body = await _read_json(response, url)
    entries = [entry for entry in body.get("data") or [] if isinstance(entry, dict) and "id" in entry]
    lengths = [e["max_model_len"] for e in entries if isinstance(e.get("max_model_len"), int) and e["max_model_len"] > 0]
    if lengths:
        server.max_model_len = min(lengths)
    return [entry["id"] for entry in entries]


async def _answers(http: aiohttp.ClientSession, server: _Server, timeout: aiohttp.ClientTimeout) -> bool:
    """Whether ``server`` answers a probe (``/v1/models``) within ``timeout``."""
    try:
        await _served_models(http, server, timeout)
        return True
    except (_RETRYABLE + (aiohttp.ClientError,)):
        return False


async def _complete(http: aiohttp.ClientSession, server: _Server, payload: dict) -> GenerationResult:
    """One ``/v1/completions`` request to ``server``, its answer checked: token ids, one logprob each, a finish."""
    url = f"{server.url}/v1/completions"
    async with http.post(url, json=payload) as response:
        body = await _read_json(response, url)
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _TransientError(f"{url} answered HTTP 200 without a completion ('choices' is {choices!r:.100}; "
                              f"keys {sorted(body)[:10]})")
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise HTTPBackendError(
            f"{url} returned no token ids: the server must support `return_token_ids` on /v1/completions "
            "(vLLM >= 0.10.2) so that sampled tokens are not re-tokenized"
        )
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if logprobs is None or len(logprobs) != len(token_ids):
        raise HTTPBackendError(f"{url} returned no per-token logprobs for the {len(token_ids)} sampled tokens")
    finish_reason = choice.get("finish_reason")
    if finish_reason not in ("stop", "length"):
        raise HTTPBackendError(f"{url} returned finish_reason={finish_reason!r}")
    return GenerationResult(list(token_ids), [float(lp) for lp in logprobs], finish_reason)


class _ServerPool:
    """Which server takes each request, and which servers are up.

    A session (one trajectory) stays on the server that served its first turn while that server is up (the
    ``max_sessions`` most recently used are remembered); a new session, or a request without one, goes to the
    live server with the fewest requests in flight. A server marked down is probed (``/v1/models``) every
    ``probe_interval_s`` until it serves the model again. ``all_down_since``: the monotonic time the last live
    server went down (None while one is up), the circuit breaker's clock.
    """

    def __init__(self, servers: list[_Server], *, probe_interval_s: float, max_sessions: int):
        self.servers = servers
        self.probe_interval_s = probe_interval_s
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, _Server] = OrderedDict()  # least recently used first
        self.all_down_since: float | None = None
        self.probes: set[asyncio.Task] = set()

    def route(self, session_id: str | None, avoid: _Server | None = None) -> _Server | None:
        """The session's server while it is up (unless it is ``avoid`` and another is up), else the least busy
        live one but ``avoid`` (which the session moves to); None when none is up."""
        if session_id is not None and session_id in self.sessions:
            pinned = self.sessions[session_id]
            if pinned.up and (pinned is not avoid or not any(s.up for s in self.servers if s is not pinned)):
                self.sessions.move_to_end(session_id)
                return pinned
        live = [s for s in self.servers if s.up]
        if not live:
            return None
        if avoid is not None and len(live) > 1:
            live = [s for s in live if s is not avoid]
        server = min(live, key=lambda s: s.in_flight)
        if session_id is not None:
            self.sessions[session_id] = server  # a session moves with its tokens: each request carries them all
            self.sessions.move_to_end(session_id)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return server

    def mark_down(self, server: _Server, error: BaseException) -> None:
        if not server.up:
            return
        now = time.monotonic()
        server.down_since, server.next_probe = now, now + self.probe_interval_s
        live = sum(s.up for s in self.servers)
        log.warning("%s marked down (%s: %s); %d of %d servers up", server.url, type(error).__name__, error,
                    live, len(self.servers))
        if live == 0 and self.all_down_since is None:
            self.all_down_since = now

    def mark_up(self, server: _Server) -> None:
        if server.up:
            return
        log.warning("%s is back up after %.0f s", server.url, time.monotonic() - server.down_since)
        server.down_since = None
        self.all_down_since = None

    def probe_due(self, http: aiohttp.ClientSession | None, model: str, timeout: aiohttp.ClientTimeout) -> None:
        """Start a probe (in the background, over ``http``: none while it is None) of every down server whose next
        probe is due: it is marked up if it serves ``model``."""
        now = time.monotonic()
        for server in self.servers:
            if not server.up and not server.probing and now >= server.next_probe and http is not None:
                server.probing = True
                probe = asyncio.ensure_future(self._probe(http, server, model, timeout))
                self.probes.add(probe)
                probe.add_done_callback(self.probes.discard)

    async def _probe(self, http: aiohttp.ClientSession, server: _Server, model: str,
                     timeout: aiohttp.ClientTimeout) -> None:
        try:
            served = await _served_models(http, server, timeout)
            if model in served:
                self.mark_up(server)
            else:
                log.warning("%s answers but serves %s, not %r: kept down", server.url, served, model)
        except (_RETRYABLE + (aiohttp.ClientError,)):
            pass
        finally:
            server.probing = False
            server.next_probe = time.monotonic() + self.probe_interval_s

    def stop_probes(self) -> None:
        for probe in list(self.probes):
            probe.cancel()


class OpenAIHTTPBackend(Backend):
    """`Backend` over OpenAI-compatible completion servers (vLLM `api_server`).

    base_urls: server roots such as "http://127.0.0.1:8000" (without `/v1`).
    model: the served model name; every server must list it in `/v1/models`.
    timeout_s: limit for one attempt (a whole generation); connect_timeout_s: for opening a connection.
    retry_deadline_s: the whole wait of one request: its attempts, their backoff and the wait for a live
    server (while every server is down, the circuit breaker below decides instead).
    max_retries: at most this many extra attempts (None: as many as fit in the deadline).
    backoff_s, max_backoff_s: wait backoff_s * 2**attempt, at most max_backoff_s, between attempts.
    stall_timeout_s: after this long without an answer the server is probed; no answer: retry elsewhere.
    probe_interval_s: how often a down server is probed.
    max_sessions: how many trajectory-to-server assignments to remember (oldest forgotten first).

    The connection pool belongs to one event loop: `generate` opens it (and checks the servers) on first
    use in a loop, `end_run()` closes it (the runners call it when a run ends); `async with` does both.
    """

    retries_itself = True  # the agent loop adds no retries of its own

    def __init__(
        self,
        base_urls: list[str] | str,
        model: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retry_deadline_s: float = 300.0,
        max_retries: int | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        stall_timeout_s: float = 60.0,
        probe_interval_s: float = 2.0,
        max_connections: int = 1024,
        max_sessions: int = 100_000,
    ):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("OpenAIHTTPBackend needs at least one server URL")
        for name, value in (("timeout_s", timeout_s), ("retry_deadline_s", retry_deadline_s),
                            ("stall_timeout_s", stall_timeout_s), ("probe_interval_s", probe_interval_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.servers = [_Server(url.rstrip("/")) for url in urls]
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self.probe_timeout = aiohttp.ClientTimeout(total=min(10.0, stall_timeout_s), connect=min(5.0, connect_timeout_s))
        self.retry_deadline_s = retry_deadline_s
        self.max_retries = max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.stall_timeout_s, self.probe_interval_s = stall_timeout_s, probe_interval_s
        self.max_connections = max_connections
        self.max_sessions = max_sessions
        self._pool = _ServerPool(self.servers, probe_interval_s=probe_interval_s, max_sessions=max_sessions)
        self._http: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock: asyncio.Lock | None = None

    # --- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the connection pool and check that the servers serve `model`; idempotent per event loop.

        A server that cannot be reached is marked down (and probed later) as long as another one
        answers; while none answers it retries, and raises HTTPBackendError after the retry deadline.
        """
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (e.g. another asyncio.run): the old pool is unusable
            self._http, self._loop, self._start_lock = None, loop, asyncio.Lock()
        async with self._start_lock:
            if self._http is not None:
                return
            http = aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(limit=self.max_connections))
            try:
                await self._check_servers(http)
            except BaseException:
                await http.close()
                raise
            self._http = http

    async def end_run(self) -> None:
        """Close the connection pool and stop the probes (the next `generate` reopens them)."""
        self._pool.stop_probes()
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> "OpenAIHTTPBackend":
        await self.start()
        return self

    @classmethod
    def from_settings(cls, model, settings: BackendSettings) -> "OpenAIHTTPBackend":
        if not settings.servers:
            raise ValueError("the http backend needs at least one server URL")
        return cls(settings.servers, settings.served_model_name or str(model), retry_deadline_s=settings.retry_deadline_s,
                   timeout_s=settings.request_timeout_s)

    @property
    def context_length(self) -> int | None:
        """The smallest ``max_model_len`` the servers list in /v1/models (known once they were asked)."""
        known = [s.max_model_len for s in self.servers if s.max_model_len]
        return min(known) if known else None

    def describe(self, session_id: str | None = None) -> str:
        """The server that serves ``session_id`` (the one its last request went to)."""
        server = self._pool.sessions.get(session_id) if session_id is not None else None
        return f"server {server.url}" if server is not None else "server " + ", ".join(s.url for s in self.servers)

    # --- generation ----------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        """Generate one continuation; `session_id` (e.g. the trajectory's key) keeps all its turns on one live server."""
        if self._http is None or self._loop is not asyncio.get_running_loop():
            await self.start()
        payload = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": sampling.seed,
            "stop_token_ids": list(sampling.stop_token_ids),
            # Stop only on the requested tokens, and override any server-side generation_config defaults.
            "ignore_eos": True,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logprobs": 0,  # the sampled token's logprob only
            "return_token_ids": True,
        }
        started = time.monotonic()
        deadline = started + self.retry_deadline_s
        attempt, avoid, last_error = 0, None, None
        while True:
            server = await self._live_server(session_id, avoid, deadline, last_error)
            try:
                return await self._attempt_within(server, payload, deadline, started, attempt)
            except _RETRYABLE as error:
                last_error = error
                if isinstance(error, _DOWN_ERRORS):
                    self._pool.mark_down(server, error)
                avoid = server
            attempt += 1
            delay = backoff_delay(attempt - 1, base_s=self.backoff_s, cap_s=self.max_backoff_s)
            all_down = not any(s.up for s in self.servers)  # then the circuit breaker decides, not this request
            if (self.max_retries is not None and attempt > self.max_retries) or (
                    not all_down and time.monotonic() + delay > deadline):
                raise HTTPBackendError(
                    f"{server.url}: still failing after {attempt} attempts over {time.monotonic() - started:.1f} s: "
                    f"{type(last_error).__name__}: {last_error}") from last_error
            await asyncio.sleep(delay)

    async def _attempt_within(self, server: _Server, payload: dict, deadline: float, started: float,
                              attempt: int) -> GenerationResult:
        """One attempt, given up at the request's deadline (HTTPBackendError naming the server: no retry is left)."""
        server.in_flight += 1  # counted now, before the next request is routed
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await self._attempt(server, payload)
        except asyncio.TimeoutError:
            if time.monotonic() < deadline:
                raise  # the attempt's own timeout (timeout_s): retried like any other
        finally:
            server.in_flight -= 1
        raise HTTPBackendError(
            f"{server.url}: no answer within the {self.retry_deadline_s:g} s retry deadline (attempt {attempt + 1}, "
            f"{time.monotonic() - started:.1f} s since the first)")

    async def _attempt(self, server: _Server, payload: dict) -> GenerationResult:
        """One request, watched: with no answer for `stall_timeout_s`, a probe decides whether to keep waiting."""
        request = asyncio.ensure_future(_complete(self._http, server, payload))
        try:
            while True:
                done, _ = await asyncio.wait({request}, timeout=self.stall_timeout_s)
                if done:
                    return request.result()
                if not await _answers(self._http, server, self.probe_timeout):
                    log.warning("%s: no answer for %.0f s and no answer to a probe: stalled; retrying elsewhere",
                                server.url, self.stall_timeout_s)
                    raise _Stalled(f"no answer for {self.stall_timeout_s:g} s and none to a probe")
        finally:
            if not request.done():
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)

    # --- routing and health ----------------------------------------------------------------------------

    async def _live_server(self, session_id: str | None, avoid: _Server | None, deadline: float,
                           last_error: BaseException | None) -> _Server:
        """The server for this request: the session's own while it is up, else the least busy live one.

        With none up, waits (probing) until one answers or `deadline`; raises ServersUnavailableError when
        every server has been down for longer than the retry deadline.
        """
        while True:
            self._pool.probe_due(self._http, self.model, self.probe_timeout)
            server = self._pool.route(session_id, avoid)
            if server is not None:
                return server
            now = time.monotonic()
            all_down_since = self._pool.all_down_since
            if all_down_since is not None and now - all_down_since >= self.retry_deadline_s:
                raise ServersUnavailableError(
                    f"all {len(self.servers)} servers down for {now - all_down_since:.0f} s "
                    f"(longer than the {self.retry_deadline_s:g} s retry deadline): "
                    + ", ".join(s.url for s in self.servers)
                    + (f"; last error {type(last_error).__name__}: {last_error}" if last_error else ""))
            if now >= deadline and all_down_since is None:
                raise HTTPBackendError(f"no live server within the {self.retry_deadline_s:g} s retry deadline")
            # every server down: wait for one to come back, or for the circuit breaker to stop the run
            await asyncio.sleep(self.probe_interval_s / 4)

    async def _check_servers(self, http: aiohttp.ClientSession) -> None:
        """Ask every server for its models at once; retry (backoff, deadline) only while none answers.

        Servers that do not answer are marked down when another does; one serving another model is a ValueError.
        """
        deadline = time.monotonic() + self.retry_deadline_s
        attempt = 0
        while True:
            outcomes = await asyncio.gather(*(_served_models(http, s, self.probe_timeout) for s in self.servers),
                                            return_exceptions=True)
            for server, served in zip(self.servers, outcomes):
                if isinstance(served, list) and self.model not in served:
                    raise ValueError(f"model mismatch: {server.url} serves {served}, not {self.model!r}")
                if isinstance(served, BaseException) and not isinstance(served, _RETRYABLE + (aiohttp.ClientError,)):
                    raise served
            failed = [(s, o) for s, o in zip(self.servers, outcomes) if isinstance(o, BaseException)]
            if len(failed) < len(self.servers):
                for server, error in failed:
                    self._pool.mark_down(server, error)
                return
            server, error = failed[0]
            attempt += 1
            delay = backoff_delay(attempt - 1, base_s=self.backoff_s, cap_s=self.max_backoff_s)
            if (self.max_retries is not None and attempt > self.max_retries) or time.monotonic() + delay > deadline:
                raise ServersUnavailableError(  # no server ever answered: the run cannot go on
                    f"no server answered ({len(self.servers)} tried, {server.url} still failing after {attempt} "
                    f"attempts): {type(error).__name__}: {error}") from error
            await asyncio.sleep(delay)
