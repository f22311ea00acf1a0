"""agent-loop: multi-turn, tool-calling rollouts for RL.

The names a user needs (README "Bring your own"); each is imported on first use, so ``import agent_loop``
stays cheap:

- tasks: :class:`Environment` (subclass: ``sample(rng)`` and ``score(completion, answer)``),
  :class:`DatasetTask` (rows from a list/JSONL/Parquet/HF dataset + reward + tools), :func:`load_task`;
- tools: plain functions with type hints and a docstring, :func:`tool` (checks one at definition),
  :func:`tools_from_schemas` (MCP-style schemas + implementations);
- rewards: callables taking ``completion``, ``answer``, ... by name, or rules in :data:`RULES`
  (``exact``, ``contains``, ``number``, ``regex:PATTERN``);
- running: :func:`rollout` (one call), :func:`run_rollouts` / :func:`run_episode` (asyncio),
  :class:`LoopConfig`, :func:`read_trajectories`; records :class:`Episode`, :class:`Trajectory`;
- backends: :class:`TransformersBackend`, :class:`VLLMEngineBackend`, :class:`OpenAIHTTPBackend`;
  :func:`check_model_dir` checks a model folder before any expensive start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Environment": "agent_loop.data_tasks",
    "DatasetTask": "agent_loop.data_tasks",
    "tool": "agent_loop.data_tasks",
    "tools_from_schemas": "agent_loop.data_tasks",
    "load_prompts": "agent_loop.data_tasks",
    "RULES": "agent_loop.data_tasks",
    "load_task": "agent_loop.plugins",
    "Episode": "agent_loop.types",
    "Trajectory": "agent_loop.types",
    "ToolCallRecord": "agent_loop.types",
    "SamplingParams": "agent_loop.types",
    "LoopConfig": "agent_loop.loop",
    "run_episode": "agent_loop.loop",
    "run_rollouts": "agent_loop.runner",
    "read_trajectories": "agent_loop.runner",
    "TransformersBackend": "agent_loop.backends.hf",
    "VLLMEngineBackend": "agent_loop.backends.vllm_engine",
    "OpenAIHTTPBackend": "agent_loop.backends.openai_http",
    "check_model_dir": "agent_loop.models",
}

__all__ = sorted([*_EXPORTS, "rollout"])

if TYPE_CHECKING:  # pragma: no cover
    from agent_loop.backends.hf import TransformersBackend
    from agent_loop.backends.openai_http import OpenAIHTTPBackend
    from agent_loop.backends.vllm_engine import VLLMEngineBackend
    from agent_loop.data_tasks import RULES, DatasetTask, Environment, load_prompts, tool, tools_from_schemas
    from agent_loop.loop import LoopConfig, run_episode
    from agent_loop.models import check_model_dir
    from agent_loop.plugins import load_task
    from agent_loop.runner import read_trajectories, run_rollouts
    from agent_loop.types import Episode, SamplingParams, ToolCallRecord, Trajectory


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'agent_loop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def rollout(task, model: str | None = None, episodes: int = 16, backend="hf", seed: int = 0, concurrency: int = 16,
            output_path=None, progress: bool = True, **loop_options) -> list:
    """Play ``episodes`` episodes of ``task`` and return their Trajectories (index order). Blocking.

    ``task``: a task object or a name for :func:`load_task`. ``model``: a model folder (checked first with
    :func:`check_model_dir`; default: the built-in tiny agent). ``backend``: "hf", "vllm" or a backend
    object. ``loop_options``: :class:`LoopConfig` fields (``max_turns=3``, ``temperature=0.0``, ...).
    """
    import asyncio

    from transformers import AutoTokenizer

    from agent_loop.loop import LoopConfig
    from agent_loop.models import check_model_dir
    from agent_loop.plugins import load_task
    from agent_loop.runner import run_rollouts

    task = load_task(task) if isinstance(task, str) else task
    config = LoopConfig(**loop_options)  # TypeError names an unknown option before anything loads
    if model is None:
        from agent_loop.tiny import tiny_agent_path

        model = str(tiny_agent_path())
        tokenizer = AutoTokenizer.from_pretrained(model)
    else:
        tokenizer = check_model_dir(model, backend if isinstance(backend, str) else "hf").tokenizer
    if backend == "hf":
        from agent_loop.backends.hf import TransformersBackend

        backend = TransformersBackend(model)
    elif backend == "vllm":
        from agent_loop.backends.vllm_engine import VLLMEngineBackend

        backend = VLLMEngineBackend(model)
    elif isinstance(backend, str):
        raise ValueError(f"backend must be 'hf', 'vllm' or a backend object, got {backend!r}")
    return asyncio.run(run_rollouts(task, backend, tokenizer, range(episodes), config, seed=seed,
                                    concurrency=concurrency, output_path=output_path, progress=progress))
