"""Per-token values of a batch: the padded tensors, rewards, returns and advantages, and the
returns under the estimators that ``--compare`` puts side by side.

Values are computed on the whole loaded batch (REINFORCE++ whitens over every ASSISTANT token of
the batch), then the renderers show the selected rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import advantages
from agent_loop.collate import trajectories_to_batch
from agent_loop.types import Trajectory
from masking.spans import SpanKind, response_mask_from_spans

# name shown to the user -> how the discounted return treats OBSERVATION tokens (docs/design.md section 3)
ESTIMATORS = {
    "carry-through": "R carried through observations unchanged (correct)",
    "reset-at-observation": "R reset to 0 at every observation (verl before PR #7300)",
    "ignore-mask": "observations scanned like assistant tokens (mask ignored)",
}


DIFFERS = 1e-6  # a return further than this from carry-through counts as different (float noise below)


@dataclass
class BatchValues:
    """Everything the renderers colour or print, as (b, t) CPU tensors (t = longest response)."""

    batch: dict[str, torch.Tensor]  # trajectories_to_batch output: responses, spans, turn_ids, old_logprobs, ...
    returns: torch.Tensor  # carry-through discounted returns
    advantages: torch.Tensor  # REINFORCE++ advantages (whitened over the batch's ASSISTANT tokens)
    compare: dict[str, torch.Tensor]  # ESTIMATORS name -> discounted returns under that estimator
    gamma: float

    @property
    def token_level_rewards(self) -> torch.Tensor:
        return self.batch["token_level_rewards"]

    def differs(self, name: str) -> torch.Tensor:
        """(b, t) bool: where estimator ``name`` gives another return than carry-through."""
        return (self.compare[name] - self.compare["carry-through"]).abs() > DIFFERS


@dataclass
class EstimatorSummary:
    """How one estimator's returns on the batch's ASSISTANT tokens compare with carry-through."""

    name: str
    description: str
    mean_return: float
    differing_tokens: int
    assistant_tokens: int
    mean_abs_diff: float


def compare_summary(values: BatchValues) -> list[EstimatorSummary]:
    """One summary per estimator of ESTIMATORS, in order."""
    assistant = values.batch["spans"] == SpanKind.ASSISTANT
    n = int(assistant.sum())
    out = []
    for name, description in ESTIMATORS.items():
        returns = values.compare[name][assistant]
        diff = (returns - values.compare["carry-through"][assistant]).abs()
        out.append(EstimatorSummary(name, description, float(returns.mean()) if n else 0.0,
                                    int(values.differs(name)[assistant].sum()), n, float(diff.mean()) if n else 0.0))
    return out


# ESTIMATORS name -> the registered estimator (advantages.registry) whose returns it shows
REGISTERED = {
    "carry-through": "reinforce_plus_plus",
    "reset-at-observation": "reinforce_plus_plus_reset_at_observation",
    "ignore-mask": "reinforce_plus_plus_ignore_mask",
}


def estimator_returns(name: str, rewards: torch.Tensor, spans: torch.Tensor, gamma: float) -> torch.Tensor:
    """(b, t) discounted returns of ``rewards`` under the estimator ``name`` (a key of ESTIMATORS)."""
    if name not in REGISTERED:
        raise ValueError(f"unknown estimator {name!r}; expected one of {sorted(ESTIMATORS)}")
    mask = response_mask_from_spans(spans, rewards.dtype)
    return advantages.get_estimator(REGISTERED[name])(rewards, mask, spans=spans, gamma=gamma, whiten=False)[1]


def compute_values(trajectories: list[Trajectory], gamma: float = 1.0, pad_token_id: int = 0) -> BatchValues:
    """Collate ``trajectories`` and compute rewards, returns and advantages for every token."""
    batch = trajectories_to_batch(trajectories, pad_token_id=pad_token_id)
    rewards, spans = batch["token_level_rewards"], batch["spans"]
    mask = batch["response_mask"]
    # whitening needs two assistant tokens; a one-token batch shows raw returns as advantages
    whiten = bool(mask.sum() >= 2)
    advantage, returns = advantages.reinforce_plus_plus(rewards, mask, gamma, spans=spans, whiten=whiten)
    compare = {name: estimator_returns(name, rewards, spans, gamma) for name in ESTIMATORS}
    return BatchValues(batch, returns, advantage, compare, gamma)
