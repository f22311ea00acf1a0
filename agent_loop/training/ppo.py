"""The PPO step on a scored batch: score (old logprobs, KL, advantages), then clipped updates with AdamW.

:class:`PPO` holds what the step needs between calls (the data-parallel model, AdamW, the frozen reference, the
estimator) and nothing of the rollouts; the RL recipe (``agent_loop.recipes.train``) calls

1. :meth:`PPO.score`: recompute the old logprobs with the policy and report their mismatch with the sampler's
   (``mismatch/*``, the correction of ``advantages.rollout_correction``), subtract the KL penalty to the reference
   from the token rewards, and fill in advantages and returns by the registered estimator;
2. :meth:`PPO.update`: ``ppo_epochs`` passes over the batch in shuffled mini-batches, one AdamW step each, the loss
   the token-mean PPO-clip loss over the ASSISTANT tokens (plus the value loss for GAE, minus an entropy bonus),
   accumulated over micro-batches, the gradient clipped.

With several processes the step is split as agent_loop/training/distributed.py says; ``dtype`` bf16 runs the
forwards under autocast, the weights and AdamW state stay fp32.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict

import torch

import agent_loop.training.optimization as optimization
from advantages import aggregate_loss, clipped_value_loss, kl_penalty, masked_mean, ppo_clip_policy_loss
from advantages.rollout_correction import correct_rollouts
from agent_loop.runners.batch import estimator_arguments
from agent_loop.training.distributed import full_tensor
from agent_loop.training.metrics import LOSS_STAT_NAMES, UPDATE_METRICS, masked_summary, scalars
from agent_loop.training.policy import batch_logprobs, micro_batches, policy_outputs
from masking.batch import Batch


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s mini-batch shuffle."""
    return (seed * 1_000_003 + step) & 0x7FFFFFFF


class PPO:
    """The scoring and the PPO-clip update of a batch (see the module docstring).

    ``model``: the ``PolicyModel`` in its data-parallel wrapper (``dp.wrap``); ``parameters``: those AdamW trains
    (LoRA: the adapters); ``reference``: the frozen initial policy (a ``PolicyModel``) or None (no KL, else
    ``kl_coef`` x the ``kl_kind`` estimate on each ASSISTANT token); ``estimator``: a registry entry
    (``advantages.get_estimator``) and ``settings`` its settings instance (``advantages.settings``; None: it has
    none); ``options``: the update's (``PPOOptions`` and ``OptimizerOptions``: ``learning_rate``,
    ``warmup_steps``, ``max_grad_norm``, ``micro_batch_size``); ``seed``: the run's (each step shuffles with
    :func:`step_seed`).
    """

    def __init__(self, model, optimizer, parameters, *, reference, estimator, settings, options, kl_coef: float,
                 kl_kind: str, dp, dtype: torch.dtype, seed: int):
        self.model, self.optimizer, self.parameters = model, optimizer, parameters
        self.reference, self.kl_coef, self.kl_kind = reference, kl_coef, kl_kind
        self.estimator, self.settings, self.options = estimator, settings, options
        self.dp, self.dtype, self.seed = dp, dtype, seed
        self.step = 0  # the trainer step being run: names it in warnings

    def autocast(self):
        """bf16 autocast for forward passes when ``dtype`` is bf16 (weights and optimizer stay fp32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(next(self.model.parameters()).device.type, dtype=self.dtype)

    def logprobs(self, model, batch: Batch, values: bool = False):
        """``agent_loop.training.policy.batch_logprobs`` of the whole batch; with several ranks each scores its
        micro-batches."""
        with self.autocast():
            logprobs, values = batch_logprobs(model, batch, self.options.micro_batch_size, values=values,
                                              shard=self.dp.shard_of)
        return self.dp.sum_rows_(logprobs), self.dp.sum_rows_(values)

    def score(self, batch: Batch, *, sampler_is_behaviour: bool = False) -> dict[str, float]:
        """Fill in ``old_logprobs`` (recomputed), ``values``, ``token_level_rewards`` (with KL), ``advantages``,
        ``returns``, ``rollout_is_weights`` and ``loss_mask``.

        Returns metrics: logprob mismatch between sampler and trainer (``mismatch/*``), KL to the reference,
        advantage and return statistics. ``sampler_is_behaviour`` (off-policy steps) keeps the sampler's logprobs
        as ``old_logprobs`` whatever ``recompute_old_logprobs`` says (the policy has moved since they were
        sampled), unless the mismatch is corrected (``rollout_is`` / ``rollout_rs``): then ``old_logprobs`` are
        the recomputed ones and the importance weights correct the sampler's (the decoupled objective,
        advantages/rollout_correction.py). The sampler's stay in ``rollout_logprobs``; the loss covers
        ``loss_mask``: ``response_mask`` (which the advantages see whole) less the tokens ``rollout_rs`` rejected.
        """
        options, mask = self.options, batch.response_mask
        metrics = {}
        recomputed, values = self.logprobs(self.model, batch, values=self.estimator.needs_values)
        if batch.rollout_logprobs is None:
            batch.rollout_logprobs = batch.old_logprobs
        mismatch = (recomputed - batch.rollout_logprobs).abs()
        metrics["logprob_mismatch/mean_abs"] = masked_mean(mismatch, mask).item()
        metrics["logprob_mismatch/max_abs"] = torch.where(mask.bool(), mismatch, 0.0).max().item()
        correction = correct_rollouts(recomputed, batch.rollout_logprobs, mask, **options.rollout_correction_options())
        metrics.update(scalars(correction.metrics))
        if options.recompute_old_logprobs and (options.corrects_rollouts or not sampler_is_behaviour):
            batch.old_logprobs = recomputed
        batch.rollout_is_weights = correction.weights
        if values is not None:
            batch.values = values

        rewards = batch.token_level_rewards
        if self.reference is not None:
            ref_logprobs, _ = self.logprobs(self.reference, batch)
            kl = kl_penalty(batch.old_logprobs, ref_logprobs, self.kl_kind, response_mask=mask)
            metrics["ref_kl"] = masked_mean(kl, mask).item()
            rewards = rewards - self.kl_coef * kl
            batch.token_level_rewards = rewards

        settings = {} if self.settings is None else {"settings": self.settings}
        # the batch fields the estimator takes (spans, index, values, turn ids, ...)
        advantages, returns = self.estimator(rewards, mask, **estimator_arguments(self.estimator, batch), **settings)
        batch.advantages, batch.returns = advantages, returns
        metrics.update(masked_summary("advantages", advantages, mask))
        metrics.update(masked_summary("returns", returns, mask))
        batch.loss_mask = correction.loss_mask  # less the tokens --rollout-rs rejected; response_mask stays whole
        return metrics

    def micro_batch_loss(self, micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-clip loss (plus the value loss for GAE, minus an entropy bonus) of one micro-batch, token-mean over
        its ASSISTANT tokens."""
        options, mask = self.options, micro.trained_mask
        with self.autocast():
            logprobs, entropy, values = policy_outputs(self.model, micro)
        loss, stats = ppo_clip_policy_loss(micro.old_logprobs, logprobs, micro.advantages, mask,
                                           clip_ratio=options.clip_ratio, rollout_is_weights=micro.rollout_is_weights)
        stats = {LOSS_STAT_NAMES.get(name, name): value for name, value in stats.items()}  # the logged names
        stats["pg_loss"] = loss.detach()
        stats["entropy"] = masked_mean(entropy.detach(), mask)
        if options.entropy_coef:
            loss = loss - options.entropy_coef * aggregate_loss(entropy, mask)  # the bonus: entropy_loss from entropies
        if values is not None:  # unclipped: an infinite clip range
            value_loss, _ = clipped_value_loss(values, micro.returns, micro.values, mask, float("inf"))
            stats["value_loss"] = value_loss.detach()
            loss = loss + options.value_coef * value_loss
        return loss, stats

    def _accumulate(self, batch: Batch, rows: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
        """Forward and backward of ``rows``' micro-batches, each weighted by its share of the ``tokens`` trained;
        returns their weighted stats. A stand-in (ranks paired) or a micro-batch without an ASSISTANT token adds 0."""
        stats: dict[str, float] = defaultdict(float)
        micros = list(micro_batches(batch, rows, self.options.micro_batch_size, shard=self.dp.shard_of))
        for number, (part, micro) in enumerate(micros):
            weight = micro.trained_mask.sum() / tokens if part is not None else 0
            with self.dp.accumulate(self.model, sync=number == len(micros) - 1):
                if weight == 0:
                    with self.autocast():
                        outputs = policy_outputs(self.model, micro, entropy=False)
                    sum(output.sum() for output in outputs if output is not None).mul(0.0).backward()
                    continue
                loss, micro_stats = self.micro_batch_loss(micro)
                (loss * weight).backward()
            for name, value in {"loss": loss.detach(), **micro_stats}.items():
                stats[name] += (value * weight).item()
        return stats

    def mini_batch_step(self, batch: Batch, rows: torch.Tensor) -> dict[str, float]:
        """One AdamW step on the rows ``rows`` of ``batch``: the loss is the token-mean over all their
        ASSISTANT tokens, accumulated over micro-batches; the gradient is clipped. Returns its stats
        (empty if the rows have no ASSISTANT token). With several ranks each runs its share of ``rows``
        and the gradients and stats are summed over the ranks (agent_loop/training/distributed.py)."""
        tokens = batch.trained_mask[rows].sum()
        if tokens == 0:
            return {}
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.dp.sum_stats(self._accumulate(batch, rows, tokens))
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.parameters, self.options.max_grad_norm))
        # all-zero advantages carry no signal, but AdamW would still move along its momentum; a non-finite
        # gradient would make every weight NaN
        skipped = bool(grad_norm == 0) or not bool(torch.isfinite(grad_norm))
        if skipped and grad_norm != 0:
            warnings.warn(f"step {self.step + 1}: non-finite gradient norm ({grad_norm.item()}): AdamW step "
                          "skipped (metrics skipped_updates)", stacklevel=3)
        if not skipped:
            self.optimizer.step()
        return {**stats, "grad_norm": grad_norm.item(), "skipped_updates": float(skipped)}

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based ``step``: linear warm-up by trainer step, then flat (resumes with the
        step; ``agent_loop.training.optimization.lr_at``)."""
        return optimization.lr_at(step, peak=self.options.learning_rate, warmup_steps=self.options.warmup_steps)

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes over the batch in shuffled mini-batches, one AdamW step each; returns the
        mean of their stats and ``loss/first``, the first mini-batch's loss (before any step: a function of
        the weights and the batch only)."""
        options, self.step = self.options, step
        lr = optimization.set_lr(self.optimizer, self.lr_at(step))
        generator = torch.Generator().manual_seed(step_seed(self.seed, step))
        history: dict[str, list[float]] = defaultdict(list)
        for _ in range(options.ppo_epochs):
            order = torch.randperm(batch.responses.shape[0], generator=generator).to(batch.responses.device)
            for rows in order.chunk(options.mini_batches):
                for name, value in self.mini_batch_step(batch, rows).items():
                    history[name].append(value)
        if not history:  # --rollout-rs rejected every ASSISTANT token of the step: nothing to train on
            warnings.warn(f"step {step + 1}: --rollout-rs rejected every ASSISTANT token: no update (metrics "
                          "mismatch/frac_masked, skipped_updates)", stacklevel=2)
            return {**dict.fromkeys(UPDATE_METRICS, float("nan")), "grad_norm": 0.0, "skipped_updates": 1.0, "lr": lr}
        metrics = {name: sum(values) / len(values) for name, values in history.items()}
        metrics["loss/first"] = history["loss"][0]
        metrics["lr"] = lr
        return metrics
