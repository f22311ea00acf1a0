"""``Batch.rollout_logprobs``: collate keeps the sampler's logprobs next to ``old_logprobs``, a trainer may replace
``old_logprobs`` with its own and ``uncollate`` still gives the sampler's back (lossless); ``select`` carries
the field (the trainer's micro-batches: tests/training/test_rollout_correction_trainer.py)."""

import random

import torch

from masking import uncollate
from tests.helpers.trajectories import collate_rows, random_trajectory


def test_collate_keeps_the_samplers_logprobs_when_old_logprobs_are_replaced():
    rows = [random_trajectory(random.Random(seed)) for seed in range(5)]
    batch = collate_rows(rows)
    assert torch.equal(batch.rollout_logprobs, batch.old_logprobs)
    assert batch.rollout_logprobs.data_ptr() != batch.old_logprobs.data_ptr()  # a copy: replacing one keeps the other
    batch.old_logprobs = torch.randn(batch.old_logprobs.shape)  # a trainer's recomputed logprobs
    for row, back in zip(rows, uncollate(batch)):
        assert back["logprobs"] == [float(torch.tensor(x, dtype=torch.float32)) for x in row["logprobs"]]
    assert "rollout_logprobs" in batch.keys() and "rollout_logprobs" in batch
    picked = batch.select([3, 1])
    assert torch.equal(picked.rollout_logprobs, batch.rollout_logprobs[[3, 1]])
    batch.rollout_logprobs = None  # a batch built without them: uncollate reads old_logprobs
    assert uncollate(batch)[0]["logprobs"] == batch.old_logprobs[0, : len(rows[0]["spans"])].tolist()

