"""The weight transports' factory (agent_loop/training/transports/__init__.py): what ``Trainer(weight_sync=...)``
may be, and how a destination is timed."""

from __future__ import annotations

import pytest

from agent_loop.training.transports import make_destination, make_transport
from agent_loop.training.transports.base import WeightTransport
from agent_loop.training.transports.in_process import BackendTransport
from agent_loop.training.transports.producer import ProducerPush
from agent_loop.training.transports.synchronous import SynchronousPush


class Pushes(WeightTransport):
    def __init__(self):
        self.pushed: list[int] = []

    def push(self, weights, *, version):
        self.pushed.append(version)


class UpdatesWeights:
    def update_weights(self, state_dict) -> None:
        pass


def test_a_given_transport_is_the_destination_and_anything_else_is_a_type_error():
    given = Pushes()
    assert make_destination(backend=object(), given=given) is given
    with pytest.raises(TypeError, match="is not a WeightTransport"):
        make_destination(backend=object(), given=UpdatesWeights())


def test_no_destination_given_pushes_into_the_backend_and_is_timed_once():
    destination = make_destination(backend=object())
    assert isinstance(destination, BackendTransport)

    class Rollouts:
        inner, version = object(), 0

    synchronous = make_transport(destination, rollout_backend=Rollouts(), dp=None)
    assert isinstance(synchronous, SynchronousPush) and synchronous.inner is destination
    retimed = make_transport(synchronous, rollout_backend=Rollouts(), dp=None, asynchronous=True, producer=None)
    assert isinstance(retimed, ProducerPush) and retimed.inner is destination
