"""LoRA training through ``peft`` (optional extra ``lora``): adapters trained, the base frozen, merged weights saved.

``--lora-rank R`` (> 0) wraps the policy in a ``peft`` LoRA model on ``--lora-target-modules`` (default
every linear layer of the decoder; not the output head or the embeddings). Only the adapter matrices
get gradients and AdamW state. The transformers rollout backend and checkpoints get the *merged* weights
``W + (alpha / r) B A``, computed without touching ``W`` (no merge/unmerge round trip that would
drift the frozen base in float rounding): a checkpoint's ``model/`` is a plain transformers model,
and ``adapter/`` holds the adapter alone (``PeftModel.from_pretrained(base, adapter)``). vLLM gets the
adapter alone: the in-process engine (``agent_loop.training.transports.engine_lora.EngineLoRASync``) and rollout
servers (``agent_loop.training.transports.vllm_servers.VLLMServerLoRASync``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from agent_loop.training.distributed import full_state_dict


def wrap_with_lora(model, rank: int, alpha: float, target_modules: str, dropout: float = 0.0):
    """``model`` as a peft LoRA model (adapter ``default``; B starts at 0, so the policy is unchanged)."""
    try:
        from peft import LoraConfig, get_peft_model  # peft: optional (the lora extra)
    except ImportError as error:  # the optional extra
        raise ImportError("LoRA training needs peft: pip install 'agent-loop[lora]'") from error
    targets = target_modules if target_modules == "all-linear" else [t for t in target_modules.split(",") if t]
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


@torch.no_grad()
def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The plain model's state dict (its own parameter names) with every LoRA layer's delta added to its
    base weight; a model without LoRA gives its own ``state_dict()`` (FSDP shards gathered: every rank calls it)."""
    if not is_lora(model):
        return full_state_dict(model)
    from peft.tuners.lora import LoraLayer  # peft: optional (the lora extra)

    base = model.get_base_model()
    merged = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            layer = module.get_base_layer()
            weight = layer.weight.detach()
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
            merged[f"{name}.weight"] = weight
            if getattr(layer, "bias", None) is not None:
                merged[f"{name}.bias"] = layer.bias.detach()
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".base_layer." in name:
            continue
        merged.setdefault(name, tensor)
    return merged


def save_merged(model, directory, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Save ``model`` as a plain transformers model (LoRA merged; the adapter alone next to it in ``../adapter``).
    ``state_dict``: its ``merged_state_dict``, if already at hand (gathered from FSDP shards)."""
    state_dict = merged_state_dict(model) if state_dict is None else state_dict
    if not is_lora(model):
        model.save_pretrained(directory, state_dict=state_dict)
        return

    plain_copy(model, state_dict).save_pretrained(directory)
    model.save_pretrained(Path(directory).parent / "adapter")


def plain_copy(model, state_dict: dict[str, torch.Tensor] | None = None):
    """A separate plain transformers model with ``model``'s (merged, gathered) weights, for an in-process
    rollout backend; ``state_dict``: its ``merged_state_dict``, if already at hand."""
    state_dict = merged_state_dict(model) if state_dict is None else state_dict
    base = model.get_base_model() if is_lora(model) else model
    plain = AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)  # (non-persistent buffers: rotary)
    plain.load_state_dict(state_dict)
    return plain.to(next(iter(state_dict.values())).device)


def load_adapter_weights(model, adapter_dir) -> None:
    """Load a saved adapter (``save_merged``'s ``adapter/``) into ``model``'s LoRA layers; raises if a key is missing."""
    from peft import set_peft_model_state_dict  # peft: optional (the lora extra)

    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter {adapter_dir} does not fit the LoRA model: missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]}")
