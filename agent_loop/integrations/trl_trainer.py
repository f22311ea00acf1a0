"""``SpanGRPOTrainer``: TRL's ``GRPOTrainer`` trained on agent-loop's spans and token-level advantages
(docs/trl.md; ``from agent_loop.integrations.trl import SpanGRPOTrainer`` loads it, and TRL, on first use).

A subclass that keeps TRL's generation, tool loop, reward functions and loss, and replaces only the
advantages: it takes the per-sequence rewards where TRL computes them (``_calculate_rewards``), builds
spans from TRL's own masks (tool results are OBSERVATION tokens) and writes a registered estimator's
``(b, t)`` advantages (default REINFORCE++, carry-through returns) into TRL's loss input
``inputs["advantages"]``. Tested against the TRL versions in
:data:`agent_loop.integrations.trl_batch.TESTED_TRL` (tests/integrations/test_trl_real.py).
"""

from __future__ import annotations

import torch
import trl
from trl import GRPOTrainer

from advantages.registry import get_estimator
from agent_loop.integrations.trl_batch import check_trl_args, check_trl_version, sequence_rewards, trl_advantages
from masking.spans import SpanKind


class SpanGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss gets agent-loop's token-level advantages ``(b, t)``.

    ``estimator``: a name in ``advantages.registry`` (``estimator_kwargs`` go to it, e.g.
    ``{"gamma": 1.0}``), given the batch fields it accepts (the spans, the group ids, TRL's
    ``completion_ids`` as ``responses``: the turn-level ``turn_rloo`` and ``gigpo`` work on TRL's tool turns). A row TRL masked as truncated (``mask_truncated_completions=True``) has its
    reward dropped, counted in the metric ``agent_loop/dropped_rewards``; otherwise such a reward
    raises. NaN/inf rewards (TRL's NaN: every reward function returned None) raise ValueError.
    REINFORCE++ whitens over the ASSISTANT tokens of each process's generation batch.

    It overrides three private TRL methods (``_calculate_rewards``, ``_generate_and_score_completions``,
    ``_compute_loss``), so it refuses a TRL outside :data:`~agent_loop.integrations.trl_batch.TESTED_TRL`
    (``allow_untested_trl=True`` warns instead), and refuses TRL's sequence-level options that
    per-token advantages would silently change (:func:`~agent_loop.integrations.trl_batch.check_trl_args`).
    """

    def __init__(self, *args, estimator: str = "reinforce_plus_plus", estimator_kwargs: dict | None = None,
                 allow_untested_trl: bool = False, **kwargs):
        check_trl_version(trl.__version__, allow_untested=allow_untested_trl)  # private methods are overridden
        check_trl_args(kwargs.get("args", args[2] if len(args) > 2 else None))  # GRPOTrainer(model, reward_funcs, args)
        self.estimator = get_estimator(estimator)  # an unknown name fails before TRL loads anything
        if self.estimator.needs_values:
            raise ValueError(f"the {estimator} estimator needs critic values, which GRPOTrainer has none of")
        self.estimator_kwargs = dict(estimator_kwargs or {})
        self.checks: list[dict] = []  # one per loss call, filled when record_checks is set
        self.batches: list[dict] = []  # per generation batch: TRL's masks, our rewards and advantages
        self.record_checks = False
        super().__init__(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # the one place TRL has the per-sequence rewards (gathered over processes, (B_global, n_funcs))
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        b = output["completion_ids"].shape[0]
        start = self.accelerator.process_index * b  # TRL's own process slice
        rewards = sequence_rewards(self._rewards_per_func, self.reward_weights)[start:start + b]
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        index = None
        if self.estimator.needs_index:
            if start % group_size or b % group_size:
                raise ValueError(f"{self.estimator.name} needs whole groups of {group_size} per process; got {b} rows")
            index = torch.arange(start, start + b, device=rewards.device) // group_size
        advantages, spans, metrics = trl_advantages(
            output["completion_mask"], output.get("tool_mask"), rewards, estimator=self.estimator.name, index=index,
            masked="drop" if self.mask_truncated_completions else "raise", **self.estimator_kwargs,
            responses=output["completion_ids"] if "responses" in self.estimator.batch_arguments else None,
        )
        output["advantages"] = advantages  # TRL's loss takes (b, t) advantages as they are
        output["agent_loop_spans"] = spans  # travels with TRL's shuffles and splits, for loss_checks
        if self.record_checks:
            self.batches.append({"completion_mask": output["completion_mask"].tolist(), "rewards": rewards.tolist(),
                                 "completion_ids": output["completion_ids"].tolist(),
                                 "index": None if index is None else index.tolist(),
                                 "tool_mask": output["tool_mask"].tolist() if "tool_mask" in output else None,
                                 "spans": spans.tolist(), "advantages": advantages.tolist()})
        for name, value in metrics.items():
            self._metrics[mode][f"agent_loop/{name}"].append(float(self.accelerator.gather(value).sum()))
        return output

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.record_checks:
            self.checks.append(loss_checks(inputs, loss))
        return loss


def loss_checks(inputs: dict, loss: torch.Tensor) -> dict:
    """What the loss saw: TRL's loss mask against our spans, where the advantages are nonzero."""
    tool_mask = inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
    trl_loss_mask = (inputs["completion_mask"] * tool_mask).bool()  # as TRL's _compute_loss builds it
    spans, advantages = inputs["agent_loop_spans"], inputs["advantages"]
    assistant, observation = spans == SpanKind.ASSISTANT, spans == SpanKind.OBSERVATION
    return {
        "loss": float(loss.detach()),
        "advantages_shape": list(advantages.shape),
        "trl_loss_mask_equals_spans": bool(torch.equal(trl_loss_mask, assistant)),
        "assistant_tokens": int(assistant.sum()),
        "tool_tokens": int(observation.sum()),
        "nonzero_advantages_on_assistant": int((advantages[assistant] != 0).sum()),
        # at ratio 1 (one update per generation) TRL's "dapo" loss is -sum(A * mask) / tokens
        "loss_from_advantages": -float((advantages * trl_loss_mask).sum() / trl_loss_mask.sum().clamp(min=1)),
        "max_abs_advantage_off_assistant": float(advantages[~assistant].abs().max()) if (~assistant).any() else 0.0,
        "masked_rows": int((~assistant.any(dim=1)).sum()),
    }
