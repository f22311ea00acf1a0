"""The backend a training run plays its episodes on, made from the run's options and its policy.

The choice is ``agent_loop.runners.backend_choice.resolve_backend``'s, as for ``agent-loop rollout`` and
``rollout()``: rollout servers (``--server``) mean ``http``; ``auto`` picks the in-process vLLM engine for a real
model vLLM runs, else transformers. The engine loads the policy's folder (with LoRA, the frozen base: the adapter
is pushed alone, ``agent_loop.training.transports.engine_lora``) and logs to a file in the run's folder;
transformers plays a plain copy of the policy, on the trainer's device, in the rollout precision.
"""

from __future__ import annotations

import sys
from pathlib import Path

from agent_loop.backends.base import BackendSettings
from agent_loop.backends.registry import make_backend
from agent_loop.backends.vllm_engine import engine_log
from agent_loop.runners.backend_choice import resolve_backend
from agent_loop.runners.outputs import fresh_path
from agent_loop.training.lora import plain_copy


def make_rollout_backend(options, *, start, policy, lora_rank: int, train_dtype: str, concurrency: int, device,
                         processes: int, threads: int, output_dir: Path, pad_token_id: int, verbose: bool,
                         announce: bool):
    """The rollout backend of a run from its backend ``options`` (``backend``, ``server``, ``rollout_dtype``, the
    servers' settings), ``start`` (a :class:`~agent_loop.training.resume.Start`) and the ``policy`` to copy;
    ``announce`` (rank 0): the chooser's note, one line on stderr; ``verbose``: the engine's logs on the terminal
    too."""
    name, note = resolve_backend(options.backend, start.policy_path, servers=options.server, lora_rank=lora_rank,
                                 processes=processes, device=str(device))
    if note and announce:
        print(f"agent-loop train: {note}", file=sys.stderr, flush=True)
    if name == "http":
        return make_backend("http", options.served_name(start.initial_model), BackendSettings.from_options(options))
    if name == "vllm":
        log = engine_log(fresh_path(str(output_dir / "vllm.log")), verbose=verbose)
        return make_backend("vllm", start.policy_path, BackendSettings(
            threads=threads, engine_log=log and str(log), dtype=options.rollout_torch_dtype(), lora_rank=lora_rank))
    return make_backend("hf", plain_copy(policy), BackendSettings(
        device=str(device), dtype=options.rollout_torch_dtype(train_dtype), max_batch_size=concurrency,
        pad_token_id=pad_token_id))
