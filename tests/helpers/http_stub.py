"""A scripted OpenAI-compatible server for the HTTP backend's tests (tests/backends, tests/runners): real
aiohttp on 127.0.0.1 speaking vLLM's /v1/completions, with scripted failures and delays."""

import asyncio
import contextlib

from aiohttp import web

from agent_loop.backends.base import SamplingParams
from agent_loop.backends.vllm_server import free_port

MODEL = "stub-model"


def stub_completion(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The stub's deterministic 'generation': counts up from the last prompt id."""
    token_ids = [prompt_ids[-1] + 1 + i for i in range(max_tokens)]
    return token_ids, [-0.5 - i for i in range(max_tokens)]


class StubServer:
    """A real aiohttp server on 127.0.0.1: /v1/models and /v1/completions, with scripted failures.

    fail_first: how many completion requests get `fail_status` before it answers.
    token_ids: False to answer like a server without `return_token_ids` support.
    delay_s: how long each completion takes (so requests overlap).
    """

    def __init__(self, name: str = "a", model: str = MODEL, fail_first: int = 0, fail_status: int = 503,
                 token_ids: bool = True, delay_s: float = 0.0, port: int | None = None):
        self.name, self.model, self.fail_first, self.fail_status = name, model, fail_first, fail_status
        self.token_ids, self.delay_s, self.port = token_ids, delay_s, port or free_port()
        self.requests: list[dict] = []  # every completion request body, in arrival order
        self.url = f"http://127.0.0.1:{self.port}"

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def completions(self, request):
        body = await request.json()
        self.requests.append(body)
        if len(self.requests) <= self.fail_first:
            return web.json_response({"error": "try later"}, status=self.fail_status)
        await asyncio.sleep(self.delay_s)
        token_ids, logprobs = stub_completion(body["prompt"], body["max_tokens"])
        finish = "length"
        stops = [i for i, t in enumerate(token_ids) if t in body["stop_token_ids"]]
        if stops:
            token_ids, logprobs, finish = token_ids[: stops[0] + 1], logprobs[: stops[0] + 1], "stop"
        choice = {"index": 0, "text": "", "finish_reason": finish, "logprobs": {"token_logprobs": logprobs}}
        if self.token_ids:
            choice["token_ids"] = token_ids
        return web.json_response({"model": self.model, "choices": [choice]})

    @contextlib.asynccontextmanager
    async def running(self):
        app = web.Application()
        app.add_routes([web.get("/v1/models", self.models), web.post("/v1/completions", self.completions)])
        runner = web.AppRunner(app, shutdown_timeout=0.5)  # handlers that hang are not waited for at the end
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        try:
            yield self
        finally:
            await runner.cleanup()


def sampling(max_tokens=4, stop_token_ids=(), seed=None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, top_k=20,
                          stop_token_ids=list(stop_token_ids), seed=seed)
