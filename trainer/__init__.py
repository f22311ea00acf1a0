"""Train multi-turn tool-calling agents: rollouts (``agent_loop``) -> batch (``masking``) -> advantages -> PPO-clip.

``from trainer import TrainConfig, Trainer`` (and ``WarmstartConfig, warm_start``: supervised fine-tuning on a task's
demonstrations); each is imported on first use, so the options load without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"TrainConfig": "trainer.config", "Trainer": "trainer.trainer", "WarmstartConfig": "trainer.warmstart_config",
            "warm_start": "trainer.warmstart"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
