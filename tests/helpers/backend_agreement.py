"""Greedy rollouts of the tiny agent on a backend, and the check that two backends' rollouts agree up to
float32 ties (tests/backends/test_backend_agreement.py, tests/training/test_weight_sync.py)."""

import torch

from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.builtin import ArithmeticTask, LookupTask
from masking.spans import SpanKind

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
