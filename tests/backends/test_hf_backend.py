"""transformers backend: batching of concurrent requests, logprobs, stop tokens, max_tokens, seeds.

Runs a real (small, randomly initialised) Qwen2 model; the tiny agent's end-to-end use is in test_loop.
"""

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agent_loop.backends.base import SamplingParams
from agent_loop.backends.hf import TransformersBackend, _filter_logits, draw_batch, sample_tokens


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
    return Qwen2ForCausalLM(config).eval()


def teacher_forced_logprobs(model, prompt, tokens):
    """Serial reference: one full forward pass over prompt + tokens, log-softmax at each sampled position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def run(coroutine):
    return asyncio.run(coroutine)


def test_concurrent_requests_share_one_batch_and_match_serial_runs(model):
    backend = TransformersBackend(model)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12]]
    sampling = [SamplingParams(max_tokens=24, temperature=1.0, seed=11),
                SamplingParams(max_tokens=9, temperature=0.0, seed=12),
                SamplingParams(max_tokens=30, temperature=0.7, top_k=10, top_p=0.9, seed=13)]

    async def together():
        return await asyncio.gather(*[backend.generate(p, s) for p, s in zip(prompts, sampling)])

    batched = run(together())
    assert backend.batch_sizes == [3]
    alone = [run(backend.generate(p, s)) for p, s in zip(prompts, sampling)]
    assert backend.batch_sizes == [3, 1, 1, 1]
    for prompt, params, a, b in zip(prompts, sampling, batched, alone):
        # left padding must not change what a request samples: same seed, same tokens
        assert a.token_ids == b.token_ids
        assert len(a.token_ids) == len(a.logprobs) == params.max_tokens and a.finish_reason == "length"
        reference = teacher_forced_logprobs(model, prompt, a.token_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), reference, atol=1e-4, rtol=1e-4)


def test_prefill_computes_logits_of_the_last_position_only(model):
    """The head runs on one position per row, also over a long prompt (a 151k vocabulary's prompt
    logits at concurrency 64 would take GiBs)."""
    positions = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: positions.append(args[0].shape[1]))
    try:
        result = run(TransformersBackend(model).generate(list(range(1, 41)), SamplingParams(max_tokens=3, temperature=0.0)))
    finally:
        hook.remove()
    assert len(result.token_ids) == 3 and positions == [1, 1, 1]


def test_greedy_is_argmax_and_stop_token_ends_the_turn(model):
    backend = TransformersBackend(model)
    free = run(backend.generate([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0)))
    # the same prompt with the 4th greedy token as a stop token stops right there, token included
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    cut = run(backend.generate([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop])))
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish_reason == "stop"
    # greedy: every token is the argmax of the teacher-forced distribution
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7] + free.token_ids])).logits[0, 2:-1]
    assert logits.argmax(-1).tolist() == free.token_ids


def test_seeds_make_sampling_reproducible(model):
    backend = TransformersBackend(model)
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=5)
    a = run(backend.generate([1, 2], params))
    b = run(backend.generate([1, 2], params))
    c = run(backend.generate([1, 2], SamplingParams(max_tokens=32, temperature=1.0, seed=6)))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_top_p_filtering():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(_filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [False, False, True, True]
    probs = torch.softmax(logits, -1)  # 0.64, 0.24, 0.09, 0.03: top_p 0.8 keeps the first two
    kept = ~torch.isinf(_filter_logits(logits, top_k=0, top_p=0.8))
    assert kept.tolist() == [True, True, False, False] and probs[0] < 0.8 < probs[:2].sum()


SAMPLING = [SamplingParams(max_tokens=1, temperature=t, top_p=p, top_k=k)
            for t, p, k in ((1.0, 1.0, 0), (0.7, 1.0, 0), (0.0, 1.0, 0), (1.0, 0.9, 0), (1.3, 1.0, 5), (1.0, 1.0, 0))]


def generators(seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + row) for row in range(len(SAMPLING))]


def test_the_batched_draw_is_multinomials_draw_row_by_row():
    """draw_batch (the GPU path, run here on the CPU) against torch.multinomial row by row with the same
    generators: the same tokens, over many seeds; a row that is not a distribution is -1."""
    for seed in range(20):
        probs = torch.softmax(torch.randn(len(SAMPLING), 300, generator=torch.Generator().manual_seed(seed)) * 3, -1)
        serial = [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(probs, generators(seed))]
        sampled = [True] * len(SAMPLING)
        assert draw_batch(probs.clone(), sampled, generators(seed)).tolist() == serial
    probs[1, 7] = float("nan")
    assert draw_batch(probs.clone(), sampled, generators(0)).tolist()[1] == -1
    assert draw_batch(probs.clone(), [True, False, *sampled[2:]], generators(0)).tolist()[1] != -1  # not sampled


def test_both_sampling_paths_give_the_same_tokens():
    """sample_tokens on the device path (batched) and the CPU path (row by row), with temperatures, top-k, top-p
    and a greedy row: the same tokens from the same seeds; greedy is the logits' argmax."""
    for seed in range(20):
        logits = torch.randn(len(SAMPLING), 300, generator=torch.Generator().manual_seed(seed)) * 3
        by_row = sample_tokens(logits, SAMPLING, generators(seed), batched=False)
        assert sample_tokens(logits, SAMPLING, generators(seed), batched=True).tolist() == by_row.tolist()
        assert by_row[2] == torch.argmax(logits[2])


def test_logits_that_are_not_finite_are_refused_on_either_path():
    """A NaN in the logits: -1 on the batched path (the backend raises after its transfer), an error row by row."""
    logits = torch.zeros(2, 10)
    logits[0, 3] = float("nan")
    params, gens = [SamplingParams(max_tokens=1)] * 2, [torch.Generator(), torch.Generator()]
    assert sample_tokens(logits, params, gens, batched=True).tolist()[0] == -1
    with pytest.raises(RuntimeError):
        sample_tokens(logits, params, gens, batched=False)


def test_backend_failure_reaches_every_caller(model):
    backend = TransformersBackend(model)
    out_of_vocab = [1000]  # an id past the embedding table: the model raises

    async def both():
        return await asyncio.gather(backend.generate(out_of_vocab, SamplingParams(max_tokens=2)),
                                    backend.generate([1], SamplingParams(max_tokens=2)), return_exceptions=True)

    results = run(both())
    assert all(isinstance(r, Exception) for r in results)


def test_a_cancelled_request_leaves_the_rest_of_its_batch_their_results(model):
    backend = TransformersBackend(model)
    params = SamplingParams(max_tokens=6, temperature=0.0)

    async def one_cancelled():
        first = asyncio.ensure_future(backend.generate([1, 2], params))
        second = asyncio.ensure_future(backend.generate([3, 4], params))
        await asyncio.sleep(0)  # both queued, one batch
        first.cancel()  # e.g. a closed rollout producer
        # the bug this guards against left the second caller waiting for ever
        return await asyncio.wait_for(second, 60), await asyncio.gather(first, return_exceptions=True)

    result, (cancelled,) = run(one_cancelled())
    assert isinstance(cancelled, asyncio.CancelledError)
    assert result.token_ids == run(backend.generate([3, 4], params)).token_ids and len(result.token_ids) == 6
    assert backend.batch_sizes[0] == 2


def test_update_weights_changes_generation(model):
    backend = TransformersBackend(Qwen2ForCausalLM(model.config).eval())
    backend.update_weights(model.state_dict())
    params = SamplingParams(max_tokens=10, temperature=0.0)
    assert run(backend.generate([3, 4], params)).token_ids == run(TransformersBackend(model).generate([3, 4], params)).token_ids
