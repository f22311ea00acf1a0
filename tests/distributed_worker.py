"""One training step, with its intermediate tensors saved, for tests/training/test_distributed.py.

Run in one process (``python tests/distributed_worker.py OUT CONFIG_JSON [--no-share-prefix]``) or under
torchrun; every rank writes ``OUT/rank{r}.pt``: the step's episodes (token ids), advantages, returns,
recomputed old logprobs, the step's metrics, the parameters after the update (gathered from FSDP's
shards) and the wrapper used.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from agent_loop import TrainConfig, Trainer
from agent_loop.training.distributed import close_data_parallel, full_tensor
from agent_loop.training.metrics import rollout_metrics
from tests.helpers.trainer_config import batch_of


def main(out: str, config_json: str, *flags: str) -> None:
    trainer = Trainer(TrainConfig.from_flat(**json.loads(config_json)))
    if "--no-share-prefix" in flags:  # one process computing as FSDP does (agent_loop/training/distributed.py)
        trainer.model.share_prefix = False
    try:
        trajectories = trainer.rollouts.play_groups(0)
        batch = batch_of(trainer, trajectories)
        metrics = rollout_metrics(trajectories)
        metrics.update(trainer.ppo.score(batch))
        metrics.update(trainer.ppo.update(batch, 0))
        torch.save({
            "episodes": [(t.info["index"], t.prompt_ids, t.response_ids) for t in trajectories],
            "index": batch["index"], "advantages": batch["advantages"], "returns": batch["returns"],
            "old_logprobs": batch["old_logprobs"], "metrics": metrics,
            "parameters": {name: full_tensor(p).detach().clone() for name, p in trainer.policy.named_parameters()},
            "parallel": trainer.dp.mode if trainer.dp.enabled else None,
        }, Path(out) / f"rank{trainer.dp.rank}.pt")
    finally:
        trainer = None  # its DDP reducer first, then the process group (agent_loop.cli.train.train says why)
        gc.collect()
        close_data_parallel()


if __name__ == "__main__":
    main(*sys.argv[1:])
