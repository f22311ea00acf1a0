"""What an estimator takes besides the batch: its settings, one small frozen dataclass per kind of estimator,
registered with it (``register_adv_est(..., settings=GAESettings)``; ``Estimator.settings``) and given to
its registry entry as an instance (``get_estimator("gae")(rewards, mask, values=..., settings=GAESettings(lam=0.9))``).

Plain stdlib dataclasses, importable without torch, so that an application declares its options from them
(the command line's ``--gamma``, ``--lam``, ...: :data:`SETTINGS_CLASSES`). Each field's ``metadata``:
``description`` (the help, naming the estimators it applies to where not all that take settings) and the
bounds ``ge``/``le`` (inclusive) where it has them; a fixed set of choices is the field's ``Literal`` type. The
function's own keyword defaults (verl's, for a direct call) may differ from these (an application's defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# the estimators that credit each assistant turn as one step (advantages/turn_credit.py, issue 47)
TURN_LEVEL = ("turn_returns", "turn_rloo", "turn_index_normalized", "gigpo", "turn_gae")


def setting(default, description: str, **bounds):
    """A settings field: ``default``, and its ``metadata`` (``description``; bounds ``ge``, ``le``)."""
    return field(default=default, metadata={"description": description, **bounds})


@dataclass(frozen=True)
class DiscountSettings:
    """The discount of the returns: the REINFORCE++ estimators and the turn-level ones."""

    gamma: float = setting(1.0, "discount of the returns", ge=0, le=1)


@dataclass(frozen=True)
class GAESettings(DiscountSettings):
    """GAE's (token-level ``gae``, turn-level ``turn_gae``): the discount and lambda."""

    lam: float = setting(0.95, "GAE lambda (estimators gae and turn_gae only)", ge=0, le=1)


@dataclass(frozen=True)
class GiGPOSettings(DiscountSettings):
    """GiGPO's: the discount of its turn returns, the weight of its step-level advantage, its normalisation."""

    step_advantage_w: float = setting(
        1.0, "weight omega of gigpo's step-level (anchor-state group) advantage beside its episode-level one "
        "(estimator gigpo only)", ge=0)
    gigpo_mode: Literal["mean_norm", "mean_std_norm"] = setting(
        "mean_norm", "gigpo's group normalisation: mean_norm subtracts the group mean (GiGPO's default), "
                     "mean_std_norm also divides by the group std (estimator gigpo only)")


SETTINGS_CLASSES = (DiscountSettings, GAESettings, GiGPOSettings)  # every registered estimator's is one of these
