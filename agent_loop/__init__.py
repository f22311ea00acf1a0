"""agent-loop: multi-turn, tool-calling rollouts for RL.

The names a user needs (docs/bring_your_own.md); each is imported on first use, so ``import agent_loop``
stays cheap:

- tasks: :class:`Task` (the contract), :class:`Environment` (subclass: ``sample(rng)`` and
  ``score(completion, answer)``), :class:`DatasetTask` (rows from a list/JSONL/Parquet/HF dataset +
  reward + tools), :func:`load_task`;
- tools: plain functions with type hints and a docstring, :func:`tool` (checks one at definition),
  :func:`tools_from_schemas` (MCP-style schemas + implementations);
- rewards: callables taking ``completion``, ``answer``, ... by name, or rules in :data:`RULES`
  (``exact``, ``contains``, ``number``, ``regex:PATTERN``);
- running: :func:`rollout` (one call), :func:`run_rollouts` / :func:`run_episode` / :func:`run_session` (asyncio),
  :class:`LoopConfig`, :func:`read_trajectories`; records :class:`Episode`, :class:`Trajectory`;
- backends: :class:`Backend` (the contract), :class:`TransformersBackend`, :class:`VLLMEngineBackend`,
  :class:`OpenAIHTTPBackend`, :func:`make_backend`; :func:`check_model_dir` checks a model folder before
  any expensive start;
- training (the recipes): :class:`TrainConfig` and :class:`Trainer` (``agent-loop train``), :class:`WarmstartConfig`
  and :func:`warm_start` (``agent-loop warmstart``).
"""

from __future__ import annotations

import asyncio
import importlib
import sys

_EXPORTS = {
    "Task": "agent_loop.episode.contracts",
    "Environment": "agent_loop.tasks.environment",
    "DatasetTask": "agent_loop.tasks.dataset",
    "load_prompts": "agent_loop.tasks.dataset",
    "tool": "agent_loop.episode.tools",
    "tools_from_schemas": "agent_loop.episode.tools",
    "RULES": "agent_loop.tasks.rewards",
    "load_task": "agent_loop.tasks.registry",
    "Episode": "agent_loop.types",
    "Trajectory": "agent_loop.types",
    "ToolCallRecord": "agent_loop.types",
    "SamplingParams": "agent_loop.backends.base",
    "Backend": "agent_loop.backends.base",
    "make_backend": "agent_loop.backends.registry",
    "LoopConfig": "agent_loop.episode.loop_config",
    "run_episode": "agent_loop.episode.loop",
    "run_session": "agent_loop.episode.loop",
    "run_rollouts": "agent_loop.runners.local",
    "read_trajectories": "agent_loop.runners.local",
    "TransformersBackend": "agent_loop.backends.hf",
    "VLLMEngineBackend": "agent_loop.backends.vllm_engine",
    "OpenAIHTTPBackend": "agent_loop.backends.openai_http",
    "check_model_dir": "agent_loop.model_folders",
    "TrainConfig": "agent_loop.recipes.train_options",
    "Trainer": "agent_loop.recipes.train",
    "WarmstartConfig": "agent_loop.recipes.warmstart_options",
    "warm_start": "agent_loop.recipes.warmstart",
}

__all__ = sorted([*_EXPORTS, "rollout"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'agent_loop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def rollout(task, model: str | None = None, episodes: int = 16, backend="auto", seed: int = 0, concurrency: int = 16,
            output_path=None, progress: bool = True, *, gamma: float | None = None, estimator: str | None = None,
            **loop_options) -> list:
    """Play ``episodes`` episodes of ``task`` and return their Trajectories (index order). Blocking.

    ``task``: a task object or a name for :func:`load_task`. ``model``: a model folder (checked first with
    :func:`check_model_dir`; default: the built-in tiny agent). ``backend``: "auto" (as the CLI's ``--backend
    auto``: :func:`~agent_loop.runners.backend_choice.resolve_backend`, one line on stderr when a real model plays
    on vLLM or falls back), a name of the backend registry ("hf", "vllm") or a backend object. ``loop_options``: :class:`LoopConfig` fields
    (``max_turns=3``, ``temperature=0.0``, ...). ``output_path``: also write each episode there as it
    finishes (JSON Lines; an existing non-empty file is refused). ``gamma``, ``estimator``: recorded in each
    episode's ``info`` (as ``agent-loop rollout --gamma --estimator`` does), so ``agent-loop inspect`` of the
    file computes with them; they change nothing in the episodes.
    """
    # loaded on call, so that importing any agent_loop module stays cheap
    from agent_loop.backends.registry import make_backend
    from agent_loop.episode.loop_config import LoopConfig
    from agent_loop.model_folders import check_model_dir, model_path
    from agent_loop.runners.backend_choice import resolve_backend
    from agent_loop.runners.local import run_rollouts
    from agent_loop.runners.spec import made_with
    from agent_loop.tasks.registry import load_task

    task = load_task(task) if isinstance(task, str) else task
    config = LoopConfig(**loop_options)  # TypeError names an unknown option before anything loads
    model = model_path(model)  # None: the built-in tiny agent; a built-in model's name: its folder
    if isinstance(backend, str):  # the one choice the CLI and the trainer make
        backend, note = resolve_backend(backend, model)
        if note:
            print(note, file=sys.stderr)
    tokenizer = check_model_dir(model, backend if isinstance(backend, str) else "hf").tokenizer
    if isinstance(backend, str):
        backend = make_backend(backend, model)
    return asyncio.run(run_rollouts(task, backend, tokenizer, range(episodes), config, seed=seed,
                                    concurrency=concurrency, output_path=output_path, progress=progress,
                                    info=made_with(gamma, estimator)))
