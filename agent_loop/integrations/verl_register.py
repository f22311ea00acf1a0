"""Importing this module registers agent-loop in the verl process that imports it (docs/verl.md):

    VERL_USE_EXTERNAL_MODULES=agent_loop.integrations.verl_register python -m verl.trainer.main_ppo ...

verl's ``__init__`` imports every module named in ``VERL_USE_EXTERNAL_MODULES`` in each process that
imports verl: the driver, the ``TaskRunner`` actor (where ``compute_advantage`` runs) and the
``AgentLoopWorker`` and engine worker actors. A ``register()`` call in the driver alone does not reach
those actors, so the registering happens here, at import:

- our estimators, :func:`agent_loop.integrations.verl.register` (``agent_loop_reinforce_plus_plus``,
  ``agent_loop_gae``, the turn-level ``agent_loop_turn_rloo``, ``agent_loop_gigpo``, ...); with
  ``AGENT_LOOP_VERL_REPLACE_GAE=1`` also verl's built-in ``gae`` on our scans; once
  ``verl.trainer.ppo.ray_trainer`` is imported, its ``compute_advantage`` hands its batch to the turn-level
  estimators (the token ids, the attention mask, the values, the task's turn states);
- our AgentLoop: ``agent_loop.integrations.verl_agent_loop`` (it registers itself under ``agent_loop`` in
  verl's agent-loop registry) is imported right after ``verl.experimental.agent_loop`` is, so processes
  that never run agent loops do not load it, and verl is not half-initialised when it loads.

Environment variables reach Ray actors of a local cluster by inheritance; on a cluster started with
``ray start`` pass them in ``ray_kwargs.ray_init.runtime_env.env_vars`` (docs/verl.md).
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys

from agent_loop.integrations import verl as plugin

REPLACE_GAE = "AGENT_LOOP_VERL_REPLACE_GAE"
VERL_AGENT_LOOPS = "verl.experimental.agent_loop"  # the package whose import brings verl's agent-loop registry
OUR_AGENT_LOOP = "agent_loop.integrations.verl_agent_loop"
VERL_RAY_TRAINER = "verl.trainer.ppo.ray_trainer"  # its compute_advantage hands the batch to the turn-level estimators


def replace_gae_requested(environ=os.environ) -> bool:
    """``AGENT_LOOP_VERL_REPLACE_GAE``: 1/true/yes or 0/false/no/unset; ValueError for anything else (a typo
    must not silently train on verl's GAE)."""
    value = environ.get(REPLACE_GAE, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{REPLACE_GAE}={environ[REPLACE_GAE]!r}: use 1 (verl's gae on agent-loop's scans) or 0")


def import_our_agent_loop() -> None:
    """Import :data:`OUR_AGENT_LOOP` (it registers ``agent_loop`` in verl's agent-loop registry)."""
    try:
        importlib.import_module(OUR_AGENT_LOOP)
    except ImportError as error:
        raise ImportError(f"{__name__}: verl imported its agent loops, but {OUR_AGENT_LOOP} failed to import "
                          f"({error}); agent-loop's AgentLoop is not registered") from error


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after the module ``name`` has executed, the first time it is imported."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the real finders below find the real spec
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            self.then()

        spec.loader.exec_module = exec_then  # this spec's own loader object, not a shared one
        return spec


def capture_batches() -> None:
    """Let the turn-level estimators read the batch verl's ``compute_advantage`` computes
    (:func:`agent_loop.integrations.verl.capture_batches`)."""
    plugin.capture_batches(sys.modules[VERL_RAY_TRAINER])


def _after_import(name: str, then) -> None:
    """``then()`` now if ``name`` is imported, else right after it is (once)."""
    if name in sys.modules:
        then()
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def install() -> None:
    """Register the estimators now, our AgentLoop once verl's agent loops are imported, and the batch capture of
    the turn-level estimators once verl's ``ray_trainer`` is (or now, if they already are). Called at import;
    calling it again adds nothing."""
    plugin.register(replace_builtin_gae=replace_gae_requested())
    _after_import(VERL_AGENT_LOOPS, import_our_agent_loop)
    _after_import(VERL_RAY_TRAINER, capture_batches)


install()
