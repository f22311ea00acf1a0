"""A small synchronous training run on the tiny agent, and fixed random advantages (tests/training)."""

import torch

from agent_loop import TrainConfig
from agent_loop.training.step_rollouts import training_batch
from masking import SpanKind

ASSISTANT = SpanKind.ASSISTANT


def small_config(tiny_mid: str, tmp_path, **overrides) -> TrainConfig:
    """8 episodes per step (4 questions x 2 samples), 2 mini-batches of 4, micro-batches of 2."""
    settings = dict(model=tiny_mid, steps=2, prompts_per_step=4, group_size=2, concurrency=8, mini_batches=2,
                    micro_batch_size=2, ppo_epochs=1, threads=1, output_dir=str(tmp_path / "run"), progress=False)
    settings.update(overrides)
    return TrainConfig.from_flat(**settings)


def batch_of(trainer, trajectories):
    """``trajectories`` collated as ``trainer``'s step collates them (its group size, pad id and device)."""
    return training_batch(trajectories, group_size=trainer.config.run.group_size, pad_token_id=trainer.pad_token_id,
                          device=trainer.device)


def random_advantages(batch: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Replace the advantages by fixed random numbers on ASSISTANT tokens (0 elsewhere), so the loss
    has a signal whatever the warm start's success rate is."""
    noise = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(seed))
    batch["advantages"] = torch.where(batch["spans"] == ASSISTANT, noise, 0.0)
