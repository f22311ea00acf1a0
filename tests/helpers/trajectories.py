"""Random unpadded trajectories and their collated batch (tests/masking, tests/trainer)."""

import random

from masking import collate
from masking.spans import SpanKind

A, O = SpanKind.ASSISTANT, SpanKind.OBSERVATION


def random_trajectory(rng: random.Random, max_turns: int = 4) -> dict:
    """One unpadded trajectory with alternating assistant turns and observations."""
    spans, turns = [], []
    n_turns = rng.randint(1, max_turns)
    for turn in range(n_turns):
        spans += [A] * rng.randint(1, 6)
        turns += [turn] * (len(spans) - len(turns))
        if turn < n_turns - 1:
            spans += [O] * rng.randint(1, 5)
            turns += [turn] * (len(spans) - len(turns))
    n = len(spans)
    return {
        "prompt_ids": [rng.randint(1, 99) for _ in range(rng.randint(1, 7))],
        "response_ids": [rng.randint(1, 99) for _ in range(n)],
        "spans": [int(s) for s in spans],
        "turn_ids": turns,
        "logprobs": [-rng.random() if s == A else 0.0 for s in spans],
        "reward": rng.choice([0.0, 1.0, -0.5]),
        "turn_rewards": [rng.random() for _ in range(n_turns)],
        "n_turns": n_turns,
    }


def collate_rows(rows, **kwargs):
    return collate(
        [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows], [r["spans"] for r in rows],
        [r["turn_ids"] for r in rows], [r["logprobs"] for r in rows], [r["reward"] for r in rows], **kwargs,
    )
