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

pytest.importorskip("vllm")
from agent_loop.backends.openai_http import OpenAIHTTPBackend  # noqa: E402
from agent_loop.backends.vllm_engine import VLLMEngineBackend  # noqa: E402
from agent_loop.backends.vllm_server import local_vllm_server  # noqa: E402
from tests.helpers.backend_agreement import (
    EPISODES,
    assert_agree_or_tie,
    rollouts,
)

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def hf_model(tiny_agent_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def transformers_trajectories(hf_model, tiny_tokenizer):
    return asyncio.run(rollouts(TransformersBackend(hf_model), tiny_tokenizer))


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
