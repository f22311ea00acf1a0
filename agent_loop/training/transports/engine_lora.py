"""The in-process vLLM engine's LoRA transport: a ``peft`` policy's adapter alone into this rank's engine
(``agent_loop.backends.vllm_engine.VLLMEngineBackend`` started with ``lora_rank``), as verl's
``lora.merge=False`` and TRL do, instead of the merged weights.

Each push saves the adapter (``save_pretrained``) into a fresh folder and loads it into the engine under a
new LoRA id (``VLLMEngineBackend.load_adapter``: a new id is a new adapter to vLLM, so neither its cached
adapter weights nor prefix-cache blocks of an earlier push are reused); every request from then on runs on
it and reports its version, which the ``VersionedBackend`` checks against the policy's (a stale adapter
raises). A push of unchanged weights (an update skipped) relabels the loaded adapter with the new version.
"""

from __future__ import annotations

import time
from pathlib import Path

from agent_loop.training.transports.base import WeightTransport
from agent_loop.training.transports.folders import PushFolders


class EngineLoRASync(WeightTransport):
    """``policy``'s adapter into ``backend`` (a LoRA engine) on every push; ``adapters_dir``: where the adapters
    are written (default: a temporary folder, each rank its own). ``timings``: the seconds of each push."""

    takes_weights = False  # the adapter is read from the policy

    def __init__(self, backend, policy, *, adapters_dir: str | Path | None = None):
        self.backend, self.policy = backend, policy
        self.folders = PushFolders(adapters_dir, temporary_prefix="agent-loop-adapter-")
        self.timings: list[float] = []

    def push(self, weights: dict | None, *, version: int) -> None:
        if weights is None:
            self.backend.relabel_adapter(version)
            return
        started = time.perf_counter()
        folder = self.folders.next()
        self.policy.save_pretrained(str(folder))
        self.backend.load_adapter(folder, version=version)
        self.folders.took(folder)
        self.timings.append(time.perf_counter() - started)

    def close(self) -> None:
        self.folders.close()
