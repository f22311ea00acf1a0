"""TRL recipe, the pure part: spans, token-level rewards and carry-through advantages from a TRL
``GRPOTrainer`` batch with tools, so tool tokens get no return and the reward reaches every earlier
assistant turn (docs/trl.md), and the checks ``SpanGRPOTrainer`` makes of TRL's version and options.
Import them from :mod:`agent_loop.integrations.trl`.

TRL's batch: ``completion_mask`` ``(b, t)`` (1 on completion tokens, 0 on right padding and on rows
TRL masks as truncated), ``tool_mask`` ``(b, t)`` (0 on tool-result tokens, 1 elsewhere, padded
with 1) and one reward per sequence ``(b,)``, which TRL does not keep in its batch: take it from
``_calculate_rewards`` with :func:`sequence_rewards`.

Nothing else here imports TRL, so it is tested (and usable) without it.
"""

import warnings

import torch

from advantages.registry import get_estimator
from agent_loop.integrations.spans import spans_from_masks
from masking.rewards import place_rewards
from masking.spans import SpanKind, response_mask_from_spans

# What to do with a nonzero reward on a row that has no ASSISTANT token: with
# ``mask_truncated_completions=True`` TRL zeroes a truncated row's masks, so it trains on none of its
# tokens; "drop" gives that reward up (counted in the metrics), "raise" refuses it.
MASKED_ROW_POLICIES = ("raise", "drop")

# TRL minor versions SpanGRPOTrainer was tested with (tests/integrations/test_trl_real.py, .side-envs/trl):
# it overrides three private GRPOTrainer methods, which TRL may change in any release
TESTED_TRL = ("1.16",)


def check_trl_version(version: str, *, allow_untested: bool = False) -> None:
    """RuntimeError (a warning with ``allow_untested``) unless TRL ``version`` is one :data:`TESTED_TRL` names."""
    if ".".join(version.split(".")[:2]) in TESTED_TRL:
        return
    message = (f"SpanGRPOTrainer overrides private GRPOTrainer methods (_calculate_rewards, "
               f"_generate_and_score_completions, _compute_loss) and is tested with TRL "
               f"{', '.join(v + '.x' for v in TESTED_TRL)}; this is TRL {version}")
    if not allow_untested:
        raise RuntimeError(f"{message}: install a tested TRL, or pass allow_untested_trl=True to try it")
    warnings.warn(message, stacklevel=3)


def check_trl_args(args) -> None:
    """ValueError for TRL options that act per sequence on the sign of the advantage (``GRPOConfig`` ``args``,
    or None for TRL's defaults). With ``(b, t)`` advantages TRL would apply them per token instead, a
    different method from its paper: ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence
    mask drops a high-KL sequence with a negative advantage; per token it would drop only the negative
    tokens of it) and ``loss_type="vespo"`` (its gamma weights pick k and lambda by the sequence's sign)."""
    if args is None:
        return
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        raise ValueError("off_policy_mask_threshold masks whole sequences by the sign of their advantage; with "
                         "agent-loop's per-token advantages it would mask tokens instead: leave it None")
    if getattr(args, "loss_type", None) == "vespo":
        raise ValueError("loss_type='vespo' weights each sequence by the sign of its advantage; with agent-loop's "
                         "per-token advantages that sign varies within a sequence: use another loss_type")


def sequence_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """``(b,)`` reward per sequence from TRL's ``(b, n)`` ``rewards_per_func`` and ``(n,)`` weights.

    As TRL sums them: a function that returned None (NaN in TRL) counts as absent (``nansum``), and
    a row where every function returned None stays NaN, which :func:`from_trl_batch` refuses.
    """
    if rewards_per_func.dim() != 2 or reward_weights.shape != rewards_per_func.shape[1:]:
        raise ValueError(
            f"rewards_per_func must be (b, n) with (n,) reward_weights; got {tuple(rewards_per_func.shape)} "
            f"and {tuple(reward_weights.shape)}"
        )
    summed = (rewards_per_func * reward_weights.to(rewards_per_func)).nansum(dim=1)
    return torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, summed)


def check_rewards(rewards: torch.Tensor, batch_size: int) -> None:
    """ValueError, naming the row, unless ``rewards`` is ``(batch_size,)`` and finite (one host sync)."""
    if rewards.shape != (batch_size,):
        raise ValueError(f"rewards must be one per sequence, shape ({batch_size},); got {tuple(rewards.shape)}")
    bad = ~torch.isfinite(rewards) if rewards.dtype.is_floating_point else torch.zeros_like(rewards, dtype=torch.bool)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"row {row}: reward is {float(rewards[row])}; rewards must be finite (TRL gives NaN where every "
            "reward function returned None): return a number for it, or leave the row out"
        )


def masked_rows(spans: torch.Tensor) -> torch.Tensor:
    """``(b,)`` bool: rows without an ASSISTANT token (with TRL: rows masked as truncated)."""
    return ~(spans == SpanKind.ASSISTANT).any(dim=1)


def from_trl_batch(
    completion_mask: torch.Tensor,
    tool_mask: torch.Tensor | None,
    rewards: torch.Tensor,
    *,
    masked: str = "raise",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(spans, response_mask, token_level_rewards)``, all ``(b, t)``, from a TRL batch.

    Spans: PAD where ``completion_mask`` is 0, OBSERVATION where ``tool_mask`` is 0, ASSISTANT
    elsewhere (``response_mask`` = TRL's loss mask ``completion_mask * tool_mask``). Each reward
    sits on its row's last ASSISTANT token, in the rewards' dtype (float32 for integer rewards).

    ValueError naming the row for a NaN or infinite reward, and, with ``masked="raise"``, for a
    nonzero reward on a row without an ASSISTANT token (a row TRL masked as truncated).
    ``masked="drop"`` gives such rewards up instead: TRL trains on none of that row's tokens, so
    no return could reach them; count them with :func:`masked_rows` (``trl_advantages`` does).
    """
    if masked not in MASKED_ROW_POLICIES:
        raise ValueError(f"masked must be one of {MASKED_ROW_POLICIES}, got {masked!r}")
    check_rewards(rewards, completion_mask.shape[0])
    present = completion_mask.bool()
    sampled = present if tool_mask is None else present & tool_mask.bool()
    spans = spans_from_masks(present, sampled)
    empty = masked_rows(spans)
    if masked == "drop":
        rewards = torch.where(empty, torch.zeros_like(rewards), rewards)
    elif bool((empty & (rewards != 0)).any()):
        row = int(torch.nonzero(empty & (rewards != 0))[0, 0])
        raise ValueError(
            f"row {row}: a nonzero reward has no ASSISTANT token to sit on (TRL masked the whole row, as "
            "mask_truncated_completions=True does); pass masked='drop' to give it up, counted"
        )
    dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    token_level_rewards = place_rewards(spans, rewards, dtype=dtype)
    return spans, response_mask_from_spans(spans, dtype), token_level_rewards


def trl_advantages(
    completion_mask: torch.Tensor,
    tool_mask: torch.Tensor | None,
    rewards: torch.Tensor,
    *,
    estimator: str = "reinforce_plus_plus",
    index: torch.Tensor | None = None,
    masked: str = "raise",
    responses: torch.Tensor | None = None,
    **hyperparameters,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(advantages, spans, metrics)``: a registered estimator's ``(b, t)`` advantages for a TRL
    batch, ready for TRL's ``inputs["advantages"]`` (TRL's loss takes ``(b, t)``), and the spans.

    ``estimator``: a name in :mod:`advantages.registry` (``hyperparameters`` go to it, e.g.
    ``gamma=0.95``); it gets the batch fields it accepts (``Estimator.batch_arguments``): the
    spans, ``index`` and ``responses`` ``(b, t)`` (TRL's ``completion_ids``: gigpo keys its anchor
    states on the tool results' tokens); the turns are read from the spans. Group estimators (GRPO,
    RLOO, REINFORCE++-baseline, turn_rloo, gigpo, ...) need ``index`` ``(b,)`` integer group ids,
    and a masked row is left out of its group (its reward could reach no token). An estimator that
    needs critic values has none here (ValueError). ``masked`` as in :func:`from_trl_batch`. ``metrics`` (0-d tensors, no host sync):
    ``masked_rows`` (rows without an ASSISTANT token) and ``dropped_rewards`` (those with a
    nonzero reward, given up under ``masked="drop"``).
    """
    entry = get_estimator(estimator)
    if entry.needs_values:
        raise ValueError(f"the {entry.name} estimator needs critic values, which TRL's GRPOTrainer has none of")
    spans, response_mask, token_level_rewards = from_trl_batch(completion_mask, tool_mask, rewards, masked=masked)
    empty = masked_rows(spans)
    given = {"spans": spans, "responses": responses}
    if entry.needs_index:
        if not isinstance(index, torch.Tensor):
            raise ValueError(f"the {entry.name} estimator needs index=(b,) integer group ids (a tensor)")
        # a masked row becomes a group of its own (ids below every real one), so it moves no baseline
        own_group = index.min() - 1 - torch.arange(index.shape[0], device=index.device)
        given["index"] = torch.where(empty.to(index.device), own_group, index)
    kwargs = {name: value for name, value in given.items() if name in entry.batch_arguments and value is not None}
    advantages, _ = entry(token_level_rewards, response_mask, **kwargs, **hyperparameters)
    metrics = {"masked_rows": empty.sum(), "dropped_rewards": (empty & (rewards != 0)).sum()}
    return advantages, spans, metrics
