"""Warm start of the tiny model (a Llama: Qwen2's block minus the qkv bias) on synthetic tool-use dialogues.

Loss on assistant tokens only (the end-of-turn token included), AdamW lr 3e-3 (betas 0.9/0.98,
weight decay 0.01), 30 warm-up steps, cosine decay to 0.1x, gradient clipping 1.0, batch 32 of
freshly generated dialogues.

Speed: every dialogue of a task starts with the same system prompt (the tool boilerplate, about
two thirds of its tokens), so each step runs that shared prefix once and the rest of the batch on
top of its key/value cache. Gradients flow through the cache, so the loss and its gradient are
those of a plain full-sequence forward (tests check this); only the work is smaller.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from agent_loop.tiny.data import dialogue, encode_batch, render, task_for

BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WARMUP_STEPS = 30
FINAL_LR_FRACTION = 0.1


def model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """A Qwen2-style decoder saved as ``model_type: llama``: hidden 128, 4 layers, 4 heads of 32 (a head
    size vLLM's CPU attention accepts), SwiGLU 512, RMSNorm, rope, tied embeddings, no biases.

    Why Llama and not Qwen2 (docs/design.md says "Qwen2-style"): the block is the same shape minus the
    qkv bias, but for ``model_type: qwen2`` transformers 5's ``AutoTokenizer`` (and so vLLM) forces
    ``Qwen2Tokenizer``, which replaces our tokenizer's pre-tokenizer with Qwen2's; for llama it loads
    ``tokenizer.json`` as saved (see ``agent_loop.tiny.tokenizer``).
    """
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def learning_rate(step: int, total_steps: int, *, peak: float = LEARNING_RATE) -> float:
    """Linear warm-up for WARMUP_STEPS, then cosine decay from ``peak`` to FINAL_LR_FRACTION of it."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    return peak * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def shared_prefix_length(input_ids: torch.Tensor, labels: torch.Tensor) -> int:
    """Length of the token prefix all rows share, stopping before the first supervised token.

    ``input_ids`` and ``labels`` are (b, t); the result P leaves at least one token after the prefix
    and keeps ``labels[:, :P+1]`` all -100, so the prefix's logits never enter the loss.
    """
    same = (input_ids == input_ids[:1]).all(dim=0)
    common = int(same.logical_not().nonzero()[0]) if not same.all() else input_ids.shape[1]
    first_supervised = int((labels != -100).any(dim=0).nonzero()[0])
    return max(0, min(common, first_supervised - 1, input_ids.shape[1] - 1))


def assistant_loss(model: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over supervised tokens of a right-padded (b, t) batch, and their count.

    Right padding needs no attention mask under causal attention: real tokens never see later pads.
    The shared prefix runs once (batch 1) and the rest attends to its expanded key/value cache.
    """
    prefix = shared_prefix_length(input_ids, labels)
    cache = None
    if prefix > 0:
        cache = model(input_ids[:1, :prefix], use_cache=True).past_key_values
        cache.batch_repeat_interleave(input_ids.shape[0])
    logits = model(input_ids[:, prefix:], past_key_values=cache, use_cache=cache is not None).logits
    targets = labels[:, prefix + 1 :]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss, int((targets != -100).sum())


def training_batch(
    tokenizer: PreTrainedTokenizerFast, step: int, seed: int, tasks: Callable[[int, int], str] = task_for
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s fresh dialogues, one (input_ids, labels) group per task (each shares its system prompt);
    ``tasks(index, seed)`` names the task of each dialogue."""
    groups: dict[str, list[str]] = {}
    for index in range(step * BATCH_SIZE, (step + 1) * BATCH_SIZE):
        task = tasks(index, seed)
        groups.setdefault(task, []).append(render(tokenizer, *dialogue(task, index, seed)))
    return [encode_batch(tokenizer, texts)[::2] for _, texts in sorted(groups.items())]


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
    (see :func:`training_batch`); call ``on_checkpoint(step, model)`` after each listed step."""
    torch.manual_seed(seed)
    model = model if model is not None else LlamaForCausalLM(model_config(tokenizer))
    model.train()
    # weight decay on matrices only, not on norms and biases
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LEARNING_RATE,
        betas=(0.9, 0.98),
    )
    bar = tqdm(range(steps), desc=description, disable=not progress, unit="step")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak=peak_lr)
        total, count = torch.zeros(()), 0
        for input_ids, labels in training_batch(tokenizer, step, seed, tasks):
            loss, n = assistant_loss(model, input_ids, labels)
            total, count = total + loss, count + n
        loss = total / count
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if on_checkpoint is not None and step + 1 in checkpoint_steps:
            model.eval()
            on_checkpoint(step + 1, model)
            model.train()
    model.eval()
    return model
