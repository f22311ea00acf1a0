"""Backends by name: the one factory behind ``--backend``, ``agent_loop.rollout()`` and the trainer.

Adding a backend: a module with a :class:`~agent_loop.backends.base.Backend` subclass (its
``from_settings``), and one line here.
"""

from __future__ import annotations

import importlib

from agent_loop.backends.base import Backend, BackendSettings

BACKENDS = {  # name -> "module:Class", imported on first use (vLLM takes seconds to import)
    "hf": "agent_loop.backends.hf:TransformersBackend",
    "vllm": "agent_loop.backends.vllm_engine:VLLMEngineBackend",
    "http": "agent_loop.backends.openai_http:OpenAIHTTPBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``; ValueError naming the registered ones."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, model, settings: BackendSettings | None = None) -> Backend:
    """The backend ``name`` over ``model`` (a model folder; a loaded model for ``hf``)."""
    return backend_class(name).from_settings(model, settings or BackendSettings())
