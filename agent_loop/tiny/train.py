"""What the tiny model (a Llama: Qwen2's block minus the qkv bias) trains on, and its settings; the training itself
is ``agent_loop.training.tiny_agent.train`` (the library's fine-tuning loop, run by the build's recipes).

Loss on assistant tokens only (the end-of-turn token included), AdamW lr 3e-3 (betas 0.9/0.98,
weight decay 0.01 on matrices), 30 warm-up steps, cosine decay to 0.1x, gradient clipping 1.0, batch 32 of
freshly generated dialogues (:func:`training_batch`).

Speed: every dialogue of a task starts with the same system prompt (the tool boilerplate, about
two thirds of its tokens), so each step's dialogues come in one group per task, and each group runs that shared
prefix once and the rest on top of its key/value cache (``agent_loop.training.finetune.labelled_loss``).
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import LlamaConfig, PreTrainedTokenizerFast

from agent_loop.tiny.data import dialogue, encode_batch, render, task_for

BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WARMUP_STEPS = 30
FINAL_LR_FRACTION = 0.1
WEIGHT_DECAY, BETAS, MAX_GRAD_NORM = 0.01, (0.9, 0.98), 1.0


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
