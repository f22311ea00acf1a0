"""Shared by the proxy tests: the tiny agent in process behind a real proxy server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from pathlib import Path

from agent_loop.backends.base import Backend
from agent_loop.proxy.core import Proxy, ProxySettings
from agent_loop.proxy.server import ProxyServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_AGENT = ROOT / "examples" / "agents" / "openai_tools_agent.py"


def _example_module():
    spec = importlib.util.spec_from_file_location("openai_tools_agent", EXAMPLE_AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


openai_tools_agent = _example_module()  # the hand-written openai-client agent of examples/agents


class DelayedBackend(Backend):
    """The real backend, each call started ``delay_s`` late; counts the calls cancelled while waiting or generating
    (a client that hung up)."""

    def __init__(self, inner: Backend, delay_s: float):
        self.inner, self.delay_s, self.cancelled = inner, delay_s, 0

    @property
    def context_length(self):
        return self.inner.context_length

    async def generate(self, prompt_ids, sampling, session_id=None):
        try:
            await asyncio.sleep(self.delay_s)
            return await self.inner.generate(prompt_ids, sampling, session_id)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@contextlib.asynccontextmanager
async def serving(backend, tokenizer, *, written: list | None = None, api_key: str | None = None, **settings):
    """A started ProxyServer over ``backend``; finished sessions appended to ``written``."""
    sink = written if written is not None else []
    proxy = Proxy(backend, tokenizer, ProxySettings(**settings), on_finish=sink.extend)
    async with ProxyServer(proxy, api_key=api_key) as server:
        yield server


def assert_recorded(trajectory, tokenizer) -> bool:
    """The spans of a recorded episode are right: ASSISTANT on what the model sampled (every call's completion,
    ending on a stop token unless cut), OBSERVATION on the tool results the agent sent back; returns whether the
    episode called a tool."""
    from masking.kinds import SpanKind

    trajectory.check()
    turns = sorted(set(trajectory.turn_ids))
    assert turns == list(range(trajectory.metrics["turns"]))
    for turn in turns:
        kinds = [s for s, t in zip(trajectory.spans, trajectory.turn_ids) if t == turn]
        assert kinds[0] == SpanKind.ASSISTANT and kinds == sorted(kinds)  # sampled tokens, then the observation
    assistant = [i for i, s in zip(trajectory.response_ids, trajectory.spans) if s == SpanKind.ASSISTANT]
    observation = tokenizer.decode([i for i, s in zip(trajectory.response_ids, trajectory.spans)
                                    if s == SpanKind.OBSERVATION])
    assert all(p < 0 for p, s in zip(trajectory.logprobs, trajectory.spans) if s == SpanKind.ASSISTANT) or not assistant
    results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    for result in results:  # every result the agent sent is in the observation tokens, none in the sampled ones
        assert result in observation
    assert [r.result for r in trajectory.tool_calls if r.result is not None] == results
    return bool(trajectory.tool_calls)
