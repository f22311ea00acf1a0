"""The RL recipe (``agent-loop train``): set-up, then steps of rollouts -> batch -> score -> update -> push.

The set-up (:class:`Trainer`) reads as its steps: processes, where the run starts (``agent_loop.training.resume``),
the policy and the PPO step (``.policy``, ``.ppo``), the rollout backend, weight transport and question stream
(``.rollout_backend``, ``.transports``, ``.step_rollouts``). A step (:meth:`Trainer.train_step`):

1. **rollouts**: ``prompts_per_step x group_size`` episodes (synchronous, or from the asynchronous producer with
   ``max_staleness``; dynamic sampling with ``filter_groups``), the failed and the lone ones dropped;
2. **batch**: the tensors of docs/design.md section 2, sessions joined;
3. **score**: old logprobs recomputed (the mismatch with the sampler's reported, and corrected with
   ``rollout_is`` / ``rollout_rs``), the KL penalty, advantages by the registered estimator;
4. **update**: PPO-clip over ASSISTANT tokens, ``ppo_epochs`` passes of shuffled mini-batches, AdamW;
5. **push**: the new weights to the rollout backend; the episodes saved with their advantages; a checkpoint every
   ``save_every`` steps and at the end.
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
from agent_loop.options import checked
from agent_loop.recipes.train_options import TrainConfig
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
from agent_loop.training.run_options import DTYPES
from agent_loop.training.step_rollouts import StepRollouts, first_group, training_batch, usable_episodes
from agent_loop.training.transports import make_destination, make_transport
from agent_loop.types import count_sessions
from masking.kinds import SpanKind

EVAL_SEED_OFFSET = 1_000_003  # held-out questions come from a different question stream


class Trainer:
    """Trains a causal LM on a task with multi-turn tool-calling rollouts (see the module docstring). ``backend``:
    the rollout backend (default: made from ``config``); ``weight_sync``: a ``WeightTransport`` that takes the
    weights instead (e.g. ``VLLMServerWeightSync``: rollout servers the ranks share); ``task``: default, ``config``'s.
    """

    def __init__(self, config: TrainConfig, backend=None, weight_sync=None, task=None):
        self.config = config = checked(config)  # the declarations and the rules: ValueError before anything loads
        if unstable := config.unstable_learning_rate():
            warnings.warn(unstable, stacklevel=2)
        run, output = config.run, config.output
        self.threads = apply_threads(run.threads)
        self.dp = init_data_parallel(run.device, run.parallel, lora=run.lora_rank > 0)
        self.device = resolve_device(run.device, self.dp.local_rank)
        self.output_dir = Path(output.output_dir)
        start = starting_point(run.model, tiny_stage=run.tiny_stage, resume=output.resume, lora=run.lora_rank > 0,
                               settings=config.resolved(), resolve_saved=TrainConfig.resolve_saved,
                               allow_config_change=output.allow_config_change,
                               output_dir=self.output_dir, trim_metrics=self.dp.is_main)
        self.step, self.initial_model = start.step, start.initial_model
        self.tokenizer = AutoTokenizer.from_pretrained(start.policy_path)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.estimator = get_estimator(config.advantage.estimator)
        dtype, kl_coef = getattr(torch, DTYPES[run.dtype]), config.advantage.kl_coef
        self.policy, self.value_head, reference = load_policy(
            start, lora=run.lora(), needs_values=self.estimator.needs_values,
            reference_dtype=dtype if kl_coef > 0 else None, device=self.device)
        self.model = self.dp.wrap(PolicyModel(self.policy, self.value_head), self.device)  # DDP / FSDP2 / itself
        self.trained_parameters = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        self.optimizer = optimization.adamw(self.trained_parameters, config.update)
        self.ppo = PPO(self.model, self.optimizer, self.trained_parameters, reference=reference,
                       estimator=self.estimator, settings=config.advantage.estimator_settings(), options=config.update,
                       kl_coef=kl_coef, kl_kind=config.advantage.kl_kind, dp=self.dp, dtype=dtype, seed=run.seed)
        if start.state is not None:
            self.load_state_dict(start.state, source=start.folder)
        self._set_up_rollouts(start, backend=backend, weight_sync=weight_sync, task=task)
        self.logger = reports.run_logger(self.output_dir, fresh=start.state is None, main=self.dp.is_main,
                                         tensorboard=output.tensorboard, wandb_project=output.wandb_project,
                                         run_config=config.resolved())
        if self.dp.is_main:  # the rollout files after start.step moved aside: the numbering goes on
            rollout_files.move_aside_after(self.output_dir, start.step)
        self.warned: set[str] = set()  # error kinds already warned about (first message, once per run)
        self.eval_history: list[tuple[int, float]] = []  # (step, greedy held-out success)

    def _set_up_rollouts(self, start, *, backend, weight_sync, task) -> None:
        """The rollout backend, the weight transport to it (the weights pushed once, as ``start.step``), the
        question stream of the (grouped) task; with ``max_staleness`` the producer, from ``start.stream_position``."""
        run, rollout, sampler = self.config.run, self.config.rollout, self.config.sampler
        self.backend = backend if backend is not None else make_rollout_backend(
            sampler, start=start, policy=self.policy, lora_rank=run.lora_rank, train_dtype=run.dtype,
            concurrency=run.concurrency, device=self.device, processes=self.dp.world_size, threads=self.threads,
            output_dir=self.output_dir, pad_token_id=self.pad_token_id, verbose=self.config.output.verbose,
            announce=self.dp.is_main)
        self.rollout_backend = VersionedBackend(self.backend, version=start.step)  # each token's weights' version
        destination = make_destination(backend=self.backend, given=weight_sync,
                                       servers=sampler.server if backend is None else (),
                                       lora_policy=self.policy if run.lora_rank else None,
                                       folder=self.output_dir / "weight_sync",
                                       served_name=sampler.served_name(start.initial_model))
        self.transport = make_transport(destination, rollout_backend=self.rollout_backend, dp=self.dp)
        self.push_weights(start.step)
        self.base_task = task if task is not None else rollout.load()
        self.rollouts = StepRollouts(
            GroupedTask(self.base_task, run.group_size, question_seed=run.seed), self.rollout_backend, self.tokenizer,
            rollout.loop_config(), dp=self.dp, seed=run.seed, group_size=run.group_size,
            prompts_per_step=rollout.prompts_per_step, concurrency=run.concurrency,
            filter_rounds=rollout.filter_groups_max_rounds if rollout.filter_groups else None, agent=rollout.agent,
            agent_timeout_s=rollout.agent_timeout_s,
            next_group=first_group(start, rollout.prompts_per_step, asynchronous=rollout.max_staleness > 0))
        self.producer = None
        if rollout.max_staleness:
            self.start_producer(rollout.max_staleness, position=start.stream_position)

    def start_producer(self, max_staleness: int, *, position: dict | None = None) -> None:
        """Asynchronous rollouts from now on (``StepRollouts.start_producer``); the weights go through the
        producer's gate from now on."""
        self.producer = self.rollouts.start_producer(step=self.step, last_step=self.config.run.steps,
                                                     max_staleness=max_staleness, position=position)
        self.transport = make_transport(self.transport, rollout_backend=self.rollout_backend, dp=self.dp,
                                        asynchronous=True, producer=self.producer)

    def train_step(self) -> dict[str, float]:
        """Run one step (rollouts, scoring, updates, weight push); return its metrics. A step with nothing to train
        on (every episode failed, or none has an ASSISTANT token) updates nothing and says why; it still counts,
        so the next step plays new questions instead of failing on the same ones forever."""
        started = time.perf_counter()
        trajectories, metrics, stale, filtered = self.rollouts.take(self.step)  # 1. rollouts
        played, rolled = trajectories + filtered, time.perf_counter()  # filtered: those --filter-groups set aside
        metrics.update(reports.rollout_metrics(played))  # over every episode played: a failed one counts as a failure
        kept, dropped = usable_episodes(trajectories, self.config.run.group_size, self.estimator.needs_index)
        metrics.update(dropped)
        reports.warn_first_errors(played, self.warned, self.step + 1)
        trainable = any(SpanKind.ASSISTANT in t.spans for t in kept)
        batch = None
        if trainable:
            batch = training_batch(kept, group_size=self.config.run.group_size, pad_token_id=self.pad_token_id,
                                   device=self.device, credit=self.config.advantage.session_credit)  # 2. batch
            # asynchronous: tokens sampled by older weights (each token's logprob is that of the weights that
            # sampled it, Trajectory.policy_versions says which): the sampler's logprobs are the behaviour policy
            metrics.update(staleness_metrics(kept, self.step, self.config.rollout.max_staleness))
            metrics.update(self.ppo.score(batch, sampler_is_behaviour=metrics["staleness/max"] > 0))  # 3. score
            if warning := reports.no_signal_warning(kept, metrics, self.step + 1):
                warnings.warn(warning, stacklevel=2)
            metrics.update(self.ppo.update(batch, self.step))  # 4. update
        else:
            metrics.update({"skipped_updates": 1.0, "lr": self.ppo.lr_at(self.step)})
            warnings.warn(reports.skipped_step_warning(played + stale, metrics, self.step + 1), stacklevel=2)
        metrics["skipped_steps"] = float(not trainable)
        if self.dp.is_main and rollout_files.keeps(self.step + 1, self.config.output.save_rollouts_every):
            estimator = self.config.advantage  # the step's episodes (stale, filtered ones too) and its advantages
            made_with = rollout_files.made_with(estimator, self.config.rollout, estimator.kl_coef)
            rollout_files.write_step(self.output_dir, self.step + 1, rollout_files.annotated(
                played + stale, kept if trainable else [], batch, self.step + 1, made_with,
                rollout_files.anchor_groups(self.estimator, batch)))
        pushed = time.perf_counter()
        self.push_weights(self.step + 1, changed=metrics["skipped_updates"] < 1.0)  # 5. push (a skipped update:
        metrics["time/weight_sync_s"] = time.perf_counter() - pushed  # the same weights, only the version moves)
        self.step += 1
        done = time.perf_counter()
        metrics["time/train_s"], metrics["time/step_s"] = done - rolled, done - started
        if not self.rollouts.asynchronous:  # a per-session mean times the sessions
            metrics["assistant_tokens_per_s"] = metrics["assistant_tokens"] * count_sessions(played) / (rolled - started)
        return metrics

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
        played_with = self.rollouts.loop_config  # greedy: at temperature 0
        loop_config = played_with if sampled else dataclasses.replace(played_with, temperature=0.0)
        metrics = reports.rollout_metrics(self.rollouts.play_held_out(
            self.base_task, range(self.config.rollout.eval_episodes), loop_config, self.config.run.seed + EVAL_SEED_OFFSET))
        if not sampled:
            self.eval_history.append((self.step, metrics["success"]))
        prefix = "eval/sampled_" if sampled else "eval/"
        return {f"{prefix}success": metrics["success"], f"{prefix}turns": metrics["turns"]}

    def train(self) -> list[dict[str, float]]:
        """Steps until ``config.steps``: metrics to stdout and ``metrics.jsonl``, checkpoints every ``save_every``
        steps and at the end. Returns the metrics of the steps run."""
        run, rollout, output, history, main = self.config.run, self.config.rollout, self.config.output, [], self.dp.is_main
        figures = {"sampling": sampling_label(rollout.temperature), "episodes_per_step": self.config.episodes_per_step}
        if main:
            tqdm.write(reports.step_legend(**figures, eval_episodes=rollout.eval_episodes if rollout.eval_every else 0))
        if rollout.eval_every and self.step == 0:
            initial = self.evaluate()
            self.logger.log(0, initial)
            if main:
                tqdm.write(f"step    0 | eval {initial['eval/success']:.3f}")
        bar = tqdm(total=run.steps, initial=self.step, desc="train", unit="step", disable=not (output.progress and main))
        try:
            while self.step < run.steps:
                metrics = self.train_step()
                if rollout.eval_every and self.step % rollout.eval_every == 0:
                    metrics.update(self.evaluate())
                self.logger.log(self.step, metrics)
                history.append(metrics)
                if main:
                    tqdm.write(reports.compact_line(self.step, metrics))
                bar.update()
                bar.set_postfix(success=f"{metrics['success']:.3f}")
                if self.step % output.save_every == 0 or self.step == run.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.rollouts.close()
            self.logger.close()
        self.closing_line = reports.progress_summary(history, **figures, evaluations=self.eval_history,
                                                     eval_episodes=rollout.eval_episodes)  # sampled, held-out success
        return history

    def save_checkpoint(self) -> Path:
        """The step's checkpoint (``agent_loop.training.resume.save_checkpoint``): every rank calls it."""
        return save_checkpoint(checkpoint.step_folder(self.output_dir, self.step), step=self.step, dp=self.dp,
                               state=self.state_dict(), policy=self.policy, tokenizer=self.tokenizer,
                               trained_parameters=self.trained_parameters, keep=self.config.output.keep_checkpoints)

    def state_dict(self) -> dict:
        """What a resume needs besides the weights (``agent_loop.training.resume.trainer_state``)."""
        return trainer_state(step=self.step, optimizer=self.optimizer, value_head=self.value_head,
                             initial_model=self.initial_model, config=self.config.resolved(), rollouts=self.rollouts)

    def load_state_dict(self, state: dict, *, source: str | Path | None = None) -> None:
        """:meth:`state_dict`'s optimizer, value head, step and RNG states, checked finite (``source``: the
        checkpoint folder, named in errors)."""
        self.step = load_trainer_state(state, optimizer=self.optimizer, value_head=self.value_head,
                                       estimator_name=self.estimator.name, source=source)
