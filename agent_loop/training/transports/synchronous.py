"""Weights pushed between runs (a synchronous trainer): no episode is in flight during a push.

Every rank pushes into its own backend, or rank 0 alone into destinations the ranks share (rollout servers);
every rank then asks for the served model a push named (LoRA) and stamps the new version on its rollouts."""

from __future__ import annotations

from agent_loop.training.transports.base import WeightTransport, follow


class SynchronousPush(WeightTransport):
    """``inner`` (where the weights go), pushed between runs on ``rollout_backend`` (a ``VersionedBackend``)."""

    def __init__(self, inner: WeightTransport, *, rollout_backend, dp):
        self.inner, self.rollout_backend, self.dp = inner, rollout_backend, dp
        self.shared, self.takes_weights = inner.shared, inner.takes_weights

    @property
    def served_model(self) -> str | None:
        return self.inner.served_model

    def push(self, weights: dict | None, *, version: int) -> None:
        if not self.inner.shared or self.dp.is_main:  # unchanged weights too: a destination may label them
            self.inner.push(weights, version=version)
        if weights is not None and self.inner.shared:  # every rank's backend asks for what rank 0 pushed
            follow(self.rollout_backend.inner, self.dp.broadcast_object(self.inner.served_model))
        self.rollout_backend.version = version

    def close(self) -> None:
        self.inner.close()
