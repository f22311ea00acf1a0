"""Backends by name: one registry and one factory (the CLI, agent_loop.rollout() and the trainer use it)."""

import asyncio

import pytest

from agent_loop.backends.base import Backend, BackendSettings, check_backend
from agent_loop.backends.registry import BACKENDS, backend_class, make_backend


def test_every_registered_backend_is_a_backend_class_and_names_are_the_cli_choices():
    from agent_loop.cli.flags import allowed
    from agent_loop.cli.rollout import RolloutOptions

    for name in BACKENDS:
        assert issubclass(backend_class(name), Backend), name
    assert allowed(RolloutOptions, "backend") == "one of auto, " + ", ".join(BACKENDS)  # auto: agent_loop.runners.backend_choice
    with pytest.raises(ValueError, match="unknown backend 'nope'; choose one of hf, vllm, http"):
        make_backend("nope", "model")


def test_the_http_backend_is_made_from_the_settings_without_a_connection():
    backend = make_backend("http", "some/model", BackendSettings(servers=["http://127.0.0.1:9"], retry_deadline_s=7))
    assert backend.model == "some/model" and backend.retry_deadline_s == 7 and backend.retries_itself
    named = make_backend("http", "some/model", BackendSettings(servers=["http://127.0.0.1:9"], served_model_name="p"))
    assert named.model == "p"
    with pytest.raises(ValueError, match="at least one server"):
        make_backend("http", "some/model")
    asyncio.run(backend.end_run())  # nothing open: a no-op


def test_anything_else_is_refused_by_name():
    class NotABackend:
        async def generate(self, prompt_ids, sampling, session_id=None):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="NotABackend is not a backend: subclass agent_loop.backends.base.Backend"):
        check_backend(NotABackend())

    class Minimal(Backend):
        async def generate(self, prompt_ids, sampling, session_id=None):
            raise AssertionError("never called")

    backend = check_backend(Minimal())
    with pytest.raises(NotImplementedError, match="Minimal cannot take new weights"):
        backend.update_weights({})
    backend.close()  # the defaults of the lifecycle: nothing to do
