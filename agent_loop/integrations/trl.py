"""agent-loop for TRL (docs/trl.md): ``SpanGRPOTrainer``, TRL's ``GRPOTrainer`` trained on our spans and
token-level advantages (:mod:`agent_loop.integrations.trl_trainer`, loaded with TRL on first use, so this
module imports without TRL), and the pure functions it is built from (:mod:`agent_loop.integrations.trl_batch`).
``examples/trl_grpo_tools.py`` runs the trainer.
"""

from agent_loop.integrations.trl_batch import (
    MASKED_ROW_POLICIES,
    TESTED_TRL,
    check_rewards,
    check_trl_args,
    check_trl_version,
    from_trl_batch,
    masked_rows,
    sequence_rewards,
    trl_advantages,
)

__all__ = ["MASKED_ROW_POLICIES", "TESTED_TRL", "check_rewards", "check_trl_args",
           "check_trl_version", "from_trl_batch", "masked_rows", "sequence_rewards", "trl_advantages"]  # and SpanGRPOTrainer, lazily


def __getattr__(name: str):
    if name == "SpanGRPOTrainer":  # imports TRL, so only when asked for
        from agent_loop.integrations.trl_trainer import SpanGRPOTrainer  # trl: optional (pip install trl)

        return SpanGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
