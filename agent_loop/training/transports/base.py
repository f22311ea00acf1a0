"""The one weight-push interface: :class:`WeightTransport` (in the manner of prime-rl's weight broadcasts).

A transport takes the policy's new weights after a step, ``push(weights, *, version)``:

- ``weights``: the full (merged) state dict, name -> tensor; ``None`` when they did not change since the last
  push (an update skipped): nothing is sent, only the ``version`` moves;
- ``version``: the weights after ``version`` trainer steps (what the rollouts stamp on each token).

``shared``: one destination for every rank (rollout servers): rank 0 pushes, the others wait.
``takes_weights``: False for a destination that reads what it sends from the policy itself (a LoRA adapter
pushed alone): ``push`` then gets ``{}`` for changed weights, and the trainer does not merge them.
``served_model``: after a push, the model name the rollouts must request (a LoRA adapter's new name), or
None (the name does not change). A failed push raises (``WeightSyncError`` for vLLM): the next rollouts
would otherwise sample from a stale policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class WeightTransport(ABC):
    """Pushes a trainer's new weights to where the rollouts are played (see the module docstring)."""

    shared: bool = False
    takes_weights: bool = True
    served_model: str | None = None

    @abstractmethod
    def push(self, weights: dict | None, *, version: int) -> None:
        """Make ``weights`` (None: unchanged) the rollouts' weights, as ``version``; raise if they were not taken."""

    def close(self) -> None:
        """Release what the transport holds (temporary folders); idempotent."""


def follow(backend, served_model: str | None) -> None:
    """After a push that renamed the served model (a LoRA adapter), ``backend``'s requests ask for the new name."""
    if served_model:
        backend.model = served_model
