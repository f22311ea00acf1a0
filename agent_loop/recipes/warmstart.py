"""Warm start: fine-tune a model on a task's demonstrations (``Task.demonstrate``), loss on ASSISTANT tokens only,
so that RL on one's own task starts from a model that calls its tools (docs/design.md section 8a).

1. **Demonstrations, as the loop records them** (``agent_loop.training.demonstrations.replay``): each one played
   through the agent loop itself by a backend that "samples" its assistant turns, so that prompt ids, response
   ids, spans, tool calls and observations are exactly those the loop records for a model that wrote those turns.
   A demonstration whose replay differs from it, calls a tool that fails, or does not succeed is refused
   (``DemonstrationError``, one line naming the episode).
2. **The fine-tune** (:func:`fine_tune_on_demonstrations`): the replayed trajectories are collated
   (``trajectories_to_batch``), and each step takes the mean next-token cross-entropy over the ASSISTANT tokens of
   ``batch_size`` demonstrations, in micro-batches through the trainer's own forward, with AdamW, linear warm-up
   and cosine decay to a tenth of the peak (:func:`lr_at`), gradient clipping: the library's fine-tuning loop
   (``agent_loop.training.finetune``); checkpoints and the run's folder as ``train``'s
   (``agent_loop.training.checkpoint``).
3. **Outputs** (:func:`warm_start`): ``OUTPUT_DIR/model`` (a model folder ``agent-loop rollout --model`` and
   ``agent-loop train --model`` load, written as a checkpoint is: atomically, with a manifest), ``metrics.jsonl``
   (loss, learning rate and gradient norm per step) and ``demonstrations.jsonl`` (the replayed episodes:
   ``agent-loop inspect`` shows what was trained on).
4. **The check** (``--check-episodes``, 0 skips it; ``agent_loop.training.held_out``): the saved model plays
   held-out questions (train's evaluation stream), sampled at T=1, into ``check.jsonl``; the CLI prints their
   success, so a warm start that did not take shows before RL starts from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import agent_loop.training.checkpoint as checkpoint
import agent_loop.training.finetune as finetune
import agent_loop.training.optimization as optimization
from agent_loop.model_folders import model_path
from agent_loop.options import checked
from agent_loop.recipes.train import EVAL_SEED_OFFSET
from agent_loop.recipes.warmstart_options import MIN_LR_FRACTION, WarmstartConfig
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.threads import apply_threads
from agent_loop.training.demonstrations import replay
from agent_loop.training.distributed import resolve_device
from agent_loop.training.held_out import held_out_check
from agent_loop.training.metrics import MetricsLogger
from agent_loop.training.model_folder import save_latest_checkpoint, save_model
from agent_loop.training.policy import PolicyModel
from agent_loop.types import Trajectory
from masking.batch import Batch

TINY_STAGE = "final"  # unset --model: the fully trained tiny agent (the one that calls tools best)
DEMONSTRATIONS_FILE, METRICS_FILE, MODEL_DIR = "demonstrations.jsonl", "metrics.jsonl", "model"
CHECK_FILE = "check.jsonl"  # the held-out check's episodes (--check-episodes), sampled at T=1
CHECKPOINTS_DIR = "checkpoints"  # OUTPUT_DIR/checkpoints/step_NNNNNN, the latest only (--save-every, --resume)


@dataclass
class WarmstartResult:
    """What a warm start made: the model folder, the metrics per step, the demonstrations it trained on."""

    model_dir: Path
    history: list[dict]
    demonstrations: list[Trajectory]
    seconds: float
    check: list[Trajectory] = field(default_factory=list)  # the held-out check's episodes (step 4)

    @property
    def longest(self) -> dict[str, int]:
        """The largest budgets a demonstration needs: ``turns``, ``response_tokens`` and ``turn_tokens``."""
        turns = [t.metrics["turn_tokens"] for t in self.demonstrations]
        return {"turns": max(len(t) for t in turns), "response_tokens": max(len(t.response_ids) for t in self.demonstrations),
                "turn_tokens": max(turn["assistant"] for t in turns for turn in t)}


def warm_start(config: WarmstartConfig, task=None) -> WarmstartResult:
    """Replay the task's demonstrations, fine-tune the model on them, save it, check it (the module docstring's steps).

    ``task``: any task object; default: the one ``config`` names. ``config.output_dir`` must hold no earlier
    warm start (FileExistsError; the CLI checks and locks it first), unless ``config.resume``: then it goes on
    from the latest complete checkpoint there (CheckpointError if none, or if the settings differ)."""
    started = time.perf_counter()
    config = checked(config)
    task = task if task is not None else config.load()
    apply_threads(config.threads)  # the one threads rule (agent_loop.threads)
    torch.manual_seed(config.seed)
    output = Path(config.output_dir)
    resume = resume_point(config, output)
    source = model_path(config.model, TINY_STAGE)
    tokenizer = AutoTokenizer.from_pretrained(source)
    demonstrations = replay(task, tokenizer, range(config.episodes), config.seed, progress=config.progress,
                            output_path=None if resume else output / DEMONSTRATIONS_FILE)
    config = dataclasses.replace(config, steps=planned_steps(config, len(demonstrations)))
    model = AutoModelForCausalLM.from_pretrained(resume / MODEL_DIR if resume else source, dtype=torch.float32)
    model = model.to(resolve_device(config.device))
    history = train_in_folder(model, tokenizer, demonstrations, config, resume, source)
    folder = save_model(model, tokenizer, output / MODEL_DIR, step=config.steps)
    result = WarmstartResult(folder, history, demonstrations, time.perf_counter() - started)
    if config.check_episodes:
        result.check = held_out_check(model, tokenizer, task, config.check_episodes, config.seed + EVAL_SEED_OFFSET,
                                      result.longest, output / CHECK_FILE, progress=config.progress)
    return result


def resume_point(config: WarmstartConfig, output: Path) -> Path | None:
    """The checkpoint a ``config.resume`` run goes on from (CheckpointError if none), else None; FileExistsError
    if ``output`` holds an earlier warm start that is not resumed."""
    resume = checkpoint.resolve_checkpoint(output / CHECKPOINTS_DIR) if config.resume else None
    earlier = [name for name in (DEMONSTRATIONS_FILE, METRICS_FILE, MODEL_DIR) if (output / name).exists()]
    if earlier and resume is None:
        raise FileExistsError(f"{output} holds an earlier warm start ({', '.join(earlier)}); give another output_dir "
                              "or empty it")
    output.mkdir(parents=True, exist_ok=True)
    return resume


def train_in_folder(model, tokenizer, demonstrations: list[Trajectory], config: WarmstartConfig, resume: Path | None,
                    source) -> list[dict]:
    """The fine-tune of step 2 in ``config.output_dir``: metrics.jsonl logged, a checkpoint every
    ``config.save_every`` steps, gone on from ``resume``'s; every step's metrics (a resumed run's earlier ones
    too). FloatingPointError if a loss is not finite."""
    output = Path(config.output_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = trajectories_to_batch(demonstrations, pad_token_id=pad).to(next(model.parameters()).device)
    state = resumed_state(resume, config) if resume else None
    tqdm.write(work_line(demonstrations, config))
    earlier = logged_metrics(output / METRICS_FILE) if resume else []
    settings = {"initial_model": str(source), "config": config.resolved()}
    logger = MetricsLogger(output, fresh=resume is None, tensorboard=False)
    try:
        history = fine_tune_on_demonstrations(model, batch, config, logger, state=state, save=lambda step, state: (
            save_latest_checkpoint(output / CHECKPOINTS_DIR, step, {**state, **settings}, model, tokenizer)))
    finally:
        logger.close()
    if not all(math.isfinite(m["loss"]) for m in history):
        raise FloatingPointError(f"the loss is not finite (see {logger.path}); nothing saved; lower --lr")
    return earlier + history


def fine_tune_on_demonstrations(model, batch: Batch, config: WarmstartConfig, logger: MetricsLogger | None = None, *,
                                save=None, state: dict | None = None) -> list[dict]:
    """Train ``model`` (a causal LM, on ``batch``'s device) for ``config.steps`` steps on ``batch``'s demonstrations,
    ``config.batch_size`` of them a step in a new random order every pass (``agent_loop.training.finetune``); the
    metrics of every step run here (``loss``, ``lr``, ``grad_norm``, ``tokens``), also logged. ``save(step, state)``
    is called every ``config.save_every`` steps with the optimizer and RNG states; ``state`` (one of those) goes on
    from its step as if never stopped (the learning rate is :func:`lr_at` of the step: an older checkpoint's
    ``schedule`` state is not needed)."""
    policy = PolicyModel(model)
    optimizer = optimization.adamw(model.parameters(), config)
    first = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        checkpoint.set_rng_state(state["rng"])
        first = state["step"]
    order = finetune.row_order(batch.responses.shape[0], config.steps, config.batch_size, config.seed)
    clock = time.perf_counter()

    def after_step(done: int, metrics: dict) -> None:
        if logger is not None:
            logger.log(done, metrics)
        if done == first + 1 and done < config.steps:
            tqdm.write(eta_line(time.perf_counter() - clock, done, config.steps))
        if save is not None and done % config.save_every == 0 and done < config.steps:
            save(done, {"step": done, "optimizer": optimizer.state_dict(), "rng": checkpoint.rng_state()})

    return finetune.fine_tune(policy, optimizer, config.steps,
                              finetune.batch_gradient(policy, batch, order, config.micro_batch_size),
                              lr_of=lambda step: lr_at(step, config), max_grad_norm=config.max_grad_norm,
                              first_step=first, after_step=after_step, description="warm start",
                              progress=config.progress)


def lr_at(step: int, config: WarmstartConfig) -> float:
    """The learning rate of 0-based ``step``: linear warm-up from 0, then a cosine down to ``MIN_LR_FRACTION`` of
    the peak (``agent_loop.training.optimization.lr_at``, the schedule the warm start has always used)."""
    return optimization.lr_at(step, peak=config.learning_rate, warmup_steps=config.warmup_steps, warmup_start=0,
                              decay_steps=config.steps, min_fraction=MIN_LR_FRACTION)


def planned_steps(config: WarmstartConfig, demonstrations: int) -> int:
    """``config.steps``, or when unset ``ceil(passes x demonstrations / batch_size)`` (``WarmstartConfig.passes``:
    ``--epochs``, or the model's default): the work scales with the data."""
    return config.steps or max(1, math.ceil(config.passes * demonstrations / config.batch_size))


def work_line(demonstrations: list[Trajectory], config: WarmstartConfig) -> str:
    """The work ahead, printed before it starts: demonstrations, their tokens, steps and passes."""
    n = len(demonstrations)
    prompt, response = (sum(map(len, (getattr(t, name) for t in demonstrations))) / n
                        for name in ("prompt_ids", "response_ids"))
    seen = config.steps * config.batch_size
    return (f"warm start: {n} demonstrations of {prompt:.0f} prompt + {response:.0f} response tokens on average; "
            f"{config.steps} steps x {config.batch_size} = {seen} demonstrations ({seen / n:.3g} passes), about "
            f"{seen * (prompt + response):,.0f} tokens through the model")


def eta_line(seconds: float, done: int, steps: int) -> str:
    """The estimate after the first step of this process: how long the rest will take at that pace."""
    left = (steps - done) * seconds
    return (f"warm start: step {done} took {seconds:.1f} s; ETA {left / 60:.1f} min for the other {steps - done} steps "
            "(--steps or --epochs change them; checkpoints every --save-every steps, --resume goes on)")


def resumed_state(resume: Path, config: WarmstartConfig) -> dict:
    """The checkpoint's state, its settings checked against ``config``'s; metrics.jsonl cut back to its step."""
    state = checkpoint.load_state(resume)
    checkpoint.check_settings(state["config"], config.resolved(), allow_config_change=config.allow_config_change)
    checkpoint.trim_metrics(Path(config.output_dir) / METRICS_FILE, state["step"])
    return state


def logged_metrics(path: Path) -> list[dict]:
    """The metrics of the steps ``path`` (metrics.jsonl) holds, without their step numbers."""
    return [{k: v for k, v in json.loads(line).items() if k != "step"}
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
