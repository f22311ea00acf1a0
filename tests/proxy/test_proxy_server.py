"""agent-loop's recording proxy on 127.0.0.1 in front of the tiny agent (transformers, in process), driven by the
real ``openai`` client and raw HTTP: the same conversation as our loop token for token, streaming, logprobs,
sessions, history rewrites, every refusal, disconnects, idle sessions and 200 concurrent sessions."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from openai import AsyncOpenAI
from proxy_helpers import DelayedBackend, openai_tools_agent, serving

from agent_loop.backends.hf import TransformersBackend
from agent_loop.episode.loop import formatter_for, run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.proxy.agents import episode_row, stream_agent_rollouts
from agent_loop.runners.spec import RunSpec
from agent_loop.tasks.registry import get_task
from masking.kinds import SpanKind

pytestmark = pytest.mark.integration
A, O = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION)


@pytest.fixture(scope="module")
def backend(tiny_agent_dir):
    with TransformersBackend(str(tiny_agent_dir)) as backend:
        yield backend


def _client(server, session_id: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                       default_headers={"X-Session-Id": session_id})


def test_same_conversation_through_our_loop_and_the_proxy(backend, tiny_tokenizer):
    """Greedy, one at a time: the openai-client agent through the proxy records exactly what our loop plays."""
    task, config = get_task("arithmetic"), LoopConfig(temperature=0.0, max_turns=4)

    async def both():
        ours = [await run_episode(task, i, backend, tiny_tokenizer, config, seed=3) for i in range(4)]
        spec = RunSpec(task, tiny_tokenizer, range(4), config, 3, None, progress=False)
        _, theirs = await stream_agent_rollouts(spec, backend, openai_tools_agent.agent, concurrency=1, keep=True)
        return ours, sorted(theirs, key=lambda t: t.info["index"])

    ours, theirs = asyncio.run(both())
    assert len(theirs) == 4 and sum(t.metrics["tool_calls"] for t in ours) >= 3  # the episodes use the calculator
    for a, b in zip(ours, theirs):
        b.check()
        assert (b.prompt_ids, b.response_ids, b.spans, b.turn_ids) == (a.prompt_ids, a.response_ids, a.spans, a.turn_ids)
        assert b.messages == a.messages and b.reward == a.reward and b.finish_reason == a.finish_reason
        assert [(r.name, r.arguments, r.result, r.call_id) for r in b.tool_calls] == \
            [(r.name, r.arguments, r.result, r.call_id) for r in a.tool_calls]
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert b.metrics["template_exact"] and b.metrics["proxy"]["rewrites"] == 0


def test_streaming_logprobs_and_token_ids(backend, tiny_tokenizer):
    row = episode_row(get_task("arithmetic"), 0, 0)
    written = []

    async def play():
        async with serving(backend, tiny_tokenizer, written=written, temperature=0.0) as server:
            client = _client(server, "s1")
            plain = await client.chat.completions.create(model="policy", messages=row["messages"], tools=row["tools"],
                                                         logprobs=True, extra_body={"return_token_ids": True})
            stream = await client.chat.completions.create(model="policy", messages=row["messages"], tools=row["tools"],
                                                          stream=True, stream_options={"include_usage": True},
                                                          extra_headers={"X-Session-Id": "s2"})
            chunks = [c async for c in stream]
            for sid in ("s1", "s2"):
                async with aiohttp.ClientSession() as http:
                    async with http.post(f"{server.base_url}/sessions/{sid}/end") as r:
                        assert r.status == 200
            await client.close()
            return plain, chunks

    plain, chunks = asyncio.run(play())
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "calculator"
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    assert set(args) == {"expression"}
    by_session = {t.info["session_id"]: t for t in written}
    recorded = by_session["s1"]
    assert choice.model_extra["token_ids"] == recorded.response_ids  # all ASSISTANT: one call, no observation
    assert set(recorded.spans) == {A} and plain.model_extra["prompt_token_ids"] == recorded.prompt_ids
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(recorded.logprobs)
    assert plain.usage.completion_tokens == len(recorded.response_ids)
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("calculator", args)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(by_session["s2"].response_ids)
    assert by_session["s2"].response_ids == recorded.response_ids  # greedy: the same turn


async def _post(http, url, body=None, raw: bytes | None = None, **headers):
    data = raw if raw is not None else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as r:
        return r.status, await r.json()


def test_every_refusal_is_an_openai_error_and_the_proxy_goes_on(backend, tiny_tokenizer):
    good = {"model": "policy", "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 4}
    session = {"X-Session-Id": "e"}
    cases = [  # (body or raw bytes, headers, status, code)
        (b"{not json", session, 400, "invalid_json"),
        ({**good, "model": "gpt-4o"}, session, 404, "model_not_found"),
        ({**good, "n": 2}, session, 400, "unsupported_parameter"),
        ({**good, "stop": ["\n"]}, session, 400, "unsupported_parameter"),
        ({**good, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         session, 400, "unsupported_content"),
        (good, {}, 400, "missing_session_id"),
        ({**good, "messages": [{"role": "user", "content": "seven " * 5000}]}, session, 400, "context_length_exceeded"),
    ]

    async def play():
        async with serving(backend, tiny_tokenizer) as server, aiohttp.ClientSession() as http:
            url = f"{server.base_url}/chat/completions"
            for body, headers, status, code in cases:
                raw = body if isinstance(body, bytes) else None
                got_status, got = await _post(http, url, None if raw else body, raw, **headers)
                assert (got_status, got["error"]["code"]) == (status, code), got
                assert got["error"]["message"] and "\n" not in got["error"]["message"]
            status, _ = await _post(http, url, good, **{"X-Session-Id": "ok"})
            assert status == 200  # nothing above broke the proxy, nor left session "e" half-changed
            assert not server.proxy.sessions["e"].segments
            reward = f"{server.base_url}/sessions/ok/reward"
            assert (await _post(http, reward, {"reward": 1.5}))[0] == 200
            status, got = await _post(http, reward, {"reward": 2})
            assert (status, got["error"]["code"]) == (409, "reward_already_set")
            status, got = await _post(http, f"{server.base_url}/sessions/nobody/reward", {"reward": 1})
            assert (status, got["error"]["code"]) == (404, "session_not_found")
            assert (await _post(http, f"{server.base_url}/sessions/ok/end", {}))[0] == 200
            status, got = await _post(http, f"{server.base_url}/sessions/ok/end", {})
            assert (status, got["error"]["code"]) == (409, "session_ended")
            status, got = await _post(http, url, good, **{"X-Session-Id": "ok"})
            assert (status, got["error"]["code"]) == (409, "session_ended")

    asyncio.run(play())


def test_api_key_is_checked(backend, tiny_tokenizer):
    async def play():
        async with serving(backend, tiny_tokenizer, api_key="k3y") as server:
            bad = AsyncOpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
            with pytest.raises(Exception) as refused:
                await bad.models.list()
            assert getattr(refused.value, "status_code", None) == 401
            good = AsyncOpenAI(base_url=server.base_url, api_key="k3y", max_retries=0)
            assert [m.id for m in (await good.models.list()).data] == ["policy"]
            await bad.close()
            await good.close()

    asyncio.run(play())


def test_concurrent_calls_in_one_session_are_refused_and_a_disconnect_cancels(backend, tiny_tokenizer):
    slow = DelayedBackend(backend, delay_s=1.0)
    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 4}

    async def play():
        async with serving(slow, tiny_tokenizer) as server, aiohttp.ClientSession() as http:
            url = f"{server.base_url}/chat/completions"
            first, second = await asyncio.gather(_post(http, url, body, **{"X-Session-Id": "s"}),
                                                 _post(http, url, body, **{"X-Session-Id": "s"}))
            statuses = sorted([first[0], second[0]])
            assert statuses == [200, 409]
            assert next(b for s, b in (first, second) if s == 409)["error"]["code"] == "session_busy"
            assert server.proxy.sessions["s"].counts["calls"] == 1
            # a client that hangs up mid-generation: the call is cancelled, the session keeps what was complete
            timeout = aiohttp.ClientTimeout(total=0.3)
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(url, json=body, headers={"X-Session-Id": "s"}, timeout=timeout):
                    pass
            for _ in range(40):
                if slow.cancelled:
                    break
                await asyncio.sleep(0.1)
            assert slow.cancelled == 1 and server.proxy.sessions["s"].counts["calls"] == 1
            assert (await _post(http, url, body, **{"X-Session-Id": "s"}))[0] == 200  # and it goes on

    asyncio.run(play())


def test_idle_sessions_are_closed_written_and_counted(backend, tiny_tokenizer):
    written = []
    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 3}

    async def play():
        async with serving(backend, tiny_tokenizer, written=written, idle_timeout_s=0.3) as server, \
                aiohttp.ClientSession() as http:
            assert (await _post(http, f"{server.base_url}/chat/completions", body, **{"X-Session-Id": "idle"}))[0] == 200
            for _ in range(50):
                if not server.proxy.sessions:
                    break
                await asyncio.sleep(0.1)
            return dict(server.proxy.counts)

    counts = asyncio.run(play())
    assert counts["closed_idle"] == 1 and not counts.get("closed_end")
    assert [t.metrics["proxy"]["closed_by"] for t in written] == ["idle"]


def test_200_concurrent_sessions_with_memory_bounded_by_the_open_ones(backend, tiny_tokenizer):
    written = []

    async def play():
        async with serving(backend, tiny_tokenizer, written=written, max_sessions=200, max_tokens=2) as server:
            client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

            async def one(i):
                return await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": f"What is {i}+1?"}],
                    extra_headers={"X-Session-Id": f"c{i}"})

            answers = await asyncio.gather(*(one(i) for i in range(200)))
            assert len(server.proxy.sessions) == 200 and all(a.choices[0].finish_reason for a in answers)
            with pytest.raises(Exception) as full:
                await one(200)
            assert getattr(full.value, "status_code", None) == 503
            for i in range(200):
                server.proxy.end(f"c{i}")
            await client.close()
            return len(server.proxy.sessions)

    left = asyncio.run(play())
    assert left == 0 and len(written) == 200  # ended sessions are handed on and dropped from memory
    assert sorted(t.info["session_id"] for t in written) == sorted(f"c{i}" for i in range(200))


async def _summarising_agent(client: AsyncOpenAI, row: dict) -> list[dict]:
    """An agent that rewrites its history: after the tool answers, it replaces the call and its result by a
    user message saying what the tool said (as context-compressing agents do), then asks again."""
    messages = list(row["messages"])
    first = (await client.chat.completions.create(model="policy", messages=messages, tools=row["tools"])).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    result = openai_tools_agent.run_tools  # the agent's own tool runner
    tools = {fn.__name__: fn for fn in row["episode"].tools}
    answer = (await result(tools, [call]))[0]["content"]
    messages = messages + [{"role": "user", "content": f"The calculator says {answer}."}]
    await client.chat.completions.create(model="policy", messages=messages, tools=row["tools"])
    return messages


def test_a_history_rewriting_agent_starts_a_new_segment_and_is_counted(backend, tiny_tokenizer):
    written, task = [], get_task("arithmetic")
    row = episode_row(task, 1, 0)

    async def play():
        async with serving(backend, tiny_tokenizer, written=written, temperature=0.0) as server:
            client = _client(server, "rw")
            messages = await _summarising_agent(client, row)
            server.proxy.end("rw")
            await client.close()
            return messages, dict(server.proxy.counts)

    messages, counts = asyncio.run(play())
    assert counts["rewrites"] == 1 and len(written) == 2
    first, second = written
    for t in written:
        t.check()
        assert t.metrics["proxy"]["segments"] == 2 and t.metrics["proxy"]["rewrites"] == 1
    assert first.finish_reason == "history_rewrite" and set(first.spans) == {A}  # the tool result was never seen
    formatter = formatter_for(tiny_tokenizer, row["tools"], "keep_seen")
    assert second.prompt_ids == formatter.prompt(messages)[0]  # a fresh render of the rewritten chat
    assert set(second.spans) == {A} and second.info["segment"] == 1
    assert second.messages[:-1] == messages
