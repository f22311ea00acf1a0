"""Weights pushed through the asynchronous producer (``--max-staleness K``, rank 0): swapped in between
requests while episodes play (``agent_loop.runners.producer.RolloutProducer.push``: the gate closes, the
requests in flight finish, the weights load, the version moves, the gate opens)."""

from __future__ import annotations

from agent_loop.training.transports.base import WeightTransport, follow


class ProducerPush(WeightTransport):
    """``inner`` (the producer's backend or its servers), pushed through ``producer``'s gate; ``backend``: the
    one the producer plays on (it asks for the served model a push named). ``producer`` None (a rank other
    than 0): nothing to push, rank 0's producer plays every episode."""

    def __init__(self, inner: WeightTransport, *, producer, backend):
        self.inner, self.producer, self.backend = inner, producer, backend
        self.shared, self.takes_weights = inner.shared, inner.takes_weights

    @property
    def served_model(self) -> str | None:
        return self.inner.served_model

    def push(self, weights: dict | None, *, version: int) -> None:
        def load() -> None:
            self.inner.push(weights, version=version)
            follow(self.backend, self.inner.served_model)

        if self.producer is not None:  # unchanged weights too: a destination may label them (the engine's adapter)
            self.producer.push(load, version)

    def close(self) -> None:
        self.inner.close()
