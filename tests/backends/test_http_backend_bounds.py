"""The HTTP backend under faults (issue 30): every wait within its bound, and nothing
that comes back trusted unchecked.

Against real aiohttp servers on 127.0.0.1 speaking vLLM's /v1/models and /v1/completions: a completion
that never answers on a server that still answers probes ends at --retry-deadline-s; --request-timeout-s
bounds one attempt (the next one answers); a 200 with truncated JSON or without `choices` is retried and,
when it keeps coming, the error names the server; NaN logprobs and ids beyond the vocabulary end the
episode with an error naming the server and the turn; a prompt longer than the server's max_model_len is
an error before any completion is asked for, and a turn never asks for more tokens than the context has.
"""

import asyncio
import json
import time

import pytest
from aiohttp import web

from agent_loop.backends.base import BackendSettings
from agent_loop.backends.openai_http import HTTPBackendError, OpenAIHTTPBackend
from agent_loop.backends.registry import make_backend
from agent_loop.backends.vllm_server import free_port
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.tasks.registry import get_task
from tests.helpers.http_stub import StubServer

MODEL = "stub-model"


class ScriptedServer(StubServer):  # StubServer's running(): the same aiohttp app
    """A real aiohttp server on 127.0.0.1 whose k-th completion answer is ``answers[min(k, last)](body)``: a
    ``web.Response``, or a coroutine that never returns (``hang``). /v1/models lists MODEL (and
    ``max_model_len`` when given)."""

    def __init__(self, answers, max_model_len: int | None = None):
        self.answers, self.max_model_len = answers, max_model_len
        self.requests: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def models(self, request):
        entry = {"id": MODEL, "object": "model"}
        if self.max_model_len:
            entry["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [entry]})

    async def completions(self, request):
        body = await request.json()
        self.requests.append(body)
        answer = self.answers[min(len(self.requests) - 1, len(self.answers) - 1)]
        return await answer(body)


async def hang(body):
    await asyncio.sleep(3600)


def completion(token_ids=None, logprobs=None, finish="length"):
    """An answer of ``token_ids`` (default: counting up from the prompt's last id) with ``logprobs``."""
    async def answer(body):
        ids = token_ids if token_ids is not None else [body["prompt"][-1] + 1 + i for i in range(body["max_tokens"])]
        lps = logprobs if logprobs is not None else [-0.5] * len(ids)
        choice = {"index": 0, "finish_reason": finish, "token_ids": ids, "logprobs": {"token_logprobs": lps}}
        # json.dumps writes NaN as the bare word NaN, as a faulty server would
        return web.Response(text=json.dumps({"model": MODEL, "choices": [choice]}), content_type="application/json")
    return answer


def raw(text: str):
    async def answer(body):
        return web.Response(text=text, content_type="application/json")
    return answer


def sampling(max_tokens=4):
    from agent_loop.backends.base import SamplingParams

    return SamplingParams(max_tokens=max_tokens)


def test_a_completion_that_never_answers_ends_at_the_retry_deadline():
    """The probe: a completion that never answers while /v1/models still does ran 75 s into a 10 s deadline."""
    async def main():
        async with ScriptedServer([hang]).running() as server:
            backend = OpenAIHTTPBackend([server.url], MODEL, retry_deadline_s=2.0, stall_timeout_s=0.5)
            async with backend:
                started = time.monotonic()
                with pytest.raises(HTTPBackendError) as raised:
                    await backend.generate([1, 2], sampling())
                return time.monotonic() - started, str(raised.value), len(server.requests)

    elapsed, message, requests = asyncio.run(main())
    assert 1.9 <= elapsed < 2.0 + 2.0, elapsed  # the bound, plus a little
    assert message.startswith("http://127.0.0.1:") and "no answer within the 2 s retry deadline" in message
    assert requests == 1  # the server kept answering probes: one attempt, waited on until the deadline


def test_request_timeout_bounds_one_attempt_and_the_next_one_answers():
    async def main():
        async with ScriptedServer([hang, completion()]).running() as server:
            backend = OpenAIHTTPBackend([server.url], MODEL, timeout_s=1.0, retry_deadline_s=20.0, probe_interval_s=0.2)
            async with backend:  # a timed-out attempt marks its server down: the probe brings it back at once
                started = time.monotonic()
                result = await backend.generate([5], sampling(max_tokens=3))
                return time.monotonic() - started, result, len(server.requests)

    elapsed, result, requests = asyncio.run(main())
    assert result.token_ids == [6, 7, 8] and requests == 2
    assert 1.0 <= elapsed < 1.0 + 2.0, elapsed  # one 1 s attempt, a short backoff, the answer


def test_settings_come_from_the_command_options():
    class Options:  # what RolloutOptions holds
        server = ["http://127.0.0.1:9"]
        retry_deadline_s = 7.0
        request_timeout_s = 3.0
        served_model_name = None
        concurrency = 16

    settings = BackendSettings.from_options(Options())
    assert (settings.servers, settings.retry_deadline_s, settings.request_timeout_s) == (["http://127.0.0.1:9"], 7.0, 3.0)
    backend = make_backend("http", MODEL, settings)
    assert backend.timeout.total == 3.0 and backend.retry_deadline_s == 7.0


@pytest.mark.parametrize("bad", ['{"model": "stub-model", "choi', '{"model": "stub-model", "object": "text_completion"}',
                                 '{"choices": []}', "[1, 2]"])
def test_a_200_without_a_usable_completion_is_retried(bad):
    async def main():
        async with ScriptedServer([raw(bad), raw(bad), completion()]).running() as server:
            async with OpenAIHTTPBackend([server.url], MODEL, backoff_s=0.01) as backend:
                return await backend.generate([1], sampling(max_tokens=2)), len(server.requests)

    result, requests = asyncio.run(main())
    assert result.token_ids == [2, 3] and requests == 3


def test_a_200_that_stays_truncated_fails_naming_the_server():
    async def main():
        async with ScriptedServer([raw('{"choices": [{"token_ids": [1, 2')]).running() as server:
            async with OpenAIHTTPBackend([server.url], MODEL, max_retries=2, backoff_s=0.01) as backend:
                with pytest.raises(HTTPBackendError) as raised:
                    await backend.generate([1], sampling())
                return server.url, str(raised.value), len(server.requests)

    url, message, requests = asyncio.run(main())
    assert requests == 3 and message.startswith(f"{url}: still failing after 3 attempts")
    assert f"{url}/v1/completions answered HTTP 200 with a body that is not JSON" in message


# --- what comes back, through the loop ---------------------------------------------------------------------


def play(tokenizer, server, config=None, backend=None):
    async def main():
        async with server.running():
            async with (backend or OpenAIHTTPBackend([server.url], MODEL)) as http:
                return await run_episode(get_task("arithmetic"), 0, http, tokenizer, config or LoopConfig(max_turns=2))

    return asyncio.run(main())


def test_nan_logprobs_end_the_episode_naming_the_server_and_turn(qwen_tokenizer):
    server = ScriptedServer([completion(token_ids=[100, 101, 102], logprobs=[-0.1, float("nan"), -0.2])])
    trajectory = play(qwen_tokenizer, server)
    assert trajectory.finish_reason == "error" and trajectory.response_ids == []
    error = trajectory.metrics["backend_error"]
    assert error == f"BadOutputError: turn 0: server {server.url} returned logprob nan for token 1 (not a finite number <= 0)"
    assert trajectory.logprobs == []  # nothing of the bad answer is kept: the record stays strict JSON


def test_inf_and_positive_logprobs_are_refused(qwen_tokenizer):
    for bad in (float("-inf"), 3.0):
        server = ScriptedServer([completion(token_ids=[100, 101], logprobs=[-0.1, bad])])
        trajectory = play(qwen_tokenizer, server)
        assert trajectory.finish_reason == "error"
        assert f"returned logprob {bad!r} for token 1" in trajectory.metrics["backend_error"]


def test_token_ids_beyond_the_vocabulary_end_the_episode(qwen_tokenizer):
    server = ScriptedServer([completion(token_ids=[100, 1_000_000], logprobs=[-0.1, -0.2])])
    trajectory = play(qwen_tokenizer, server)
    assert trajectory.finish_reason == "error" and trajectory.response_ids == []
    assert trajectory.metrics["backend_error"] == (
        f"BadOutputError: turn 0: server {server.url} returned token id 1000000, outside the vocabulary "
        f"[0, {len(qwen_tokenizer)})")


def test_a_prompt_longer_than_max_model_len_is_an_error_before_generation(qwen_tokenizer):
    server = ScriptedServer([completion()], max_model_len=16)  # the arithmetic prompt is ~100 tokens
    trajectory = play(qwen_tokenizer, server)
    assert trajectory.finish_reason == "error" and server.requests == []
    prompt = len(trajectory.prompt_ids)
    assert trajectory.metrics["backend_error"] == (
        f"ContextLengthError: turn 0: the prompt of {prompt} tokens leaves no room in the model's context of 16 tokens")


def test_a_turn_asks_for_no_more_tokens_than_the_context_holds(qwen_tokenizer):
    probe = ScriptedServer([completion()])
    prompt = len(play(qwen_tokenizer, probe).prompt_ids)
    server = ScriptedServer([completion()], max_model_len=prompt + 5)
    trajectory = play(qwen_tokenizer, server, LoopConfig(max_turns=1, max_tokens=64))
    assert [r["max_tokens"] for r in server.requests] == [5]
    assert trajectory.finish_reason == "length" and len(trajectory.response_ids) == 5
