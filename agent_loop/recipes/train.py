"""The training loop: rollouts with the current policy -> batch -> rewards -> advantages -> PPO-clip updates.

One step (``Trainer.train_step``):

1. play ``prompts_per_step x group_size`` episodes with the rollout backend (``agent_loop.runners.local``);
2. collate them into the batch tensors of docs/design.md section 2 (``agent_loop.runners.batch``);
3. recompute the old logprobs with the training model, and report their mismatch with the sampler's;
4. token-level rewards: the outcome reward on each episode's last ASSISTANT token, minus an optional
   KL penalty to the frozen initial policy on every ASSISTANT token;
5. advantages by a registered estimator (``advantages.get_estimator``; REINFORCE++ with carry-through
   returns by default);
6. PPO-clip loss over ASSISTANT tokens only, ``ppo_epochs`` passes over shuffled mini-batches,
   gradient accumulation over micro-batches, gradient clipping, AdamW;
7. push the new weights to the rollout backend.

``config.device`` / ``config.dtype`` put the whole step on a GPU (bf16 autocast, fp32 master weights);
with several processes (``torchrun``), agent_loop/training/distributed.py says how the step is split. Rollouts can
run on vLLM servers that take the weights in place (``server``); every push goes through one interface,
``agent_loop.training.transports`` (in-process backend, vLLM servers, through the producer); ``lora_rank`` trains LoRA
adapters (agent_loop/training/lora.py); ``max_staleness`` K >= 1 trains asynchronously: a rollout producer keeps playing
while the trainer trains (``agent_loop.runners.producer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import agent_loop.training.checkpoint as checkpoint
import agent_loop.training.optimization as optimization
import agent_loop.training.rollout_files as rollout_files
from advantages import aggregate_loss, clipped_value_loss, get_estimator, kl_penalty, masked_mean, ppo_clip_policy_loss
from advantages.rollout_correction import correct_rollouts
from agent_loop.backends.base import BackendSettings
from agent_loop.backends.registry import make_backend
from agent_loop.backends.vllm_engine import engine_log
from agent_loop.config import checked, pick
from agent_loop.episode.config import LoopConfig
from agent_loop.models import model_path
from agent_loop.recipes.train_options import DTYPES, TrainConfig
from agent_loop.runners.backend_choice import AUTO, choose_backend
from agent_loop.runners.batch import estimator_arguments, trajectories_to_batch
from agent_loop.runners.group_filter import GroupSelection
from agent_loop.runners.local import run_rollouts
from agent_loop.runners.outputs import fresh_path
from agent_loop.runners.producer import RolloutProducer, VersionedBackend, staleness_metrics
from agent_loop.runners.stats import sampling_label
from agent_loop.tasks.grouping import GroupedTask
from agent_loop.threads import apply_threads
from agent_loop.training.distributed import (
    NullLogger,
    full_optimizer_state,
    full_state_dict,
    full_tensor,
    init_data_parallel,
    load_full_optimizer_state_,
    load_full_state_dict_,
    resolve_device,
)
from agent_loop.training.lora import load_adapter_weights, merged_state_dict, plain_copy, save_merged, wrap_with_lora
from agent_loop.training.metrics import (
    LOSS_STAT_NAMES,
    UPDATE_METRICS,
    MetricsLogger,
    compact_line,
    first_errors,
    masked_summary,
    progress_summary,
    rollout_metrics,
    scalars,
    step_legend,
)
from agent_loop.training.policy import PolicyModel, ValueHead, batch_logprobs, micro_batches, policy_outputs
from agent_loop.training.transports import make_destination, make_transport
from masking.batch import Batch
from masking.kinds import SpanKind

EVAL_SEED_OFFSET = 1_000_003  # held-out questions come from a different question stream


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) & 0x7FFFFFFF


def group_of(trajectory, group_size: int) -> int:
    """The question (group) an episode played: ``info["group"]``, or from its index where the record of a
    failed episode lacks it (``GroupedTask``: episode ``i`` plays question ``i // group_size``)."""
    return trajectory.info.get("group", trajectory.info["index"] // group_size)


def usable_episodes(trajectories, group_size: int, grouped: bool) -> tuple[list, dict[str, float]]:
    """The records a step trains on, and how many episodes (sessions) were dropped (``episodes/dropped_failed``,
    ``episodes/dropped_lone``).

    A session counts once, whatever its number of segments (:attr:`Trajectory.session_id`). A failed one (a
    record with finish ``error``: its reward, the backend or the prompt raised) has no true reward: every segment
    of it is dropped. For a group-relative estimator (``grouped``) the other sessions of its group are kept, their
    baseline taken over the survivors (mean, std and leave-one-out are defined for any group of 2 or more); a
    session left *alone* by its group's failures is dropped too, since the estimators' group-of-one rule would
    train on its raw score as if it had a baseline of 0.
    """
    failed = {t.session_id for t in trajectories if t.finish_reason == "error"}
    kept = [t for t in trajectories if t.session_id not in failed]
    dropped = {"episodes/dropped_failed": float(len(failed)), "episodes/dropped_lone": 0.0}
    if grouped and group_size > 1:
        sessions: dict[int, set[str]] = defaultdict(set)
        for t in kept:
            sessions[group_of(t, group_size)].add(t.session_id)
        lone = {group for group, members in sessions.items() if len(members) == 1}
        kept = [t for t in kept if group_of(t, group_size) not in lone]
        dropped["episodes/dropped_lone"] = float(len(lone))
    return kept, dropped


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts (``Trainer._starting_point``): step 0, or a checkpoint's state, and what follows from it."""

    step: int
    initial_model: str  # the run's starting policy: the KL reference, and (LoRA) the frozen base
    policy_path: str  # the folder the policy loads from
    state: dict | None = None  # the checkpoint's trainer state (Trainer.state_dict), None: a fresh run
    folder: Path | None = None  # the checkpoint folder
    stream_position: dict | None = None  # an asynchronous run's question stream (RolloutProducer.position)
    next_group: int | None = None  # a synchronous run's first question never played (None: step x prompts_per_step)


class Trainer:
    """Trains a causal LM on a task with multi-turn tool-calling rollouts (see the module docstring).

    ``backend`` defaults to an in-process ``TransformersBackend`` over a copy of the policy (or, with
    ``server``, the HTTP backend over them); any backend with ``update_weights(state_dict)`` works
    (the trainer pushes weights after each step). Under torchrun every rank has its own ``backend``;
    ``weight_sync`` (a ``agent_loop.training.transports.WeightTransport``, e.g. ``VLLMServerWeightSync`` for rollout
    servers shared by the ranks, or an older object with ``update_weights``) takes the weights instead: rank 0
    pushes, every rank waits for it. ``task``: any task object; default: the one ``config`` names.

    The recipe (:meth:`train_step`): rollouts -> batch -> score -> update -> push; the parts live in the
    library (runners, masking, advantages, agent_loop.training.transports, agent_loop.training.checkpoint).
    """

    def __init__(self, config: TrainConfig, backend=None, weight_sync=None, task=None):
        self.config = config = checked(config)  # the declarations and the rules: ValueError before anything loads
        if unstable := config.unstable_learning_rate():
            warnings.warn(unstable, stacklevel=2)
        # the set-up, step by step; each step's inputs are its arguments, nothing is read that a later step sets
        self._set_up_processes()  # -> dp, device, dtype, estimator, output_dir
        start = self._starting_point()  # -> where the run starts: step 0, or a checkpoint's state
        self.step, self.initial_model = start.step, start.initial_model
        self._set_up_models(start)  # -> tokenizer, policy, value_head, reference, model, optimizer (+ start.state)
        self._set_up_rollouts(start, backend=backend, weight_sync=weight_sync, task=task)  # -> backend, transport, task
        self._set_up_logging(start)  # -> logger, eval_history

    def _set_up_processes(self) -> None:
        """Threads, data-parallel ranks, device and dtype, the estimator, the output folder."""
        config = self.config
        self.threads = apply_threads(config.threads)  # the one threads rule (agent_loop.threads)
        self.dp = init_data_parallel(config.device, config.parallel, lora=config.lora_rank > 0)
        self.device = resolve_device(config.device, self.dp.local_rank)
        self.dtype = getattr(torch, DTYPES[config.dtype])
        self.estimator = get_estimator(config.estimator)
        self.output_dir = Path(config.output_dir)

    def _starting_point(self) -> Start:
        """Where the run starts: step 0 from ``config.model``, or (``config.resume``) the checkpoint's state,
        its settings checked against ``config``, the metrics after its step trimmed (rank 0)."""
        config = self.config
        initial_model = model_path(config.model, config.tiny_stage)
        if not config.resume:
            return Start(step=0, initial_model=initial_model, policy_path=initial_model)
        folder = checkpoint.resolve_checkpoint(config.resume)
        state = checkpoint.load_state(folder)
        checkpoint.check_settings(state["config"], config)
        if self.dp.is_main:
            checkpoint.trim_metrics(self.output_dir / "metrics.jsonl", state["step"])  # no step logged twice
        # the KL reference stays the run's starting policy; LoRA: the frozen base is it too, the adapter is in adapter/
        initial_model = state["initial_model"]
        return Start(step=state["step"], initial_model=initial_model, state=state, folder=folder,
                     policy_path=initial_model if config.lora_rank else str(folder / "model"),
                     stream_position=state.get("producer"),  # None: synchronous (or an older checkpoint)
                     next_group=state.get("next_group"))  # None: asynchronous (or an older checkpoint)

    def _set_up_models(self, start: Start) -> None:
        """Tokenizer, policy (LoRA-wrapped), value head, frozen reference, the data-parallel model, AdamW; resumed:
        the checkpoint's adapter, optimizer, value head and RNG states (:meth:`load_state_dict`)."""
        config = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(start.policy_path)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.policy = AutoModelForCausalLM.from_pretrained(start.policy_path, dtype=torch.float32).to(self.device).train()
        if config.lora_rank:
            self.policy = wrap_with_lora(self.policy, config.lora_rank, config.lora_alpha, config.lora_target_modules)
            if start.state is not None:
                load_adapter_weights(self.policy, start.folder / "adapter")
        if start.state is not None:  # NaN weights would pass the load and fail steps later; checked before any sharding
            checkpoint.check_finite(((name, p.detach()) for name, p in self.policy.named_parameters()),
                                    f"checkpoint {start.folder} (its weights)")
        self.value_head = ValueHead(self.policy.config.hidden_size).to(self.device) if self.estimator.needs_values else None
        self.reference = None
        if config.kl_coef > 0:
            reference = AutoModelForCausalLM.from_pretrained(start.initial_model, dtype=self.dtype).to(self.device).eval()
            self.reference = PolicyModel(reference.requires_grad_(False))
        # the whole forward as one module, in the data-parallel wrapper (DDP / FSDP2; itself in one process)
        self.model = self.dp.wrap(PolicyModel(self.policy, self.value_head), self.device)
        self.trained_parameters = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        self.optimizer = optimization.adamw(self.trained_parameters, config)
        if start.state is not None:
            self.load_state_dict(start.state, source=start.folder)

    def _set_up_rollouts(self, start: Start, *, backend, weight_sync, task) -> None:
        """The rollout backend, the weight transport to it (the weights pushed once, as ``start.step``), the
        (grouped) task, the loop's options; with ``max_staleness`` the producer, from ``start.stream_position``."""
        config = self.config
        servers = config.server if backend is None else ()  # the trainer's own HTTP backend over --server
        if servers:
            backend = make_backend("http", config.served_name(start.initial_model), BackendSettings.from_options(config))
        if backend is None and self.rollout_backend_name(start) == "vllm":  # the engine loads the policy's folder;
            log = engine_log(fresh_path(str(self.output_dir / "vllm.log")), verbose=config.verbose)  # its logs
            backend = make_backend("vllm", start.policy_path, BackendSettings(  # pushed below (LoRA: the base, the
                threads=self.threads, engine_log=log and str(log), dtype=config.rollout_torch_dtype(),
                lora_rank=config.lora_rank))  # adapter pushed alone: agent_loop.training.transports.engine_lora)
        if backend is None:
            backend = make_backend("hf", plain_copy(self.policy), BackendSettings(
                device=str(self.device), dtype=config.rollout_torch_dtype(config.dtype), max_batch_size=config.concurrency,
                pad_token_id=self.pad_token_id))
        self.backend = backend
        self.rollout_backend = VersionedBackend(backend, version=start.step)  # stamps each token with its weights' version
        destination = make_destination(backend=backend, given=weight_sync, servers=servers,
                                       lora_policy=self.policy if config.lora_rank else None,
                                       folder=self.output_dir / "weight_sync",
                                       served_name=config.served_name(start.initial_model))
        self.transport = make_transport(destination, rollout_backend=self.rollout_backend, dp=self.dp)
        self.producer, self.asynchronous = None, False
        self.push_weights(start.step)
        # the synchronous question stream: step x prompts_per_step, unless --filter-groups played extra rounds
        self.next_group = start.step * config.prompts_per_step if start.next_group is None else start.next_group
        self.base_task = task if task is not None else config.load()
        self.task = GroupedTask(self.base_task, config.group_size, question_seed=config.seed)
        self.loop_config = LoopConfig(**pick(LoopConfig, config))
        if config.max_staleness:
            self.start_producer(config.max_staleness, position=start.stream_position)
        elif start.stream_position is not None:
            warnings.warn(f"resume: an asynchronous checkpoint resumed synchronously (--max-staleness 0): the question "
                          f"stream restarts at step {start.step} x prompts_per_step, not where its producer stood "
                          f"(group {start.stream_position['next_group']})", stacklevel=3)

    def rollout_backend_name(self, start: Start) -> str:
        """``--backend``, with ``auto`` chosen by ``agent_loop.runners.backend_choice`` (one line on stderr, rank 0, when a
        real model falls back to transformers or plays on vLLM)."""
        if self.config.backend != AUTO:
            return self.config.backend
        name, note = choose_backend(start.policy_path, lora_rank=self.config.lora_rank,
                                    processes=self.dp.world_size, device=str(self.device))
        if note and self.dp.is_main:
            print(f"agent-loop train: {note}", file=sys.stderr, flush=True)
        return name

    def start_producer(self, max_staleness: int, *, position: dict | None = None) -> None:
        """Asynchronous rollouts from now on (``max_staleness`` >= 1 calls it at set-up): rank 0 starts a
        ``RolloutProducer`` (agent_loop.runners.producer) over this trainer's rollout backend, at most
        ``max_staleness`` versions ahead of the trainer, and every step takes its episodes from it (rank 0
        broadcasts them); the weights are pushed through it from now on. With 0 it plays exactly the synchronous
        steps' episodes with the same weights (tests/training/test_async_training.py). ``position``: a resumed
        run's question stream (a checkpoint's ``producer``): it goes on from there, no question twice."""
        config, self.asynchronous = self.config, True
        if self.dp.is_main:
            self.producer = RolloutProducer(
                self.task, self.rollout_backend, self.tokenizer, self.loop_config, seed=config.seed,
                concurrency=config.concurrency, group_size=config.group_size, groups_per_step=config.prompts_per_step,
                max_staleness=max_staleness, first_step=self.step, last_step=config.steps, position=position,
                filter_rounds=config.filter_groups_max_rounds if config.filter_groups else None)
        self.transport = make_transport(self.transport, rollout_backend=self.rollout_backend, dp=self.dp,
                                        asynchronous=True, producer=self.producer)

    def _set_up_logging(self, start: Start) -> None:
        """Metrics (rank 0), the rollout files after ``start.step`` moved aside, the evaluation history."""
        config = self.config
        if self.dp.is_main:
            self.logger = MetricsLogger(self.output_dir, fresh=start.state is None, tensorboard=config.tensorboard,
                                        wandb_project=config.wandb_project, run_config=config.resolved())
            rollout_files.move_aside_after(self.output_dir, start.step)  # numbering goes on without duplicates
        else:
            self.logger = NullLogger(self.output_dir / "metrics.jsonl")
        self._warned: set[str] = set()  # error kinds already warned about (first message, once per run)
        self.eval_history: list[tuple[int, float]] = []  # (step, greedy held-out success)

    # --- one step ------------------------------------------------------------------------------------

    def rollouts(self, step: int):
        """The episodes of ``step`` without dynamic sampling: questions ``step * P ... (step + 1) * P - 1``."""
        return self.play_groups(step * self.config.prompts_per_step)

    def play_groups(self, first: int):
        """The episodes of questions ``first ... first + P - 1`` (P: ``prompts_per_step``), ``group_size`` samples
        each (with several ranks, each plays its share and all get every episode, in order)."""
        n = self.config.group_size
        return self.dp.gather_trajectories(asyncio.run(self._play(
            self.task, self.dp.shard(range(first * n, (first + self.config.prompts_per_step) * n)), self.loop_config,
            self.config.seed)))

    async def _play(self, task, episodes, loop_config, seed):
        """``run_rollouts`` on the (versioned) backend, which ends the run on it (HTTP pools live in one event
        loop) unless the producer's loop holds it."""
        if self.config.agent:  # the user's own agent, through an in-process recording proxy (docs/agents.md)
            from agent_loop.proxy.agents import agent_rollouts

            return await agent_rollouts(task, self.rollout_backend, self.tokenizer, episodes, loop_config, seed=seed,
                                        agent=self.config.agent, concurrency=self.config.concurrency,
                                        timeout_s=self.config.agent_timeout_s)
        return await run_rollouts(task, self.rollout_backend, self.tokenizer, episodes, loop_config, seed=seed,
                                  concurrency=self.config.concurrency, progress=False)

    def step_episodes(self) -> tuple[list, dict[str, float], list, list]:
        """This step's episodes, how they were handed over (``time/idle_s``: the trainer waited for them,
        ``episodes/dropped_stale``, ``producer/episodes_per_s``; asynchronously also ``producer/in_flight``,
        ``producer/waiting``; with ``filter_groups`` the step's ``filter_groups/*``), the episodes dropped as
        stale (rank 0, for the step's rollouts file) and those dynamic sampling set aside (``info["filtered"]``).
        Synchronous: played now (:meth:`play_next`); asynchronous: taken from the producer by rank 0 and broadcast."""
        if self.asynchronous:
            taken, dropped, metrics = self.producer.take(self.step) if self.dp.is_main else (None, [], None)
            stale = [t for t in dropped if "filtered" not in t.info]
            filtered = [t for t in dropped if "filtered" in t.info] if self.dp.is_main else None
            taken, metrics, filtered = self.dp.broadcast_object((taken, metrics, filtered))
            return taken, metrics, stale, filtered
        started = time.perf_counter()
        if not self.config.filter_groups:
            played = self.play_next()
            return played, self._handed_over(played, started), [], []
        # dynamic sampling: rounds of fresh questions until the batch holds prompts_per_step groups, or the bound
        selection = GroupSelection(self.config.prompts_per_step, self.config.filter_groups_max_rounds)
        while not selection.done:
            groups = self._groups(self.play_next())
            for group in sorted(groups):
                selection.offer(groups[group])
        kept = selection.trajectories()
        return kept, self._handed_over(kept + selection.set_aside, started) | selection.metrics(), [], selection.set_aside

    def play_next(self) -> list:
        """The next ``prompts_per_step`` questions of the synchronous stream (:meth:`play_groups`)."""
        first, self.next_group = self.next_group, self.next_group + self.config.prompts_per_step
        return self.play_groups(first)

    def _groups(self, trajectories) -> dict[int, list]:
        """``trajectories`` by their question (group), each group's members in order."""
        groups: dict[int, list] = defaultdict(list)
        for trajectory in trajectories:
            groups[group_of(trajectory, self.config.group_size)].append(trajectory)
        return groups

    @staticmethod
    def _handed_over(played, started: float) -> dict[str, float]:
        """A synchronous step's hand-over metrics: the trainer waited for every episode it played."""
        waited = time.perf_counter() - started
        return {"time/idle_s": waited, "time/rollout_s": waited, "episodes/dropped_stale": 0.0,
                "producer/episodes_per_s": len(played) / max(waited, 1e-9)}

    def make_batch(self, trajectories) -> Batch:
        """Collated tensors plus ``index`` (b,), the group id of each row (and, where an agent rewrote its history,
        ``session``/``segment``: a session is one sample to the estimator)."""
        groups = [group_of(t, self.config.group_size) for t in trajectories]
        batch = trajectories_to_batch(trajectories, pad_token_id=self.pad_token_id, index=groups)
        batch.index = torch.tensor(groups, dtype=torch.long)
        return batch.to(self.device)

    def autocast(self):
        """bf16 autocast for forward passes when ``dtype`` is bf16 (weights and optimizer stay fp32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def batch_logprobs(self, model, batch: Batch, values: bool = False):
        """``agent_loop.training.policy.batch_logprobs`` of the whole batch; with several ranks each scores its micro-batches."""
        with self.autocast():
            logprobs, values = batch_logprobs(model, batch, self.config.micro_batch_size, values=values,
                                              shard=self.dp.shard_of)
        return self.dp.sum_rows_(logprobs), self.dp.sum_rows_(values)

    def score(self, batch: Batch, *, sampler_is_behaviour: bool = False) -> dict[str, float]:
        """Fill in ``old_logprobs`` (recomputed), ``values``, ``token_level_rewards`` (with KL), ``advantages``, ``returns``.

        Returns metrics: logprob mismatch between sampler and trainer (``mismatch/*``), KL to the reference,
        advantage and return statistics. ``sampler_is_behaviour`` (off-policy steps) keeps the sampler's logprobs
        as ``old_logprobs`` whatever ``recompute_old_logprobs`` says (the policy has moved since they were
        sampled), unless the mismatch is corrected (``rollout_is`` / ``rollout_rs``): then ``old_logprobs`` are
        the recomputed ones and the importance weights correct the sampler's (the decoupled objective,
        advantages/rollout_correction.py). The sampler's stay in ``rollout_logprobs``; the loss covers
        ``loss_mask``: ``response_mask`` (which the advantages see whole) less the tokens ``rollout_rs`` rejected.
        """
        config, mask = self.config, batch.response_mask
        metrics = {}
        recomputed, values = self.batch_logprobs(self.model, batch, values=self.value_head is not None)
        if batch.rollout_logprobs is None:
            batch.rollout_logprobs = batch.old_logprobs
        mismatch = (recomputed - batch.rollout_logprobs).abs()
        metrics["logprob_mismatch/mean_abs"] = masked_mean(mismatch, mask).item()
        metrics["logprob_mismatch/max_abs"] = torch.where(mask.bool(), mismatch, 0.0).max().item()
        correction = correct_rollouts(recomputed, batch.rollout_logprobs, mask, **config.rollout_correction_options())
        metrics.update(scalars(correction.metrics))
        if config.recompute_old_logprobs and (config.corrects_rollouts or not sampler_is_behaviour):
            batch.old_logprobs = recomputed
        batch.rollout_is_weights = correction.weights
        if values is not None:
            batch.values = values

        rewards = batch.token_level_rewards
        if self.reference is not None:
            ref_logprobs, _ = self.batch_logprobs(self.reference, batch)
            kl = kl_penalty(batch.old_logprobs, ref_logprobs, config.kl_kind, response_mask=mask)
            metrics["ref_kl"] = masked_mean(kl, mask).item()
            rewards = rewards - config.kl_coef * kl
            batch.token_level_rewards = rewards

        estimator = self.estimator  # the batch fields it accepts (spans, index, values, turn ids, ...), its settings
        settings = {name: getattr(config, name) for name in estimator.hyperparameters if hasattr(config, name)}
        advantages, returns = estimator(rewards, mask, **estimator_arguments(estimator, batch), **settings)
        batch.advantages, batch.returns = advantages, returns
        metrics.update(masked_summary("advantages", advantages, mask))
        metrics.update(masked_summary("returns", returns, mask))
        batch.loss_mask = correction.loss_mask  # less the tokens --rollout-rs rejected; response_mask stays whole
        return metrics

    def micro_batch_loss(self, micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-clip loss (plus the value loss for GAE, minus an entropy bonus) of one micro-batch, token-mean over its ASSISTANT tokens."""
        config, mask = self.config, micro.trained_mask
        with self.autocast():
            logprobs, entropy, values = policy_outputs(self.model, micro)
        loss, stats = ppo_clip_policy_loss(micro.old_logprobs, logprobs, micro.advantages, mask,
                                           clip_ratio=config.clip_ratio, rollout_is_weights=micro.rollout_is_weights)
        stats = {LOSS_STAT_NAMES.get(name, name): value for name, value in stats.items()}  # the logged names
        stats["pg_loss"] = loss.detach()
        stats["entropy"] = masked_mean(entropy.detach(), mask)
        if config.entropy_coef:
            loss = loss - config.entropy_coef * aggregate_loss(entropy, mask)  # the bonus: entropy_loss from entropies
        if values is not None:  # unclipped: an infinite clip range
            value_loss, _ = clipped_value_loss(values, micro.returns, micro.values, mask, float("inf"))
            stats["value_loss"] = value_loss.detach()
            loss = loss + config.value_coef * value_loss
        return loss, stats

    def mini_batch_step(self, batch: Batch, rows: torch.Tensor) -> dict[str, float]:
        """One AdamW step on the rows ``rows`` of ``batch``: the loss is the token-mean over all their
        ASSISTANT tokens, accumulated over micro-batches; the gradient is clipped. Returns its stats
        (empty if the rows have no ASSISTANT token). With several ranks each runs its share of ``rows``
        and the gradients and stats are summed over the ranks (agent_loop/training/distributed.py)."""
        tokens = batch.trained_mask[rows].sum()
        if tokens == 0:
            return {}
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = defaultdict(float)
        micros = list(micro_batches(batch, rows, self.config.micro_batch_size, shard=self.dp.shard_of))
        for number, (part, micro) in enumerate(micros):
            weight = micro.trained_mask.sum() / tokens if part is not None else 0
            with self.dp.accumulate(self.model, sync=number == len(micros) - 1):
                if weight == 0:  # a stand-in, or no ASSISTANT token: a forward and backward adding 0 (ranks paired)
                    with self.autocast():
                        outputs = policy_outputs(self.model, micro, entropy=False)
                    sum(output.sum() for output in outputs if output is not None).mul(0.0).backward()
                    continue
                loss, micro_stats = self.micro_batch_loss(micro)
                (loss * weight).backward()
            for name, value in {"loss": loss.detach(), **micro_stats}.items():
                stats[name] += (value * weight).item()
        stats = self.dp.sum_stats(stats)
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.trained_parameters, self.config.max_grad_norm))
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
        return optimization.lr_at(step, peak=self.config.learning_rate, warmup_steps=self.config.warmup_steps)

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes over the batch in shuffled mini-batches, one AdamW step each; returns the
        mean of their stats and ``loss/first``, the first mini-batch's loss (before any step: a function of
        the weights and the batch only)."""
        config = self.config
        lr = optimization.set_lr(self.optimizer, self.lr_at(step))
        generator = torch.Generator().manual_seed(_step_seed(config.seed, step))
        history: dict[str, list[float]] = defaultdict(list)
        for _ in range(config.ppo_epochs):
            order = torch.randperm(batch.responses.shape[0], generator=generator).to(self.device)
            for rows in order.chunk(config.mini_batches):
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

    def train_step(self) -> dict[str, float]:
        """Run one step (rollouts, scoring, updates, weight push); return its metrics."""
        started = time.perf_counter()
        trajectories, metrics, stale, filtered = self.step_episodes()
        played = trajectories + filtered  # every fresh episode, those --filter-groups set aside too
        rolled = time.perf_counter()
        metrics.update(rollout_metrics(played))  # over every episode played: a failed one counts as a failure
        kept, dropped = usable_episodes(trajectories, self.config.group_size, self.estimator.needs_index)
        metrics.update(dropped)
        self._warn_errors(played)
        if not any(SpanKind.ASSISTANT in t.spans for t in kept):
            return self._skip_step(metrics, played + stale, started, rolled)
        metrics["skipped_steps"] = 0.0
        batch = self.make_batch(kept)
        # asynchronous: tokens sampled by older weights (each token's logprob is that of the weights that
        # sampled it, Trajectory.policy_versions says which): the sampler's logprobs are the behaviour policy
        metrics.update(staleness_metrics(kept, self.step, self.config.max_staleness))
        metrics.update(self.score(batch, sampler_is_behaviour=metrics["staleness/max"] > 0))
        self._warn_no_signal(kept, metrics)
        metrics.update(self.update(batch, self.step))
        self.save_rollouts(played + stale, kept, batch)  # stale, filtered ones too (info): no episode unrecorded
        pushed = time.perf_counter()
        # no AdamW step taken: the weights did not change, only their version moves
        self.push_weights(self.step + 1, changed=metrics["skipped_updates"] < 1.0)
        metrics["time/weight_sync_s"] = time.perf_counter() - pushed
        self.step += 1
        done = time.perf_counter()
        metrics["time/train_s"] = done - rolled
        metrics["time/step_s"] = done - started
        if not self.asynchronous:
            metrics["assistant_tokens_per_s"] = (  # a per-session mean times the sessions
                metrics["assistant_tokens"] * len({t.session_id for t in played}) / (rolled - started))
        return metrics

    def _warn_errors(self, trajectories) -> None:
        """Warn once per run per kind (reward, tool, template) with its first message; the counts are in metrics."""
        for kind, message in first_errors(trajectories).items():
            if kind not in self._warned:
                self._warned.add(kind)
                warnings.warn(f"step {self.step + 1}: first {kind} error (counted each step as errors/{kind}; "
                              f"warned once): {message[:300]}", stacklevel=3)

    def _warn_no_signal(self, kept, metrics: dict[str, float]) -> None:
        """Warn when every advantage of the step is 0 (no learning signal), saying why."""
        if metrics.get("advantages/min", 0.0) != 0.0 or metrics.get("advantages/max", 0.0) != 0.0:
            return
        rewards = {t.reward for t in kept}
        reasons = []
        if len(rewards) == 1:
            reasons.append(f"all {len(kept)} rewards equal ({next(iter(rewards)):g})")
        if all(t.truncated for t in kept):
            reasons.append("every episode was truncated (hit --max-tokens / --max-response-tokens / --max-turns)")
        warnings.warn(f"step {self.step + 1} has no learning signal: every advantage is 0"
                      + (f" ({'; '.join(reasons)})" if reasons else ""), stacklevel=3)

    def _skip_step(self, metrics: dict[str, float], played: list, started: float, rolled: float) -> dict[str, float]:
        """A step with nothing to train on (every episode failed, or none has an ASSISTANT token): no update,
        no push (the weights did not change), a warning naming the first error; the step still counts, so the
        next step plays new questions instead of failing on the same ones forever."""
        metrics["skipped_steps"], metrics["lr"] = 1.0, self.lr_at(self.step)
        first = next((t.metrics.get("error", "") for t in played if t.finish_reason == "error"), "")
        filtered = sum("filtered" in t.info for t in played)
        warnings.warn(f"step {self.step + 1} skipped: none of its {len(played)} episodes can be trained on "
                      f"({metrics['episodes/dropped_failed']:.0f} failed, {metrics['episodes/dropped_lone']:.0f} "
                      f"left alone in their group, " + (f"{filtered} set aside by --filter-groups, " if filtered else "")
                      + "the rest without an ASSISTANT token)" + (f"; the first error: {first[:300]}" if first else ""),
                      stacklevel=3)
        self.save_rollouts(played, [], None)
        self.push_weights(self.step + 1, changed=False)
        self.step += 1
        done = time.perf_counter()
        metrics.update({"time/train_s": done - rolled, "time/step_s": done - started})
        return metrics

    def save_rollouts(self, trajectories, kept, batch) -> None:
        """Rank 0 writes this step's episodes (every rank's) with the returns and advantages the update used
        (``agent_loop.training.rollout_files``), when ``save_rollouts_every`` keeps the step."""
        step = self.step + 1
        if self.dp.is_main and rollout_files.keeps(step, self.config.save_rollouts_every):
            how = rollout_files.made_with(self.config, self.estimator)
            anchors = rollout_files.anchor_groups(self.estimator, batch)  # gigpo: the group each turn joined
            rollout_files.write_step(self.output_dir, step,
                                     rollout_files.annotated(trajectories, kept, batch, step, how, anchors))

    def push_weights(self, version: int | None = None, *, changed: bool = True) -> None:
        """The policy's weights, as ``version`` (default: the current step), through the weight transport
        (``agent_loop.training.transports``: this rank's backend or the shared rollout servers, between runs or through the
        producer). ``changed=False``: the weights are those already pushed (an update skipped), only the version
        moves. Every rank waits. A failed push raises (the next rollouts would otherwise sample a stale policy)."""
        version = self.step if version is None else version
        merge = changed and self.transport.takes_weights  # not for a LoRA adapter pushed alone (it reads the policy)
        weights = merged_state_dict(self.policy) if merge else ({} if changed else None)  # every rank: FSDP gathers
        self.transport.push(weights, version=version)
        self.dp.barrier()

    def evaluate(self, *, sampled: bool = False) -> dict[str, float]:
        """Success on ``eval_episodes`` held-out questions (the same questions, and with ``sampled`` the same
        sampling seeds, every time): greedy (``eval/success``, kept in ``eval_history``), or sampled at the
        rollouts' temperature (``eval/sampled_success``)."""
        loop_config = self.loop_config if sampled else dataclasses.replace(self.loop_config, temperature=0.0)
        episodes, seed = range(self.config.eval_episodes), self.config.seed + EVAL_SEED_OFFSET
        if self.asynchronous:  # rank 0 plays them all on the producer's loop, where its backend lives
            played = self.producer.run(self._play(self.base_task, episodes, loop_config, seed)) if self.dp.is_main else None
            trajectories = self.dp.broadcast_object(played)
        else:
            trajectories = self.dp.gather_trajectories(asyncio.run(self._play(
                self.base_task, self.dp.shard(episodes), loop_config, seed)))
        metrics = rollout_metrics(trajectories)
        if not sampled:
            self.eval_history.append((self.step, metrics["success"]))
        prefix = "eval/sampled_" if sampled else "eval/"
        return {f"{prefix}success": metrics["success"], f"{prefix}turns": metrics["turns"]}

    # --- the run -------------------------------------------------------------------------------------

    def train(self) -> list[dict[str, float]]:
        """Steps until ``config.steps``: metrics to stdout and ``metrics.jsonl``, checkpoints every
        ``save_every`` steps and at the end. Returns the metrics of the steps run."""
        config = self.config
        history = []
        if self.dp.is_main:
            tqdm.write(step_legend(**self._figures(eval_episodes=config.eval_episodes if config.eval_every else 0)))
        if config.eval_every and self.step == 0:
            initial = self.evaluate()
            self.logger.log(0, initial)
            if self.dp.is_main:
                tqdm.write(f"step    0 | eval {initial['eval/success']:.3f}")
        bar = tqdm(total=config.steps, initial=self.step, desc="train", unit="step",
                   disable=not (config.progress and self.dp.is_main))
        try:
            while self.step < config.steps:
                metrics = self.train_step()
                if config.eval_every and self.step % config.eval_every == 0:
                    metrics.update(self.evaluate())
                self.logger.log(self.step, metrics)
                history.append(metrics)
                if self.dp.is_main:
                    tqdm.write(compact_line(self.step, metrics))
                bar.update()
                bar.set_postfix(success=f"{metrics['success']:.3f}")
                if self.step % config.save_every == 0 or self.step == config.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.close_producer()
            self.logger.close()
        return history

    def _figures(self, **more) -> dict:
        """What the training episodes' success figures are over: their sampling and count per step."""
        return {"sampling": sampling_label(self.loop_config.temperature),
                "episodes_per_step": self.config.episodes_per_step, **more}

    def summary(self, history: list[dict[str, float]]) -> str:
        """The run's closing line (:func:`~agent_loop.training.metrics.progress_summary`): the sampled success of ``history``
        and, when there was one, the greedy held-out evaluation of this run."""
        return progress_summary(history, **self._figures(evaluations=self.eval_history,
                                                         eval_episodes=self.config.eval_episodes))

    def close_producer(self) -> None:
        """Stop the asynchronous producer (its episodes in flight are cancelled); ``train`` does at its end."""
        if self.producer is not None:
            self.producer.close()

    # --- checkpoints ---------------------------------------------------------------------------------

    def checkpoint_dir(self, step: int) -> Path:
        return self.output_dir / "checkpoints" / f"step_{step:06d}"

    def save_checkpoint(self) -> Path:
        """``model/`` (a plain transformers model dir with its tokenizer) and ``trainer_state.pt``
        (:meth:`state_dict`), written atomically (``agent_loop.training.checkpoint.write_checkpoint``). With several
        ranks, rank 0 writes it (the replicas are checked equal first) and every rank returns once it is written."""
        path = self.checkpoint_dir(self.step)
        self.dp.check_replicas_equal(self.trained_parameters)
        state, weights = self.state_dict(), merged_state_dict(self.policy)  # every rank: FSDP shards are gathered

        def save_model(folder: Path) -> None:
            save_merged(self.policy, folder, weights)  # LoRA: merged weights, the adapter alone in adapter/
            self.tokenizer.save_pretrained(folder)

        if self.dp.is_main:
            checkpoint.write_checkpoint(path, step=self.step, state=state, save_model=save_model)
        self.dp.barrier()
        return path

    def state_dict(self) -> dict:
        """Everything a resume needs besides the weights, in types ``torch.load(weights_only=True)`` reads: step,
        optimizer (FSDP shards gathered: every rank must call it), value head, the starting model, the resolved
        config, RNG states and (asynchronous, rank 0) the producer's place in the question stream."""
        return {
            "step": self.step,
            "optimizer": full_optimizer_state(self.optimizer),
            "value_head": full_state_dict(self.value_head) if self.value_head else None,
            "initial_model": str(self.initial_model),
            "config": self.config.resolved(),  # plain, resolved values (the learning rate used)
            "rng": checkpoint.rng_state(),
            # None: synchronous, or another rank; absent from older checkpoints (the stream restarts at step x P)
            "producer": self.producer.position() if self.producer is not None else None,
            # synchronous: the first question never played (--filter-groups plays extra rounds); None: asynchronous
            "next_group": None if self.asynchronous else self.next_group,
        }

    def load_state_dict(self, state: dict, *, source: str | Path | None = None) -> None:
        """The optimizer, value head, step and RNG states of :meth:`state_dict` (a checkpoint's, old formats too),
        its weights and moments checked finite; ``source`` (the checkpoint folder) names it in errors. The
        producer's place in the question stream is ``state["producer"]`` (:meth:`start_producer` takes it)."""
        where = f"checkpoint {source}" if source is not None else "trainer state"
        checkpoint.check_finite(checkpoint.optimizer_tensors(state["optimizer"]), f"{where} ({checkpoint.STATE_FILE})")
        if state.get("value_head"):
            checkpoint.check_finite(state["value_head"].items(), f"{where} ({checkpoint.STATE_FILE}, value head)")
        self.step = state["step"]
        load_full_optimizer_state_(self.optimizer, state["optimizer"])
        if self.value_head is not None:
            if state["value_head"] is None:
                raise ValueError(f"{where} has no value head, but estimator {self.estimator.name!r} needs one")
            load_full_state_dict_(self.value_head, state["value_head"])
        checkpoint.set_rng_state(state["rng"])
