"""Train multi-turn tool-calling agents: rollouts (``agent_loop``) -> batch (``masking``) -> advantages -> PPO-clip."""

from trainer.config import TrainConfig
from trainer.trainer import Trainer

__all__ = ["TrainConfig", "Trainer"]
