"""The backend a training run plays its episodes on, made from the run's options and its policy.

The choice is ``agent_loop.runners.backend_choice``'s, as for ``agent-loop rollout`` and ``rollout()``: rollout
servers (``--server``) mean ``http``; ``auto`` picks the in-process vLLM engine for a real model vLLM runs, else
transformers. The engine loads the policy's folder (with LoRA, the frozen base: the adapter is pushed alone,
``agent_loop.training.transports.engine_lora``) and logs to a file in the run's folder; transformers plays a
plain copy of the policy, on the trainer's device, in the rollout precision.
"""

from __future__ import annotations

import sys
from pathlib import Path

from agent_loop.backends.base import BackendSettings
from agent_loop.backends.registry import make_backend
from agent_loop.backends.vllm_engine import engine_log
from agent_loop.runners.backend_choice import AUTO, choose_backend
from agent_loop.runners.outputs import fresh_path
from agent_loop.training.lora import plain_copy


def make_rollout_backend(config, *, start, policy, device, processes: int, threads: int, output_dir: Path,
                         pad_token_id: int, announce: bool):
    """The rollout backend of a run: ``config``'s backend options (``backend``, ``server``, ``rollout_dtype``,
    ``concurrency``, ``lora_rank``, ``dtype``, ``verbose``), ``start`` (a :class:`~agent_loop.training.resume.Start`)
    and the ``policy`` to copy; ``announce`` (rank 0): the chooser's note, one line on stderr."""
    name, note = ("http", None) if config.server else (config.backend, None)
    if name == AUTO:
        name, note = choose_backend(start.policy_path, lora_rank=config.lora_rank, processes=processes, device=str(device))
    if note and announce:
        print(f"agent-loop train: {note}", file=sys.stderr, flush=True)
    if name == "http":
        return make_backend("http", config.served_name(start.initial_model), BackendSettings.from_options(config))
    if name == "vllm":
        log = engine_log(fresh_path(str(output_dir / "vllm.log")), verbose=config.verbose)
        return make_backend("vllm", start.policy_path, BackendSettings(
            threads=threads, engine_log=log and str(log), dtype=config.rollout_torch_dtype(), lora_rank=config.lora_rank))
    return make_backend("hf", plain_copy(policy), BackendSettings(
        device=str(device), dtype=config.rollout_torch_dtype(config.dtype), max_batch_size=config.concurrency,
        pad_token_id=pad_token_id))
