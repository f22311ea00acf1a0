"""The RL recipe (``agent-loop train``): set-up, then steps of rollouts -> batch -> score -> update -> push.

The set-up (:class:`Trainer`) reads as its steps: processes, where the run starts (``agent_loop.training.resume``),
the policy and the PPO step (``agent_loop.training.policy``, ``.ppo``), the rollout backend, the weight transport
and the question stream (``.rollout_backend``, ``.transports``, ``.step_rollouts``). Each step
(:meth:`Trainer.train_step`):

1. **rollouts**: ``prompts_per_step x group_size`` episodes with the current policy (synchronous, or taken from
   the asynchronous producer with ``max_staleness``; dynamic sampling with ``filter_groups``); the failed ones and
   those left alone in their group dropped;
2. **batch**: the episodes collated into the tensors of docs/design.md section 2, sessions joined;
3. **score**: old logprobs recomputed (their mismatch with the sampler's reported and, with ``rollout_is`` /
   ``rollout_rs``, corrected), the KL penalty, advantages by the registered estimator;
4. **update**: PPO-clip over ASSISTANT tokens, ``ppo_epochs`` passes of shuffled mini-batches, AdamW;
5. **push**: the new weights to the rollout backend; the step's episodes saved with their advantages.

Every ``save_every`` steps and at the end, a checkpoint (``agent_loop.training.checkpoint``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

import agent_loop.training.checkpoint as checkpoint
import agent_loop.training.metrics as reports
import agent_loop.training.optimization as optimization
import agent_loop.training.rollout_files as rollout_files
from advantages import get_estimator
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.options import checked, pick
from agent_loop.recipes.train_options import DTYPES, TrainConfig
from agent_loop.runners.producer import VersionedBackend, staleness_metrics
from agent_loop.runners.stats import sampling_label
from agent_loop.tasks.grouping import GroupedTask
from agent_loop.threads import apply_threads
from agent_loop.training.distributed import init_data_parallel, resolve_device
from agent_loop.training.lora import merged_state_dict
from agent_loop.training.policy import PolicyModel, load_policy
from agent_loop.training.ppo import PPO
from agent_loop.training.resume import load_trainer_state, save_checkpoint, starting_point, trainer_state
from agent_loop.training.rollout_backend import make_rollout_backend
from agent_loop.training.step_rollouts import StepRollouts, first_group, training_batch, usable_episodes
from agent_loop.training.transports import make_destination, make_transport
from masking.kinds import SpanKind

EVAL_SEED_OFFSET = 1_000_003  # held-out questions come from a different question stream


class Trainer:
    """Trains a causal LM on a task with multi-turn tool-calling rollouts (see the module docstring).

    ``backend``: the rollout backend (default: made from ``config``, ``agent_loop.training.rollout_backend``);
    any backend with ``update_weights(state_dict)`` works. ``weight_sync``: a ``WeightTransport`` that takes the
    weights instead (e.g. ``VLLMServerWeightSync`` for rollout servers shared by the ranks: rank 0 pushes, every
    rank waits). ``task``: any task object; default: the one ``config`` names.
    """

    def __init__(self, config: TrainConfig, backend=None, weight_sync=None, task=None):
        self.config = config = checked(config)  # the declarations and the rules: ValueError before anything loads
        if unstable := config.unstable_learning_rate():
            warnings.warn(unstable, stacklevel=2)
        self.threads = apply_threads(config.threads)
        self.dp = init_data_parallel(config.device, config.parallel, lora=config.lora_rank > 0)
        self.device = resolve_device(config.device, self.dp.local_rank)
        self.output_dir = Path(config.output_dir)
        start = starting_point(config, output_dir=self.output_dir, trim_metrics=self.dp.is_main)
        self.step, self.initial_model = start.step, start.initial_model
        # the policy and what trains it
        self.tokenizer = AutoTokenizer.from_pretrained(start.policy_path)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.estimator = get_estimator(config.estimator)
        dtype = getattr(torch, DTYPES[config.dtype])
        self.policy, self.value_head, reference = load_policy(
            start, lora=config.lora_rank and {"rank": config.lora_rank, "alpha": config.lora_alpha,
                                              "target_modules": config.lora_target_modules},
            needs_values=self.estimator.needs_values, reference_dtype=dtype if config.kl_coef > 0 else None,
            device=self.device)
        self.model = self.dp.wrap(PolicyModel(self.policy, self.value_head), self.device)  # DDP / FSDP2 / itself
        self.trained_parameters = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        self.optimizer = optimization.adamw(self.trained_parameters, config)
        self.ppo = PPO(self.model, self.optimizer, self.trained_parameters, reference=reference,
                       estimator=self.estimator, options=config, dp=self.dp, dtype=dtype, seed=config.seed)
        if start.state is not None:
            self.load_state_dict(start.state, source=start.folder)
        self._set_up_rollouts(start, backend=backend, weight_sync=weight_sync, task=task)
        self.logger = reports.run_logger(self.output_dir, fresh=start.state is None, main=self.dp.is_main,
                                         tensorboard=config.tensorboard, wandb_project=config.wandb_project,
                                         run_config=config.resolved())
        if self.dp.is_main:  # the rollout files after start.step moved aside: the numbering goes on
            rollout_files.move_aside_after(self.output_dir, start.step)
        self.warned: set[str] = set()  # error kinds already warned about (first message, once per run)
        self.eval_history: list[tuple[int, float]] = []  # (step, greedy held-out success)

    def _set_up_rollouts(self, start, *, backend, weight_sync, task) -> None:
        """The rollout backend, the weight transport to it (the weights pushed once, as ``start.step``), the
        question stream of the (grouped) task; with ``max_staleness`` the producer, from ``start.stream_position``."""
        config = self.config
        self.backend = backend or make_rollout_backend(
            config, start=start, policy=self.policy, device=self.device, processes=self.dp.world_size,
            threads=self.threads, output_dir=self.output_dir, pad_token_id=self.pad_token_id, announce=self.dp.is_main)
        self.rollout_backend = VersionedBackend(self.backend, version=start.step)  # each token's weights' version
        destination = make_destination(backend=self.backend, given=weight_sync,
                                       servers=config.server if backend is None else (),
                                       lora_policy=self.policy if config.lora_rank else None,
                                       folder=self.output_dir / "weight_sync",
                                       served_name=config.served_name(start.initial_model))
        self.transport = make_transport(destination, rollout_backend=self.rollout_backend, dp=self.dp)
        self.push_weights(start.step)
        self.base_task = task if task is not None else config.load()
        self.rollouts = StepRollouts(
            GroupedTask(self.base_task, config.group_size, question_seed=config.seed), self.rollout_backend,
            self.tokenizer, LoopConfig(**pick(LoopConfig, config)), options=config, dp=self.dp,
            next_group=first_group(start, config.prompts_per_step, asynchronous=config.max_staleness > 0))
        self.producer = None
        if config.max_staleness:
            self.start_producer(config.max_staleness, position=start.stream_position)

    def start_producer(self, max_staleness: int, *, position: dict | None = None) -> None:
        """Asynchronous rollouts from now on (``StepRollouts.start_producer``); the weights go through the
        producer's gate from now on."""
        self.producer = self.rollouts.start_producer(step=self.step, max_staleness=max_staleness, position=position)
        self.transport = make_transport(self.transport, rollout_backend=self.rollout_backend, dp=self.dp,
                                        asynchronous=True, producer=self.producer)

    def train_step(self) -> dict[str, float]:
        """Run one step (rollouts, scoring, updates, weight push); return its metrics."""
        started = time.perf_counter()
        trajectories, metrics, stale, filtered = self.rollouts.take(self.step)  # 1. rollouts
        played = trajectories + filtered  # every fresh episode, those --filter-groups set aside too
        rolled = time.perf_counter()
        metrics.update(reports.rollout_metrics(played))  # over every episode played: a failed one counts as a failure
        kept, dropped = usable_episodes(trajectories, self.config.group_size, self.estimator.needs_index)
        metrics.update(dropped)
        reports.warn_first_errors(played, self.warned, self.step + 1)
        if not any(SpanKind.ASSISTANT in t.spans for t in kept):
            return self._skip_step(metrics, played + stale, started, rolled)
        metrics["skipped_steps"] = 0.0
        batch = training_batch(kept, group_size=self.config.group_size, pad_token_id=self.pad_token_id,
                               device=self.device)  # 2. batch
        # asynchronous: tokens sampled by older weights (each token's logprob is that of the weights that
        # sampled it, Trajectory.policy_versions says which): the sampler's logprobs are the behaviour policy
        metrics.update(staleness_metrics(kept, self.step, self.config.max_staleness))
        metrics.update(self.ppo.score(batch, sampler_is_behaviour=metrics["staleness/max"] > 0))  # 3. score
        if warning := reports.no_signal_warning(kept, metrics, self.step + 1):
            warnings.warn(warning, stacklevel=2)
        metrics.update(self.ppo.update(batch, self.step))  # 4. update
        self._save_rollouts(played + stale, kept, batch)  # stale, filtered ones too (info): no episode unrecorded
        pushed = time.perf_counter()
        self.push_weights(self.step + 1, changed=metrics["skipped_updates"] < 1.0)  # 5. push (a skipped update:
        metrics["time/weight_sync_s"] = time.perf_counter() - pushed  # the same weights, only the version moves)
        self.step += 1
        done = time.perf_counter()
        metrics["time/train_s"], metrics["time/step_s"] = done - rolled, done - started
        if not self.rollouts.asynchronous:  # a per-session mean times the sessions
            sessions = len({t.session_id for t in played})
            metrics["assistant_tokens_per_s"] = metrics["assistant_tokens"] * sessions / (rolled - started)
        return metrics

    def _skip_step(self, metrics: dict[str, float], played: list, started: float, rolled: float) -> dict[str, float]:
        """A step with nothing to train on (every episode failed, or none has an ASSISTANT token): no update, no
        push (the weights did not change), a warning naming the first error; the step still counts, so the next
        step plays new questions instead of failing on the same ones forever."""
        metrics["skipped_steps"], metrics["lr"] = 1.0, self.ppo.lr_at(self.step)
        warnings.warn(reports.skipped_step_warning(played, metrics, self.step + 1), stacklevel=3)
        self._save_rollouts(played, [], None)
        self.push_weights(self.step + 1, changed=False)
        self.step += 1
        done = time.perf_counter()
        metrics.update({"time/train_s": done - rolled, "time/step_s": done - started})
        return metrics

    def _save_rollouts(self, trajectories, kept, batch) -> None:
        """Rank 0 writes this step's episodes with the returns and advantages the update used
        (``agent_loop.training.rollout_files``), when ``save_rollouts_every`` keeps the step."""
        step = self.step + 1
        if self.dp.is_main and rollout_files.keeps(step, self.config.save_rollouts_every):
            annotated = rollout_files.annotated(trajectories, kept, batch, step,
                                                rollout_files.made_with(self.config),
                                                rollout_files.anchor_groups(self.estimator, batch))
            rollout_files.write_step(self.output_dir, step, annotated)

    def push_weights(self, version: int | None = None, *, changed: bool = True) -> None:
        """The policy's weights, as ``version`` (default: the current step), through the weight transport.
        ``changed=False``: the weights are those already pushed (an update skipped), only the version moves. Every
        rank waits. A failed push raises (the next rollouts would otherwise sample a stale policy)."""
        version = self.step if version is None else version
        merge = changed and self.transport.takes_weights  # not for a LoRA adapter pushed alone (it reads the policy)
        weights = merged_state_dict(self.policy) if merge else ({} if changed else None)  # every rank: FSDP gathers
        self.transport.push(weights, version=version)
        self.dp.barrier()

    def evaluate(self, *, sampled: bool = False) -> dict[str, float]:
        """Success on ``eval_episodes`` held-out questions (the same questions, and with ``sampled`` the same
        sampling seeds, every time): greedy (``eval/success``, kept in ``eval_history``), or sampled at the
        rollouts' temperature (``eval/sampled_success``)."""
        loop_config = self.rollouts.loop_config
        loop_config = loop_config if sampled else dataclasses.replace(loop_config, temperature=0.0)
        metrics = reports.rollout_metrics(self.rollouts.play_held_out(self.base_task, range(self.config.eval_episodes),
                                                              loop_config, self.config.seed + EVAL_SEED_OFFSET))
        if not sampled:
            self.eval_history.append((self.step, metrics["success"]))
        prefix = "eval/sampled_" if sampled else "eval/"
        return {f"{prefix}success": metrics["success"], f"{prefix}turns": metrics["turns"]}

    def train(self) -> list[dict[str, float]]:
        """Steps until ``config.steps``: metrics to stdout and ``metrics.jsonl``, checkpoints every ``save_every``
        steps and at the end. Returns the metrics of the steps run."""
        config, history, main = self.config, [], self.dp.is_main
        figures = {"sampling": sampling_label(config.temperature), "episodes_per_step": config.episodes_per_step}
        if main:
            tqdm.write(reports.step_legend(**figures, eval_episodes=config.eval_episodes if config.eval_every else 0))
        if config.eval_every and self.step == 0:
            initial = self.evaluate()
            self.logger.log(0, initial)
            if main:
                tqdm.write(f"step    0 | eval {initial['eval/success']:.3f}")
        bar = tqdm(total=config.steps, initial=self.step, desc="train", unit="step", disable=not (config.progress and main))
        try:
            while self.step < config.steps:
                metrics = self.train_step()
                if config.eval_every and self.step % config.eval_every == 0:
                    metrics.update(self.evaluate())
                self.logger.log(self.step, metrics)
                history.append(metrics)
                if main:
                    tqdm.write(reports.compact_line(self.step, metrics))
                bar.update()
                bar.set_postfix(success=f"{metrics['success']:.3f}")
                if self.step % config.save_every == 0 or self.step == config.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.rollouts.close()
            self.logger.close()
        self.closing_line = reports.progress_summary(history, **figures, evaluations=self.eval_history,
                                             eval_episodes=config.eval_episodes)  # sampled and held-out success
        return history

    def save_checkpoint(self) -> Path:
        """The step's checkpoint (``agent_loop.training.resume.save_checkpoint``): every rank calls it."""
        return save_checkpoint(checkpoint.step_folder(self.output_dir, self.step), step=self.step, dp=self.dp,
                               state=self.state_dict(), policy=self.policy, tokenizer=self.tokenizer,
                               trained_parameters=self.trained_parameters)

    def state_dict(self) -> dict:
        """What a resume needs besides the weights (``agent_loop.training.resume.trainer_state``)."""
        return trainer_state(step=self.step, optimizer=self.optimizer, value_head=self.value_head,
                             initial_model=self.initial_model, config=self.config.resolved(), rollouts=self.rollouts)

    def load_state_dict(self, state: dict, *, source: str | Path | None = None) -> None:
        """:meth:`state_dict`'s optimizer, value head, step and RNG states, checked finite (``source``: the
        checkpoint folder, named in errors)."""
        self.step = load_trainer_state(state, optimizer=self.optimizer, value_head=self.value_head,
                                       estimator_name=self.estimator.name, source=source)
