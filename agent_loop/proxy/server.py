"""The proxy's HTTP face (aiohttp, as our http backend and its test servers use): ``/v1/chat/completions``
(plain and streamed), ``/v1/models``, ``/v1/sessions/{id}/reward`` and ``/v1/sessions/{id}/end``.

Session id of a call, first found wins: the ``X-Session-Id`` header; the API key (``Authorization: Bearer
ID``, when the proxy has no ``api_key`` of its own); the body's ``user``; its ``metadata.session_id``.
Every refusal is an OpenAI-style error body; a handler's failure is that call's 500, never the proxy's end.
A client that disconnects mid-generation cancels its call (aiohttp's handler cancellation): the session keeps
what was complete before it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from aiohttp import web

from agent_loop.proxy.core import Completion, Proxy
from agent_loop.proxy.wire import (
    ApiError,
    ChatRequest,
    completion_body,
    logprobs_block,
    parse_request,
    stream_chunks,
    wire_message,
)

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 << 20


def _error(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


def session_id_of(request: web.Request, chat: ChatRequest | None, api_key: str | None) -> str | None:
    """The call's session id by the documented order, or None."""
    header = request.headers.get("X-Session-Id", "").strip()
    if header:
        return header
    bearer = request.headers.get("Authorization", "")
    if api_key is None and bearer.startswith("Bearer ") and bearer[7:].strip():
        return bearer[7:].strip()
    if chat is not None and chat.user:
        return chat.user
    value = chat.metadata.get("session_id") if chat is not None else None
    return str(value) if value else None


def api_key_guard(api_key: str | None):
    """The server's middleware: ``api_key`` (when set) checked first, then the handler; any refusal or failure
    becomes an OpenAI-style error body (a handler's bug is that call's 500, logged)."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if api_key is not None and request.headers.get("Authorization", "") != f"Bearer {api_key}":
            return _error(ApiError(401, "invalid API key (send Authorization: Bearer KEY)", kind="authentication_error",
                                   code="invalid_api_key"))
        try:
            return await handler(request)
        except ApiError as error:
            return _error(error)
        except web.HTTPException as error:
            return _error(ApiError(error.status, error.reason or "bad request"))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as error:  # one call's bug: its 500, logged; never the proxy's end
            log.exception("proxy handler failed")
            return _error(ApiError(500, f"{type(error).__name__}: {error}", kind="server_error", code="internal_error"))
    return guard


async def close_idle_sessions(proxy: Proxy, every_s: float) -> None:
    """Every ``every_s`` seconds, end the proxy's idle sessions, until cancelled; a failed write is logged."""
    while True:
        await asyncio.sleep(every_s)
        try:
            proxy.close_idle()
        except Exception:  # a write that fails is logged; the proxy goes on
            log.exception("closing idle sessions failed")


async def read_json(request: web.Request):
    """The request's JSON body (``None`` when empty); a body that is not JSON is a 400."""
    try:
        return json.loads(await request.read() or b"null")
    except ValueError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None


def usage(done: Completion) -> dict:
    """The completion's OpenAI ``usage`` block."""
    return {"prompt_tokens": len(done.prompt_ids), "completion_tokens": len(done.token_ids),
            "total_tokens": len(done.prompt_ids) + len(done.token_ids)}


def completion_json(chat: ChatRequest, done: Completion, request_id: str, tokenizer) -> dict:
    """The body of a plain (not streamed) ``/v1/chat/completions`` response: the message, usage, and the
    logprobs and token ids when the request asked for them."""
    logprobs = logprobs_block(tokenizer, done.token_ids, done.logprobs) if chat.logprobs else None
    ids = {"prompt": done.prompt_ids, "completion": done.token_ids} if chat.return_token_ids else None
    return completion_body(request_id=request_id, model=chat.model, message=wire_message(done.content, done.calls),
                           finish=done.finish, usage=usage(done), logprobs=logprobs, token_ids=ids)


class ProxyServer:
    """``proxy`` served on ``host:port`` (port 0: a free one; ``base_url`` says which): its lifetime (start, stop,
    the idle-session reaper) and its route handlers."""

    def __init__(self, proxy: Proxy, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 reap_every_s: float | None = None):
        self.proxy, self.host, self.port, self.api_key = proxy, host, port, api_key
        self.reap_every_s = reap_every_s or max(0.05, min(5.0, proxy.settings.idle_timeout_s / 4))
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[api_key_guard(self.api_key)])
        app.add_routes([web.get("/v1/models", self.models), web.post("/v1/chat/completions", self.chat),
                        web.post("/v1/sessions/{id}/reward", self.reward), web.post("/v1/sessions/{id}/end", self.end),
                        web.get("/v1/sessions", self.list_sessions)])
        return app

    async def start(self) -> "ProxyServer":
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._reaper = asyncio.create_task(close_idle_sessions(self.proxy, self.reap_every_s))
        return self

    async def stop(self) -> None:
        """Stop serving and end every open session (written, ``closed_by`` shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        self.proxy.close_all()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.proxy.settings.model_name, "object": "model", "created": 0, "owned_by": "agent-loop"}]})

    async def list_sessions(self, request: web.Request) -> web.Response:
        return web.json_response({"open": list(self.proxy.sessions), "counts": dict(self.proxy.counts)})

    async def reward(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if not isinstance(body, dict) or "reward" not in body:
            raise ApiError(400, 'the body must be {"reward": NUMBER}', param="reward")
        self.proxy.set_reward(request.match_info["id"], body["reward"])
        return web.json_response({"id": request.match_info["id"], "reward": body["reward"]})

    async def end(self, request: web.Request) -> web.Response:
        body = await read_json(request) if request.can_read_body else None
        session_id = request.match_info["id"]
        if isinstance(body, dict) and "reward" in body:
            self.proxy.set_reward(session_id, body["reward"])
        written = self.proxy.end(session_id)
        return web.json_response({"id": session_id, "segments": len(written),
                                  "reward": written[0].reward if written else None})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        chat = parse_request(await read_json(request))
        session_id = session_id_of(request, chat, self.api_key)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if not chat.stream:
            done = await self.proxy.complete(chat, session_id)
            return web.json_response(completion_json(chat, done, request_id, self.proxy.tokenizer))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            done = await self.proxy.complete(chat, session_id)
        except ApiError as error:  # refused before anything was sent: a plain error response
            return _error(error)
        await response.prepare(request)
        message = wire_message(done.content, done.calls)
        logprobs = logprobs_block(self.proxy.tokenizer, done.token_ids, done.logprobs) if chat.logprobs else None
        for chunk in stream_chunks(request_id=request_id, model=chat.model, message=message, finish=done.finish,
                                   usage=usage(done) if chat.include_usage else None, logprobs=logprobs):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
