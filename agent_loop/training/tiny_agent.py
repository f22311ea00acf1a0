"""The tiny agent's build recipes (``agent_loop.tiny``): its training, from scratch and on chain dialogues, with the
library's fine-tuning loop (:mod:`agent_loop.training.finetune`).

The tiny package finds, unpacks and caches the tiny agent; where no build is shipped, it runs these recipes by name
in a child process with pinned numerics (``agent_loop.tiny.pinned.run_pinned``: ``agent_loop.tiny.build.RECIPE``,
``agent_loop.tiny.chain.RECIPE``). So the tiny package imports nothing of the training package (which finds its
default model through the tiny package), and the trainer that builds the tiny agent is the one that warm-starts
any model.

Training (:func:`train`): loss on assistant tokens only (the end-of-turn token included), AdamW lr 3e-3 (betas
0.9/0.98, weight decay 0.01 on matrices), 30 warm-up steps, cosine decay to 0.1x (:func:`learning_rate`), gradient
clipping 1.0, batch 32 of freshly generated dialogues (``agent_loop.tiny.train.training_batch``), each task's group
running its shared system prompt once (``agent_loop.training.finetune.labelled_loss``).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

import agent_loop.tiny.build as build
import agent_loop.tiny.chain as chain
import agent_loop.training.finetune as finetune
import agent_loop.training.optimization as optimization
from agent_loop.tiny.data import dialogue, render, task_for
from agent_loop.tiny.evaluate import evaluate
from agent_loop.tiny.pinned import numerics
from agent_loop.tiny.tokenizer import chat_template, train_tokenizer
from agent_loop.tiny.train import (
    BETAS,
    FINAL_LR_FRACTION,
    LEARNING_RATE,
    MAX_GRAD_NORM,
    WARMUP_STEPS,
    WEIGHT_DECAY,
    model_config,
    training_batch,
)


def learning_rate(step: int, total_steps: int, *, peak: float = LEARNING_RATE) -> float:
    """Linear warm-up for WARMUP_STEPS (step 0 already at ``peak / WARMUP_STEPS``), then cosine decay from ``peak``
    to FINAL_LR_FRACTION of it at ``total_steps`` (``agent_loop.training.optimization.lr_at``, in the rounding the
    shipped weights were trained with)."""
    return optimization.lr_at(step, peak=peak, warmup_steps=WARMUP_STEPS, decay_steps=total_steps,
                              min_fraction=FINAL_LR_FRACTION, multiply_first=True)


def train(
    tokenizer: PreTrainedTokenizerFast,
    steps: int,
    seed: int,
    checkpoint_steps: tuple[int, ...] = (),
    on_checkpoint: Callable[[int, LlamaForCausalLM], None] | None = None,
    progress: bool = True,
    *,
    model: LlamaForCausalLM | None = None,
    tasks: Callable[[int, int], str] = task_for,
    peak_lr: float = LEARNING_RATE,
    description: str = "training the tiny agent",
) -> LlamaForCausalLM:
    """Train a fresh model (or continue ``model``) for ``steps`` steps on the dialogues ``tasks`` names
    (``agent_loop.tiny.train.training_batch``); call ``on_checkpoint(step, model)`` after each listed step."""
    torch.manual_seed(seed)
    model = model if model is not None else LlamaForCausalLM(model_config(tokenizer))
    options = optimization.OptimizerSettings(learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    optimizer = optimization.adamw(model.parameters(), options, betas=BETAS, decay_vectors=False)
    gradient = finetune.labelled_gradient(model, lambda step: training_batch(tokenizer, step, seed, tasks))

    def after_step(done: int, metrics: dict) -> None:
        if on_checkpoint is not None and done in checkpoint_steps:
            model.eval()
            on_checkpoint(done, model)
            model.train()

    finetune.fine_tune(model, optimizer, steps, gradient, lr_of=lambda step: learning_rate(step, steps, peak=peak_lr),
                       max_grad_norm=MAX_GRAD_NORM, after_step=after_step, description=description, progress=progress)
    return model


def build_recipe(folder: str, progress: str) -> None:
    """The default tiny agent's recipe (run by :func:`agent_loop.tiny.pinned.run_pinned`, named by
    ``agent_loop.tiny.build.RECIPE``): tokenizer, training, evaluations, into ``folder`` with its ``build.json``."""
    folder, progress, started = Path(folder), bool(progress), time.perf_counter()
    # any tokenizer object renders the template; this one only serves to make the tokenizer's corpus
    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=chat_template())
    seed = build.TOKENIZER_SEED
    corpus = [render(renderer, *dialogue(task_for(i, seed), i, seed)) for i in range(build.TOKENIZER_DIALOGUES)]
    tokenizer = train_tokenizer(corpus)
    steps = build.train_steps()
    record = {"recipe": build.RECIPE_VERSION, "train_steps": steps, "vocab_size": len(tokenizer),
              "numerics": numerics(), "stages": {}}
    candidates = tuple(round(steps * f) for f in build.MID_FRACTIONS)
    mid: dict = {}

    def consider_mid(step: int, model) -> None:
        check = evaluate(model, tokenizer, "arithmetic", build.MID_CHECK_EPISODES, build.MID_CHECK_SEED, greedy=False)
        success = check["success"]
        record.setdefault("mid_candidates", {})[step] = success
        if not mid or abs(success - build.MID_TARGET) < abs(mid["success"] - build.MID_TARGET):
            mid.update(step=step, success=success, state=copy.deepcopy(model.state_dict()))

    def save(stage: str, step: int, model) -> None:
        stage_started = time.perf_counter()
        build.save_model(folder / stage, model, tokenizer)
        decodings = (False, True) if stage == "final" else (False,)  # mid: sampled only, to save build time
        # evaluate with the tokenizer as users (and vLLM) load it
        loaded = AutoTokenizer.from_pretrained(folder / stage)
        record["stages"][stage] = {"step": step, "eval": _build_evaluation(model, loaded, decodings)}
        record["eval_seconds"] = record.get("eval_seconds", 0.0) + time.perf_counter() - stage_started

    model = train(tokenizer, steps, build.TRAIN_SEED, candidates, consider_mid, progress)
    save("final", steps, model)
    model.load_state_dict(mid["state"])
    save("mid", mid["step"], model)
    record["build_seconds"] = time.perf_counter() - started
    record["parameters"] = sum(p.numel() for p in model.parameters())
    (folder / "build.json").write_text(json.dumps(record, indent=2))


def _build_evaluation(model, tokenizer, decodings: tuple[bool, ...]) -> list[dict]:
    """The default build's evaluation of ``model``: each task of ``EVAL_EPISODES`` under each of ``decodings``."""
    return [
        evaluate(model, tokenizer, task_name, episodes, build.EVAL_SEED, greedy)
        for task_name, episodes in build.EVAL_EPISODES.items()
        for greedy in decodings
    ]


def chain_recipe(folder: str, base: str, progress: str) -> None:
    """The chain stage's recipe (run by :func:`agent_loop.tiny.pinned.run_pinned`, named by
    ``agent_loop.tiny.chain.RECIPE``), from the model in ``base``, into ``folder`` with its ``build.json``."""
    folder, base, progress, started = Path(folder), Path(base), bool(progress), time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # the base as "<cache folder>/<stage>", not an absolute path: the build is shipped
    record: dict = {"recipe": f"{build.RECIPE_VERSION}-chain", "base": f"{base.parent.name}/{base.name}",
                    "phases": chain.PHASES, "numerics": numerics(), "stages": {}, "mid_candidates": {}}
    mid: dict = {}

    def consider_mid(step: int, model) -> None:
        step += sum(steps for steps, _ in chain.PHASES[:-1])  # counted from the start of the chain stage
        check = evaluate(model, tokenizer, "chain", chain.MID_CHECK_EPISODES, chain.MID_CHECK_SEED, greedy=False)
        success = check["success"]
        record["mid_candidates"][step] = {"success": success, "right_first_call": check["right_arguments"]}
        if progress:
            print(f"chain stage, step {step}: sampled chain success {success:.3f}, "
                  f"right first call {check['right_arguments']:.3f}", flush=True)
        if not mid or abs(success - chain.MID_TARGET) < abs(mid["success"] - chain.MID_TARGET):
            mid.update(step=step, success=success, state=copy.deepcopy(model.state_dict()))

    def save(stage: str, step: int) -> None:
        build.save_model(folder / stage, model, tokenizer)
        record["stages"][stage] = {"step": step, "eval": [evaluate(model, tokenizer, "chain", chain.EVAL_EPISODES,
                                                                   chain.EVAL_SEED, greedy) for greedy in (True, False)]}

    for phase, (steps, peak_lr) in enumerate(chain.PHASES):
        last = phase == len(chain.PHASES) - 1
        train(tokenizer, steps, chain.CHAIN_SEED + phase, chain.MID_STEPS if last else (), consider_mid, progress,
              model=model, tasks=chain.chain_task_for, peak_lr=peak_lr,
              description=f"training the tiny agent on chain dialogues ({phase + 1})")
    save("final", sum(steps for steps, _ in chain.PHASES))
    model.load_state_dict(mid["state"])
    save("mid", mid["step"])
    record["build_seconds"] = time.perf_counter() - started
    (folder / "build.json").write_text(json.dumps(record, indent=2))
