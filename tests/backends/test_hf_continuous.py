"""transformers backend on the real tiny agent: continuous batching (requests join between decode steps, finished
or cancelled rows leave) and each episode's KV cache kept between its turns (agent_loop/backends/hf.py).

References: the old static batches (tests/helpers/static_hf.py) for bit-identity of a request decoded alone, a
fresh prefill for the kept cache, and one teacher-forced forward pass over the whole sequence (no cache, one row)
for logprobs and greedy tokens. Timing is never assumed: a forward pre-hook pauses the decode thread at a chosen
forward call while the test issues requests or a weight update.
"""

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_loop.backends.base import SamplingParams
from agent_loop.backends.hf import TransformersBackend, _GrowingLayer
from agent_loop.runners.local import run_rollouts
from masking.spans import SpanKind
from tests.helpers.backend_agreement import GREEDY, TASKS, TIE_GAP
from tests.helpers.static_hf import StaticBatchBackend

# A kept cache's logprobs against a fresh prefill's: float32 on both sides, the prefix's keys computed step by
# step against in one pass (measured on 24 greedy and 24 sampled tiny-agent episodes: at most 4e-6).
KEPT_ATOL = 1e-5
TEACHER_ATOL = 1e-4  # the backend's against one teacher-forced pass (batched, padded, cached: at most 8e-6 seen)


def load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(tiny_agent_dir):
    return load(tiny_agent_dir)


def run(coroutine):
    return asyncio.run(coroutine)


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Serial reference: log-softmax at each of ``tokens``' positions of one forward pass over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


class Pause:
    """Blocks the decode thread at the ``at``-th forward call of ``model`` until :meth:`release`."""

    def __init__(self, model, at: int):
        self.calls, self.at = 0, at
        self.reached, self.released = threading.Event(), threading.Event()
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, module, args):
        self.calls += 1
        if self.calls == self.at:
            self.reached.set()
            assert self.released.wait(60), "the test never released the decode thread"

    async def wait(self):
        assert await asyncio.to_thread(self.reached.wait, 60), "the decode thread never reached the pause"

    def release(self):
        self.released.set()
        self.handle.remove()


async def let_the_loop_hand_over():
    for _ in range(3):  # the request's task runs, then its call_soon hand-over
        await asyncio.sleep(0)


PROMPTS = [list(range(10, 40)), list(range(100, 107)), [5], list(range(200, 260))]


def test_a_request_alone_is_bit_identical_to_the_static_batches(model):
    """One request at a time, no kept cache: the same operations as the old static batch of one, so the same
    tokens and the same logprobs bit for bit (seeded sampling, temperatures, top-k/top-p, greedy)."""
    new, old = TransformersBackend(model), StaticBatchBackend(model)
    settings = [SamplingParams(max_tokens=24, temperature=1.0, seed=3), SamplingParams(max_tokens=9, temperature=0.0),
                SamplingParams(max_tokens=30, temperature=0.7, top_k=10, top_p=0.9, seed=4),
                SamplingParams(max_tokens=16, temperature=1.3, seed=5)]
    for prompt, params in zip(PROMPTS, settings):
        a, b = run(new.generate(prompt, params, session_id="s")), run(old.generate(prompt, params))
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
    assert new.batch_sizes == old.batch_sizes == [1, 1, 1, 1]


def test_kept_cache_gives_a_fresh_prefills_tokens_and_logprobs(model):
    """Turn 2 extends turn 1's prompt and completion: only its new tokens are prefilled, on top of the kept cache;
    tokens equal and logprobs within KEPT_ATOL of a backend that prefills the whole prompt afresh."""
    cached, fresh = TransformersBackend(model), TransformersBackend(model, kept_cache_bytes=0)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    prompt = PROMPTS[0]
    first = run(cached.generate(prompt, params, session_id="episode"))
    assert cached.kept_sessions == ["episode"] and cached.kept_bytes > 0
    second_prompt = prompt + first.token_ids + [300, 301, 302]  # a tool's reply after the assistant's turn
    before = dict(cached.stats)
    got = run(cached.generate(second_prompt, params, session_id="episode"))
    assert cached.stats["reused_tokens"] - before["reused_tokens"] == len(prompt) + len(first.token_ids) - 1
    assert cached.stats["prefilled_tokens"] - before["prefilled_tokens"] == 4  # the last sampled token + 3
    want = run(fresh.generate(second_prompt, params, session_id="episode"))
    assert fresh.stats["reused_tokens"] == 0 and fresh.kept_sessions == []
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=KEPT_ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(got.logprobs), teacher_forced(model, second_prompt, got.token_ids),
                               atol=TEACHER_ATOL, rtol=0)


def test_a_prompt_that_does_not_extend_the_kept_cache_is_prefilled_from_scratch(model):
    backend = TransformersBackend(model)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = PROMPTS[0]
    first = run(backend.generate(prompt, params, session_id="s"))
    changed = prompt[:5] + [prompt[5] + 1] + prompt[6:] + first.token_ids + [300]  # one token differs
    for other in (changed, prompt, prompt + first.token_ids[:-1]):  # different; a retry; no token past the cache
        before = dict(backend.stats)
        got = run(backend.generate(other, params, session_id="s"))
        assert backend.stats["reused_tokens"] == before["reused_tokens"]
        assert backend.stats["prefilled_tokens"] - before["prefilled_tokens"] == len(other)
        torch.testing.assert_close(torch.tensor(got.logprobs), teacher_forced(model, other, got.token_ids),
                                   atol=TEACHER_ATOL, rtol=0)
    assert backend.kept_sessions == ["s"]  # the last request's cache replaced the one it could not use


def test_a_request_arriving_mid_decode_joins_before_the_running_one_ends(model):
    """A runs alone; at its 2nd decode step B arrives: B joins the running batch (batch_sizes [1, 2]) and ends
    first. A's tokens are those it draws alone; both rows' logprobs match one teacher-forced pass each."""
    backend = TransformersBackend(model)
    a_params = SamplingParams(max_tokens=40, temperature=1.0, seed=1)
    b_params = SamplingParams(max_tokens=4, temperature=1.0, seed=2)
    ended = []

    async def both():
        pause = Pause(backend.model, at=3)  # A's prefill, its 1st and 2nd decode steps
        a = asyncio.ensure_future(backend.generate(PROMPTS[0], a_params))
        a.add_done_callback(lambda _: ended.append("A"))
        await pause.wait()
        b = asyncio.ensure_future(backend.generate(PROMPTS[3], b_params))
        b.add_done_callback(lambda _: ended.append("B"))
        await let_the_loop_hand_over()
        pause.release()
        return await a, await b

    a, b = run(both())
    assert backend.batch_sizes == [1, 2] and ended == ["B", "A"]
    assert len(a.token_ids) == 40 and len(b.token_ids) == 4
    assert a.token_ids == run(TransformersBackend(model).generate(PROMPTS[0], a_params)).token_ids
    for prompt, result in ((PROMPTS[0], a), (PROMPTS[3], b)):
        torch.testing.assert_close(torch.tensor(result.logprobs), teacher_forced(model, prompt, result.token_ids),
                                   atol=TEACHER_ATOL, rtol=0)


def test_a_request_cancelled_mid_decode_leaves_the_batch_and_the_other_rows_go_on(model):
    backend = TransformersBackend(model)
    b_params = SamplingParams(max_tokens=10, temperature=1.0, seed=2)

    async def one_cancelled():
        pause = Pause(backend.model, at=4)  # two prefills, then the 2nd decode step
        a = asyncio.ensure_future(backend.generate(PROMPTS[0], SamplingParams(max_tokens=40), session_id="a"))
        b = asyncio.ensure_future(backend.generate(PROMPTS[1], b_params, session_id="b"))
        await pause.wait()
        a.cancel()  # e.g. a closed rollout producer
        await asyncio.sleep(0)
        pause.release()
        return await asyncio.wait_for(b, 60), await asyncio.gather(a, return_exceptions=True)

    b, (a,) = run(one_cancelled())
    assert isinstance(a, asyncio.CancelledError) and backend.batch_sizes == [2]
    assert backend.stats["decode_steps"] == 9  # B's 9 (its first token came from its prefill): A left at once
    assert b.token_ids == run(TransformersBackend(model).generate(PROMPTS[1], b_params)).token_ids
    assert backend.kept_sessions == ["b"]  # nobody waits for A's next turn


def test_an_error_reaches_every_caller_of_the_batch_and_the_backend_serves_on(model):
    """A request whose prompt breaks the model (an id past the vocabulary) joins a running row: both callers get
    the error (the batch's cache is gone with it); the next request is served as if nothing had happened."""
    backend = TransformersBackend(model)
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=1)

    async def a_bad_joiner():
        pause = Pause(backend.model, at=2)
        a = asyncio.ensure_future(backend.generate(PROMPTS[0], params, session_id="a"))
        await pause.wait()
        bad = asyncio.ensure_future(backend.generate([5, 10_000], params))
        await let_the_loop_hand_over()
        pause.release()
        return await asyncio.gather(a, bad, return_exceptions=True)

    results = run(a_bad_joiner())
    assert all(isinstance(r, IndexError) for r in results), results
    assert backend.kept_sessions == []
    again = run(backend.generate(PROMPTS[0], params, session_id="a"))
    assert again.token_ids == run(TransformersBackend(model).generate(PROMPTS[0], params)).token_ids


def test_a_weight_update_waits_for_running_rows_admits_nothing_meanwhile_and_drops_kept_caches(
        tiny_agent_dir, tiny_mid):
    """update_weights during A's decoding: A ends on the old weights, C (issued while the update waits) runs on
    the new ones, alone; A's kept cache (old weights' keys) is gone, so A's next turn is prefilled afresh."""
    old, new = load(tiny_agent_dir), load(tiny_mid)
    backend = TransformersBackend(load(tiny_agent_dir))
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1)

    async def during_an_update():
        pause = Pause(backend.model, at=3)
        a = asyncio.ensure_future(backend.generate(PROMPTS[0], params, session_id="a"))
        await pause.wait()
        update = asyncio.ensure_future(asyncio.to_thread(backend.update_weights, new.state_dict()))
        deadline = time.monotonic() + 60
        while not backend._decode_thread.swaps_waiting:  # the update has stopped admissions
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        c = asyncio.ensure_future(backend.generate(PROMPTS[1], params))
        await let_the_loop_hand_over()
        assert not update.done()  # it waits for A
        pause.release()
        return await a, await update, await c

    a, _, c = run(during_an_update())
    assert backend.batch_sizes == [1, 1]  # C never joined A
    torch.testing.assert_close(torch.tensor(a.logprobs), teacher_forced(old, PROMPTS[0], a.token_ids),
                               atol=TEACHER_ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(c.logprobs), teacher_forced(new, PROMPTS[1], c.token_ids),
                               atol=TEACHER_ATOL, rtol=0)
    assert backend.kept_sessions == []
    next_turn = PROMPTS[0] + a.token_ids + [300]
    got = run(backend.generate(next_turn, params, session_id="a"))
    assert backend.stats["reused_tokens"] == 0
    torch.testing.assert_close(torch.tensor(got.logprobs), teacher_forced(new, next_turn, got.token_ids),
                               atol=TEACHER_ATOL, rtol=0)


def test_kept_caches_are_bounded_least_recently_used_first(model):
    backend = TransformersBackend(model)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    run(backend.generate(PROMPTS[0], params, session_id="s1"))
    one = backend.kept_bytes  # 30 + 4 tokens' keys and values
    backend.kept_cache_bytes = 2 * one + one // 2
    run(backend.generate(PROMPTS[0][::-1], params, session_id="s2"))
    run(backend.generate(PROMPTS[0], params, session_id="s1"))  # not an extension: s1's new cache, now most recent
    run(backend.generate(list(range(50, 80)), params, session_id="s3"))
    assert backend.kept_sessions == ["s1", "s3"] and backend.stats["evicted_sessions"] == 1
    assert backend.kept_bytes == 2 * one <= backend.kept_cache_bytes
    run(backend.generate(list(range(300, 400)), params, session_id="big"))  # 104 tokens: more than the bound
    assert backend.kept_sessions == ["s1", "s3"]
    run(backend.end_run())
    assert backend.kept_sessions == [] and backend.kept_bytes == 0


def test_an_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        run(TransformersBackend(model).generate([], SamplingParams()))


def greedy_tokens_are_the_uncached_argmax(model, trajectories) -> int:
    """Every assistant token of greedy ``trajectories`` is the argmax of one teacher-forced pass over the whole
    episode (no cache, one row), or one of a float32 tie's two tokens; logprobs within TEACHER_ATOL. Returns the
    number of assistant tokens checked."""
    checked = 0
    for t in trajectories:
        assistant = torch.tensor([kind == SpanKind.ASSISTANT for kind in t.spans])
        with torch.no_grad():
            logits = model(torch.tensor([t.prompt_ids + t.response_ids])).logits[0, len(t.prompt_ids) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), -1)[assistant]
        tokens = torch.tensor(t.response_ids)[assistant]
        best = logprobs.topk(2)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        ties = best.values[:, 0] - best.values[:, 1] < TIE_GAP
        assert bool(((best.indices[:, 0] == tokens) | (ties & (best.indices[:, 1] == tokens))).all())
        torch.testing.assert_close(torch.tensor(t.logprobs)[assistant], chosen, atol=TEACHER_ATOL, rtol=0)
        checked += len(tokens)
    return checked


def test_real_episodes_reuse_their_caches_and_stay_greedy_exact(model, tiny_tokenizer):
    """The tiny agent's multi-turn tool-calling episodes, greedy, 6 at once: with kept caches they prefill only
    each turn's new tokens, and every token and logprob is the uncached single-row reference's (ties aside)."""
    cached, fresh = TransformersBackend(model), TransformersBackend(model, kept_cache_bytes=0)

    async def episodes(backend):
        return [t for task in TASKS for t in await run_rollouts(task, backend, tiny_tokenizer, range(6), GREEDY,
                                                                 seed=1, concurrency=6, progress=False)]

    got, want = run(episodes(cached)), run(episodes(fresh))
    assert not [t.metrics["backend_error"] for t in got + want if t.finish_reason == "error"]
    assert sum(t.metrics["turns"] >= 2 for t in got) >= 6  # multi-turn episodes: there is something to reuse
    assert [t.response_ids for t in got] == [t.response_ids for t in want]
    # the same prompts: every prompt token was either prefilled or taken from a kept cache
    assert cached.stats["prefilled_tokens"] + cached.stats["reused_tokens"] == fresh.stats["prefilled_tokens"]
    assert cached.stats["reused_tokens"] > 0.4 * fresh.stats["prefilled_tokens"] and fresh.stats["reused_tokens"] == 0
    assert max(cached.batch_sizes) > 1
    assert greedy_tokens_are_the_uncached_argmax(model, got) > 100
    assert greedy_tokens_are_the_uncached_argmax(model, want) > 100
    assert cached.kept_sessions == []  # end_run dropped them


def test_the_growing_cache_layer_holds_what_concatenation_would():
    """The batch's cache layers write each step in place; past their room (also by a whole prefill at once) they
    grow: keys and values always equal DynamicLayer's concatenation."""
    keys = torch.randn(2, 3, 5, 4)
    layer, parts = _GrowingLayer(keys, keys + 1), [keys]
    for new in (1, 1, 70, 1, 200):
        states = torch.randn(2, 3, new, 4)
        got_keys, got_values = layer.update(states, states + 1)
        parts.append(states)
        assert torch.equal(got_keys, torch.cat(parts, 2)) and torch.equal(got_values, torch.cat(parts, 2) + 1)
    assert layer.get_seq_length() == 5 + 273
