"""The settings of the PPO step (``agent_loop.training.ppo``), declared once: the clipped update, its passes and
mini-batches, the entropy and value terms, and the correction of the sampler/trainer mismatch (verl's
``algorithm.rollout_correction``; advantages/rollout_correction.py, docs/verl.md). Importing it does not import
torch (the CLI lists every command at start)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from agent_loop.options import OptionError, integer, number


@dataclass
class PPOOptions:
    """The PPO update of a scored batch, and its rollout correction: the ratio rho = exp(old_logprob -
    rollout_logprob) of the trainer's logprobs to the sampler's."""

    ppo_epochs: integer("passes over each step's episodes") = 1
    mini_batches: integer("optimizer steps per epoch; must divide prompts_per_step * group_size") = 2
    clip_ratio: number("PPO clip range epsilon", gt=0) = 0.2
    entropy_coef: number("entropy bonus weight", ge=0) = 0.0
    value_coef: number("weight of the value head's loss (gae only)", ge=0) = 0.5
    recompute_old_logprobs: Annotated[bool, Field(
        description="recompute the PPO reference logprobs with the policy (off: use the sampler's)")] = True
    rollout_is: Annotated[Literal["off", "token", "sequence"], Field(
        description="truncated importance sampling (verl's rollout_is): each ASSISTANT token's PPO loss times "
                    "min(rho, --rollout-is-threshold), per token or one weight per episode (the product of its "
                    "tokens' ratios); off: metrics (mismatch/*) only")] = "off"
    rollout_is_threshold: number("the cap C of the importance weights (verl's rollout_is_threshold)", gt=0) = 2.0
    rollout_rs: Annotated[Literal["off", "token", "sequence"], Field(
        description="masked importance sampling / rejection (verl's rollout_rs token_k1, seq_sum_k1): drop from the "
                    "loss the ASSISTANT tokens whose ratio, or the episodes whose product ratio, lies outside "
                    "[--rollout-rs-lower, --rollout-rs-upper]")] = "off"
    rollout_rs_lower: number("lower bound of the kept ratios (--rollout-rs)", gt=0) = 0.5
    rollout_rs_upper: number("upper bound of the kept ratios (--rollout-rs)", gt=0) = 2.0

    @property
    def corrects_rollouts(self) -> bool:
        """Whether the sampler/trainer mismatch is corrected (``rollout_is`` or ``rollout_rs`` on)."""
        return self.rollout_is != "off" or self.rollout_rs != "off"

    def rollout_correction_options(self) -> dict:
        """The keywords of ``advantages.correct_rollouts`` these settings give."""
        return {"rollout_is": self.rollout_is, "rollout_is_threshold": self.rollout_is_threshold,
                "rollout_rs": self.rollout_rs, "rollout_rs_lower": self.rollout_rs_lower,
                "rollout_rs_upper": self.rollout_rs_upper}

    def check(self) -> None:
        """The rules across these settings (OptionError)."""
        if self.rollout_rs_lower > self.rollout_rs_upper:
            raise OptionError("rollout_rs_lower", "must not exceed {rollout_rs_upper} "
                              f"({self.rollout_rs_upper})", self.rollout_rs_lower)
        if self.corrects_rollouts and not self.recompute_old_logprobs:
            raise OptionError(None, "{rollout_is} / {rollout_rs} weigh the trainer's recomputed logprobs against the "
                              "sampler's: they need {recompute_old_logprobs} (without it the ratio is 1)")
