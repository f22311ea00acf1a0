"""Greedy rollouts on the tiny agent agree across transformers, vLLM in-process and a vLLM HTTP server.

Same episodes, same token ids, spans, turn ids, rewards and finish reasons, and logprobs within float32
noise. Where two backends pick different tokens, the first divergence must be a tie: at that point the
transformers model's two best tokens are the two picked, with near-equal logprobs (float32 kernels
differ in summation order, so an exact tie can break either way). The engine and the server run one
after the other, never together.
"""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_loop.backends.hf import TransformersBackend
from agent_loop.episode.config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.builtin import ArithmeticTask, LookupTask
from masking.spans import SpanKind

pytest.importorskip("vllm")
from agent_loop.backends.openai_http import OpenAIHTTPBackend, local_vllm_server  # noqa: E402
from agent_loop.backends.vllm_engine import VLLMEngineBackend  # noqa: E402

pytestmark = pytest.mark.integration

GREEDY = LoopConfig(temperature=0.0)
EPISODES = range(12)
TASKS = (ArithmeticTask(), LookupTask())
LOGPROB_ATOL = 2e-3
TIE_GAP = 1e-3  # top-2 logprob gap below which float32 noise may flip the argmax


async def rollouts(backend, tokenizer):
    return [
        trajectory
        for task in TASKS
        for trajectory in await run_rollouts(task, backend, tokenizer, EPISODES, GREEDY, seed=1, concurrency=12,
                                             progress=False)
    ]


@pytest.fixture(scope="module")
def hf_model(tiny_agent_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def transformers_trajectories(hf_model, tiny_tokenizer):
    return asyncio.run(rollouts(TransformersBackend(hf_model), tiny_tokenizer))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two id lists differ (including one ending first), or None if equal."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_agree_or_tie(model, expected, got) -> int:
    """Check each pair of trajectories (see the module docstring); return how many diverged at a tie."""
    ties = 0
    for e, g in zip(expected, got, strict=True):
        assert e.prompt_ids == g.prompt_ids
        where = first_divergence(e.response_ids, g.response_ids)
        end = len(e.response_ids) if where is None else where
        assert e.spans[:end] == g.spans[:end] and e.turn_ids[:end] == g.turn_ids[:end]
        torch.testing.assert_close(torch.tensor(g.logprobs[:end]), torch.tensor(e.logprobs[:end]), atol=LOGPROB_ATOL, rtol=0)
        if where is None:
            assert (g.spans, g.reward, g.finish_reason) == (e.spans, e.reward, e.finish_reason)
            continue
        episode = f"{e.info['task']} episode {e.info['index']}, response position {where}"
        assert where < min(len(e.response_ids), len(g.response_ids)), f"{episode}: one backend stopped, the other went on"
        assert e.spans[where] == g.spans[where] == SpanKind.ASSISTANT, f"{episode}: diverged outside an assistant turn"
        with torch.no_grad():
            context = torch.tensor([e.prompt_ids + e.response_ids[:where]])
            logprobs = torch.log_softmax(model(context).logits[0, -1].float(), -1)
        best = logprobs.topk(2)
        assert {e.response_ids[where], g.response_ids[where]} == set(best.indices.tolist()), f"{episode}: not the top 2"
        gap = float(best.values[0] - best.values[1])
        assert gap < TIE_GAP, f"{episode}: the backends disagree with a top-2 logprob gap of {gap:.2e}, not a tie"
        ties += 1
    return ties


def test_the_episodes_exercise_tools(transformers_trajectories):
    trajectories = transformers_trajectories
    assert sum(t.metrics["tool_calls"] for t in trajectories) >= len(EPISODES)
    assert any(t.metrics["turns"] >= 2 and any(c.error_kind is None for c in t.tool_calls) for t in trajectories)


def test_vllm_engine_agrees_with_transformers(tiny_agent_dir, tiny_tokenizer, hf_model, transformers_trajectories):
    with VLLMEngineBackend(tiny_agent_dir, seed=0) as engine:
        got = asyncio.run(rollouts(engine, tiny_tokenizer))
    ties = assert_agree_or_tie(hf_model, transformers_trajectories, got)
    assert ties <= len(got) // 4  # ties are rare; many would point at a real difference


def test_vllm_http_server_agrees_with_transformers(tiny_agent_dir, tiny_tokenizer, hf_model, transformers_trajectories,
                                                   tmp_path):
    async def through(url):
        async with OpenAIHTTPBackend([url], "tiny-agent") as backend:
            return await rollouts(backend, tiny_tokenizer)

    with local_vllm_server(tiny_agent_dir, "tiny-agent", log_path=tmp_path / "server.log") as url:
        got = asyncio.run(through(url))
    ties = assert_agree_or_tie(hf_model, transformers_trajectories, got)
    assert ties <= len(got) // 4
