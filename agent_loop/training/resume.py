"""Where a training run starts: step 0 from its model, or a checkpoint's state (``--resume``); and the state a
checkpoint keeps besides the weights (:func:`trainer_state`, :func:`load_trainer_state`).

:func:`starting_point` reads and checks the checkpoint (its settings against the run's, the metrics after its step
trimmed) before any model loads; :class:`Start` says what follows from it: the step, the run's starting policy
(the KL reference and, with LoRA, the frozen base), the folder the policy loads from, the trainer state and the
place in the question stream.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import agent_loop.training.checkpoint as checkpoint
from agent_loop.model_folders import model_path
from agent_loop.training.distributed import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state_,
    load_full_state_dict_,
)
from agent_loop.training.lora import merged_state_dict, save_merged


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts: step 0, or a checkpoint's state, and what follows from it."""

    step: int
    initial_model: str  # the run's starting policy: the KL reference, and (LoRA) the frozen base
    policy_path: str  # the folder the policy loads from
    state: dict | None = None  # the checkpoint's trainer state (Trainer.state_dict), None: a fresh run
    folder: Path | None = None  # the checkpoint folder
    stream_position: dict | None = None  # an asynchronous run's question stream (RolloutProducer.position)
    next_group: int | None = None  # a synchronous run's first question never played (None: step x prompts_per_step)


def starting_point(model: str | None, *, tiny_stage: str, resume, lora: bool, settings: dict, resolve_saved,
                   allow_config_change: bool, output_dir: Path, trim_metrics: bool) -> Start:
    """Step 0 from ``model`` (``tiny_stage`` for the built-in tiny agent), or (``resume``) the checkpoint's
    state, its settings (resolved by ``resolve_saved``, e.g. ``TrainConfig.resolve_saved``) checked against the
    run's ``settings`` (``TrainConfig.resolved()``; a difference is refused unless ``allow_config_change``);
    ``lora``: the policy is the frozen base plus the checkpoint's adapter;
    ``trim_metrics`` (rank 0): the metrics after its step are dropped from ``output_dir/metrics.jsonl``, so no
    step is logged twice."""
    initial_model = model_path(model, tiny_stage)
    if not resume:
        return Start(step=0, initial_model=initial_model, policy_path=initial_model)
    folder = checkpoint.resolve_checkpoint(resume)
    state = checkpoint.load_state(folder)
    checkpoint.check_settings(resolve_saved(state["config"]), settings, allow_config_change=allow_config_change)
    if trim_metrics:
        checkpoint.trim_metrics(output_dir / "metrics.jsonl", state["step"])
    # the KL reference stays the run's starting policy; LoRA: the frozen base is it too, the adapter is in adapter/
    initial_model = state["initial_model"]
    return Start(step=state["step"], initial_model=initial_model, state=state, folder=folder,
                 policy_path=initial_model if lora else str(folder / "model"),
                 stream_position=state.get("producer"),  # None: synchronous (or an older checkpoint)
                 next_group=state.get("next_group"))  # None: asynchronous (or an older checkpoint)


def trainer_state(*, step: int, optimizer, value_head, initial_model: str, config: dict, rollouts) -> dict:
    """Everything a resume needs besides the weights, in types ``torch.load(weights_only=True)`` reads: ``step``,
    the optimizer (FSDP shards gathered: every rank must call it), the value head, the starting model, the resolved
    ``config``, RNG states and the place in the question stream of ``rollouts`` (a ``StepRollouts``: asynchronous,
    the producer's on rank 0, else None; synchronous, the first question never played)."""
    return {"step": step, "optimizer": full_optimizer_state(optimizer),
            "value_head": full_state_dict(value_head) if value_head else None,
            "initial_model": str(initial_model), "config": config, "rng": checkpoint.rng_state(),
            "producer": rollouts.producer.position() if rollouts.producer is not None else None,
            "next_group": None if rollouts.asynchronous else rollouts.next_group}


def load_trainer_state(state: dict, *, optimizer, value_head, estimator_name: str, source=None) -> int:
    """Load :func:`trainer_state`'s optimizer, value head and RNG states (a checkpoint's, old formats too), its
    moments and value head checked finite; returns its step. ``source`` (the checkpoint folder) names it in errors;
    ``estimator_name`` the estimator that needs the value head, when the state has none."""
    where = f"checkpoint {source}" if source is not None else "trainer state"
    checkpoint.check_finite(checkpoint.optimizer_tensors(state["optimizer"]), f"{where} ({checkpoint.STATE_FILE})")
    if state.get("value_head"):
        checkpoint.check_finite(state["value_head"].items(), f"{where} ({checkpoint.STATE_FILE}, value head)")
    load_full_optimizer_state_(optimizer, state["optimizer"])
    if value_head is not None:
        if state["value_head"] is None:
            raise ValueError(f"{where} has no value head, but estimator {estimator_name!r} needs one")
        load_full_state_dict_(value_head, state["value_head"])
    checkpoint.set_rng_state(state["rng"])
    return state["step"]


def save_checkpoint(path: Path, *, step: int, dp, state: dict, policy, tokenizer, trained_parameters,
                    keep: int = 0) -> Path:
    """Checkpoint ``path``: ``model/`` (a plain transformers model folder with its tokenizer; LoRA: the merged
    weights, the adapter alone in ``adapter/``) and the trainer ``state`` (:func:`trainer_state`), written
    atomically (``agent_loop.training.checkpoint.write_checkpoint``, which keeps the ``keep`` newest; 0: all). With
    several ranks, rank 0 writes it (the replicas of ``trained_parameters`` checked equal first) and every rank
    returns once it is written."""
    dp.check_replicas_equal(trained_parameters)
    weights = merged_state_dict(policy)  # every rank: FSDP shards are gathered

    def save_model(folder: Path) -> None:
        save_merged(policy, folder, weights)
        tokenizer.save_pretrained(folder)

    if dp.is_main:
        checkpoint.write_checkpoint(path, step=step, state=state, save_model=save_model, keep=keep)
    dp.barrier()
    return path
