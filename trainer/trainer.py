"""The training loop: rollouts with the current policy -> batch -> rewards -> advantages -> PPO-clip updates.

One step (``Trainer.train_step``):

1. play ``prompts_per_step x group_size`` episodes with the rollout backend (``agent_loop.runner``);
2. collate them into the batch tensors of docs/design.md section 2 (``agent_loop.collate``);
3. recompute the old logprobs with the training model, and report their mismatch with the sampler's;
4. token-level rewards: the outcome reward on each episode's last ASSISTANT token, minus an optional
   KL penalty to the frozen initial policy on every ASSISTANT token;
5. advantages by a registered estimator (``advantages.get_estimator``; REINFORCE++ with carry-through
   returns by default);
6. PPO-clip loss over ASSISTANT tokens only, ``ppo_epochs`` passes over shuffled mini-batches,
   gradient accumulation over micro-batches, gradient clipping, AdamW;
7. push the new weights to the rollout backend.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from advantages import (
    aggregate_loss,
    get_estimator,
    kl_penalty,
    masked_mean,
    masked_whiten,
    ppo_clip_policy_loss,
    returns_ignore_mask,
    returns_reset_at_observation,
)
from agent_loop.collate import trajectories_to_batch
from agent_loop.loop import LoopConfig
from agent_loop.runner import run_rollouts
from trainer.config import TrainConfig
from trainer.grouping import GroupedTask
from trainer.metrics import MetricsLogger, compact_line, masked_summary, rollout_metrics
from trainer.policy import ValueHead, batch_logprobs, micro_batches, response_forward, token_entropy, token_logprobs

EVAL_SEED_OFFSET = 1_000_003  # held-out questions come from a different question stream
STATE_FILE = "trainer_state.pt"

# The two historical REINFORCE++ return bugs, kept for the ablation (advantages.returns docstring).
RETURN_VARIANTS = {
    "carry_through": None,  # the registered estimator itself
    "reset_at_observation": lambda rewards, mask, gamma: returns_reset_at_observation(rewards, mask, gamma),
    "ignore_mask": lambda rewards, mask, gamma: returns_ignore_mask(rewards, gamma),
}


def resolve_model_path(config: TrainConfig) -> str:
    """``config.model``, or the built-in tiny agent (built and cached on first use)."""
    if config.model:
        return config.model
    from agent_loop.tiny import tiny_agent_path

    return str(tiny_agent_path(stage=config.tiny_stage))


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) & 0x7FFFFFFF


class Trainer:
    """Trains a causal LM on a task with multi-turn tool-calling rollouts (see the module docstring).

    ``backend`` defaults to an in-process ``TransformersBackend`` over a copy of the policy; any
    backend with ``update_weights(state_dict)`` works (the trainer pushes weights after each step).
    """

    def __init__(self, config: TrainConfig, backend=None, task=None):
        config.validate()
        if config.returns_variant not in RETURN_VARIANTS:
            raise ValueError(f"unknown returns_variant {config.returns_variant!r}; choose one of {sorted(RETURN_VARIANTS)}")
        if config.returns_variant != "carry_through" and config.estimator != "reinforce_plus_plus":
            raise ValueError("returns_variant applies to the reinforce_plus_plus estimator only")
        torch.set_num_threads(config.threads)
        self.config = config
        self.estimator = get_estimator(config.estimator)
        self.output_dir = Path(config.output_dir)
        self.step = 0

        state = None
        self.initial_model = resolve_model_path(config)
        policy_path = self.initial_model
        if config.resume:
            state = torch.load(Path(config.resume) / STATE_FILE, weights_only=False)
            self.initial_model = state["initial_model"]  # the KL reference stays the run's starting policy
            policy_path = str(Path(config.resume) / "model")

        self.tokenizer = AutoTokenizer.from_pretrained(policy_path)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).train()
        self.value_head = ValueHead(self.policy.config.hidden_size) if config.estimator == "gae" else None
        self.reference = None
        if config.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(self.initial_model, dtype=torch.float32).eval()
            self.reference.requires_grad_(False)
        self.trained_parameters = list(self.policy.parameters()) + (list(self.value_head.parameters()) if self.value_head else [])
        self.optimizer = torch.optim.AdamW(self.trained_parameters, lr=config.lr, weight_decay=config.weight_decay)
        if state is not None:
            self._load_state(state)

        if backend is None:
            from agent_loop.backends.hf import TransformersBackend

            backend = TransformersBackend(copy.deepcopy(self.policy), max_batch_size=config.concurrency,
                                          pad_token_id=self.pad_token_id)
        self.backend = backend
        self.backend.update_weights(self.policy.state_dict())
        if task is None:  # ``task`` may be any task object; else config.task names one (agent_loop.plugins)
            from agent_loop.plugins import load_task

            task = load_task(config.task)
        self.base_task = task
        self.task = GroupedTask(task, config.group_size, question_seed=config.seed)
        self.loop_config = LoopConfig(max_turns=config.max_turns, max_tokens=config.max_tokens,
                                      max_response_tokens=config.max_response_tokens, temperature=config.temperature)
        self.logger = MetricsLogger(self.output_dir, fresh=not config.resume)
        self.eval_history: list[tuple[int, float]] = []  # (step, greedy held-out success)

    # --- one step ------------------------------------------------------------------------------------

    def rollouts(self, step: int):
        """The episodes of ``step``: questions ``step * P ... (step + 1) * P - 1``, ``group_size`` samples each."""
        n = self.config.episodes_per_step
        return asyncio.run(run_rollouts(
            self.task, self.backend, self.tokenizer, range(step * n, (step + 1) * n), self.loop_config,
            seed=self.config.seed, concurrency=self.config.concurrency, progress=False,
        ))

    def make_batch(self, trajectories) -> dict[str, torch.Tensor]:
        """Collated tensors plus ``index`` (b,), the group id of each row."""
        batch = trajectories_to_batch(trajectories, pad_token_id=self.pad_token_id)
        batch["index"] = torch.tensor([t.info["group"] for t in trajectories], dtype=torch.long)
        return batch

    def score(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Fill in ``old_logprobs`` (recomputed), ``values``, ``token_level_rewards`` (with KL), ``advantages``, ``returns``.

        Returns metrics: logprob mismatch between sampler and trainer, KL to the reference, advantage
        and return statistics.
        """
        config, mask = self.config, batch["response_mask"]
        metrics = {}
        recomputed, values = batch_logprobs(self.policy, batch, config.micro_batch_size, self.value_head)
        mismatch = (recomputed - batch["old_logprobs"]).abs()
        metrics["logprob_mismatch/mean_abs"] = masked_mean(mismatch, mask).item()
        metrics["logprob_mismatch/max_abs"] = torch.where(mask.bool(), mismatch, 0.0).max().item()
        if config.recompute_old_logprobs:
            batch["old_logprobs"] = recomputed
        if values is not None:
            batch["values"] = values

        rewards = batch["token_level_rewards"]
        if self.reference is not None:
            ref_logprobs, _ = batch_logprobs(self.reference, batch, config.micro_batch_size)
            kl = kl_penalty(batch["old_logprobs"], ref_logprobs, mask, config.kl_kind)
            metrics["ref_kl"] = masked_mean(kl, mask).item()
            rewards = rewards - config.kl_coef * kl
            batch["token_level_rewards"] = rewards

        variant = RETURN_VARIANTS[config.returns_variant]
        if variant is None:
            advantages, returns = self.estimator(
                rewards, mask, spans=batch["spans"], index=batch["index"], values=batch.get("values"),
                gamma=config.gamma, lam=config.lam,
            )
        else:
            returns = variant(rewards, mask, config.gamma)
            advantages = masked_whiten(returns, mask)
        batch["advantages"], batch["returns"] = advantages, returns
        metrics.update(masked_summary("advantages", advantages, mask))
        metrics.update(masked_summary("returns", returns, mask))
        return metrics

    def micro_batch_loss(self, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-clip loss (plus the value loss for GAE, minus an entropy bonus) of one micro-batch, token-mean over its ASSISTANT tokens."""
        config, mask = self.config, micro["response_mask"]
        logits, values = response_forward(self.policy, micro, self.value_head)
        logprobs = token_logprobs(logits, micro["responses"])
        loss, stats = ppo_clip_policy_loss(logprobs, micro["old_logprobs"], micro["advantages"], mask,
                                           clip_ratio=config.clip_ratio)
        entropy = token_entropy(logits)
        stats["pg_loss"] = loss.detach()
        stats["entropy"] = masked_mean(entropy.detach(), mask)
        if config.entropy_coef:
            loss = loss - config.entropy_coef * aggregate_loss(entropy, mask)
        if values is not None:
            value_loss = 0.5 * aggregate_loss((values - micro["returns"]).square(), mask)
            stats["value_loss"] = value_loss.detach()
            loss = loss + config.value_coef * value_loss
        return loss, stats

    def mini_batch_step(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, float]:
        """One AdamW step on the rows ``rows`` of ``batch``: the loss is the token-mean over all their
        ASSISTANT tokens, accumulated over micro-batches; the gradient is clipped. Returns its stats
        (empty if the rows have no ASSISTANT token)."""
        tokens = batch["response_mask"][rows].sum()
        if tokens == 0:
            return {}
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = defaultdict(float)
        for _, micro in micro_batches(batch, rows, self.config.micro_batch_size):
            weight = micro["response_mask"].sum() / tokens
            if weight == 0:
                continue
            loss, micro_stats = self.micro_batch_loss(micro)
            (loss * weight).backward()
            for name, value in {"loss": loss.detach(), **micro_stats}.items():
                stats[name] += (value * weight).item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trained_parameters, self.config.max_grad_norm)
        skipped = bool(grad_norm == 0)  # all-zero advantages carry no signal, but AdamW would still move along its momentum
        if not skipped:
            self.optimizer.step()
        return {**stats, "grad_norm": grad_norm.item(), "skipped_updates": float(skipped)}

    def update(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """``ppo_epochs`` passes over the batch in shuffled mini-batches, one AdamW step each; returns the
        mean of their stats and ``loss/first``, the first mini-batch's loss (before any step: a function of
        the weights and the batch only)."""
        config = self.config
        generator = torch.Generator().manual_seed(_step_seed(config.seed, step))
        history: dict[str, list[float]] = defaultdict(list)
        for _ in range(config.ppo_epochs):
            for rows in torch.randperm(batch["responses"].shape[0], generator=generator).chunk(config.mini_batches):
                for name, value in self.mini_batch_step(batch, rows).items():
                    history[name].append(value)
        metrics = {name: sum(values) / len(values) for name, values in history.items()}
        metrics["loss/first"] = history["loss"][0]
        metrics["clip_frac"] = metrics.pop("clipfrac")
        metrics["ppo_kl"] = metrics.pop("approx_kl")
        return metrics

    def train_step(self) -> dict[str, float]:
        """Run one step (rollouts, scoring, updates, weight push); return its metrics."""
        started = time.perf_counter()
        trajectories = self.rollouts(self.step)
        rolled = time.perf_counter()
        batch = self.make_batch(trajectories)
        metrics = rollout_metrics(trajectories)
        metrics.update(self.score(batch))
        metrics.update(self.update(batch, self.step))
        self.backend.update_weights(self.policy.state_dict())
        self.step += 1
        done = time.perf_counter()
        metrics["time/rollout_s"] = rolled - started
        metrics["time/train_s"] = done - rolled
        metrics["time/step_s"] = done - started
        metrics["assistant_tokens_per_s"] = metrics["assistant_tokens"] * len(trajectories) / (rolled - started)
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Greedy success on ``eval_episodes`` held-out questions (the same questions every time)."""
        loop_config = dataclasses.replace(self.loop_config, temperature=0.0)
        trajectories = asyncio.run(run_rollouts(
            self.base_task, self.backend, self.tokenizer, range(self.config.eval_episodes), loop_config,
            seed=self.config.seed + EVAL_SEED_OFFSET, concurrency=self.config.concurrency, progress=False,
        ))
        metrics = rollout_metrics(trajectories)
        self.eval_history.append((self.step, metrics["success"]))
        return {"eval/success": metrics["success"], "eval/turns": metrics["turns"]}

    # --- the run -------------------------------------------------------------------------------------

    def train(self) -> list[dict[str, float]]:
        """Steps until ``config.steps``: metrics to stdout and ``metrics.jsonl``, checkpoints every
        ``save_every`` steps and at the end. Returns the metrics of the steps run."""
        config = self.config
        history = []
        if config.eval_every and self.step == 0:
            initial = self.evaluate()
            self.logger.log(0, initial)
            tqdm.write(f"step    0 | eval {initial['eval/success']:.3f}")
        bar = tqdm(total=config.steps, initial=self.step, desc="train", unit="step", disable=not config.progress)
        try:
            while self.step < config.steps:
                metrics = self.train_step()
                if config.eval_every and self.step % config.eval_every == 0:
                    metrics.update(self.evaluate())
                self.logger.log(self.step, metrics)
                history.append(metrics)
                tqdm.write(compact_line(self.step, metrics))
                bar.update()
                bar.set_postfix(success=f"{metrics['success']:.3f}")
                if self.step % config.save_every == 0 or self.step == config.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.logger.close()
        return history

    # --- checkpoints ---------------------------------------------------------------------------------

    def checkpoint_dir(self, step: int) -> Path:
        return self.output_dir / "checkpoints" / f"step_{step:06d}"

    def save_checkpoint(self) -> Path:
        """``model/`` (a plain transformers model dir with its tokenizer) and ``trainer_state.pt``
        (optimizer, value head, step, RNG states, config)."""
        path = self.checkpoint_dir(self.step)
        self.policy.save_pretrained(path / "model")
        self.tokenizer.save_pretrained(path / "model")
        torch.save({
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "value_head": self.value_head.state_dict() if self.value_head else None,
            "initial_model": self.initial_model,
            "config": dataclasses.asdict(self.config),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        }, path / STATE_FILE)
        return path

    def _load_state(self, state: dict) -> None:
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        if self.value_head is not None:
            if state["value_head"] is None:
                raise ValueError(f"checkpoint {self.config.resume} has no value head, but estimator 'gae' needs one")
            self.value_head.load_state_dict(state["value_head"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
