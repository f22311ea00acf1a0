"""The in-process transport: the weights into this rank's own rollout backend (``Backend.update_weights``:
the transformers backend copies them, the vLLM engine reloads them in place, ``agent_loop.backends``)."""

from __future__ import annotations

from agent_loop.training.transports.base import WeightTransport


class BackendTransport(WeightTransport):
    """``backend.update_weights(weights)`` on every rank (each has its own backend); nothing when unchanged."""

    def __init__(self, backend):
        self.backend = backend

    def push(self, weights: dict | None, *, version: int) -> None:
        if weights is not None:
            self.backend.update_weights(weights)
