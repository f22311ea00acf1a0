"""How the trainer's new weights reach the rollouts: one interface (:class:`~agent_loop.training.transports.base.WeightTransport`,
``push(weights, *, version)``), one module per transport, one factory (:func:`make_transport`).

Where the weights go (:func:`make_destination`):

- ``in_process``: this rank's own backend (transformers, the in-process vLLM engine), the merged weights;
- ``engine_lora``: a LoRA policy's adapter alone into this rank's in-process vLLM engine (started with ``lora_rank``);
- ``vllm_servers``: running vLLM servers, in place (full weights, or a LoRA policy's adapter alone).

When they go (:func:`make_transport`):

- ``synchronous``: between runs, every rank (rank 0 alone to servers the ranks share);
- ``producer``: through the asynchronous producer's gate, between requests (rank 0).

A new transport: subclass ``WeightTransport`` in a module here and pick it in :func:`make_destination`
(docs/design.md, "How to add a weight transport").
"""

from __future__ import annotations

from pathlib import Path

from agent_loop.training.transports.base import WeightTransport
from agent_loop.training.transports.engine_lora import EngineLoRASync
from agent_loop.training.transports.in_process import BackendTransport
from agent_loop.training.transports.producer import ProducerPush
from agent_loop.training.transports.synchronous import SynchronousPush
from agent_loop.training.transports.vllm_servers import VLLMServerLoRASync, VLLMServerWeightSync

__all__ = ["WeightTransport", "make_destination", "make_transport"]


def make_destination(*, backend, given=None, servers=(), lora_policy=None, folder: str | Path | None = None,
                     served_name: str = "policy") -> WeightTransport:
    """Where the weights go: ``given`` (a ``WeightTransport``);
    else the rollout ``servers`` (with ``lora_policy``: its adapter alone, named ``SERVED-lora-...``), writing
    into ``folder``; else the in-process ``backend``: ``lora_policy``'s adapter alone if it serves adapters (the
    vLLM engine with ``lora_rank``), else the merged weights."""
    if given is not None:
        if not isinstance(given, WeightTransport):
            raise TypeError(f"weight_sync {given!r} is not a WeightTransport (agent_loop.training.transports.base)")
        return given
    if servers:
        if lora_policy is not None:
            return VLLMServerLoRASync(servers, lora_policy, adapters_dir=folder, name=f"{served_name}-lora")
        return VLLMServerWeightSync(servers, weights_dir=folder)
    if lora_policy is not None and getattr(backend, "lora_rank", 0):
        return EngineLoRASync(backend, lora_policy)  # a temporary folder: each rank's engine its own
    return BackendTransport(backend)


def make_transport(destination: WeightTransport, *, rollout_backend, dp, asynchronous: bool = False,
                   producer=None) -> WeightTransport:
    """``destination`` with its timing: ``asynchronous``, through ``producer`` (rank 0's; None on the other
    ranks, which then push nothing), else between runs on ``rollout_backend`` (a ``VersionedBackend``; ``dp``:
    the ranks)."""
    if isinstance(destination, (SynchronousPush, ProducerPush)):
        destination = destination.inner  # re-timed (start_producer after set-up)
    if asynchronous:
        return ProducerPush(destination, producer=producer, backend=rollout_backend.inner)
    return SynchronousPush(destination, rollout_backend=rollout_backend, dp=dp)
