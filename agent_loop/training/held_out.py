"""The held-out check of a fine-tuned model: held-out questions of the task played by the model in this process,
sampled at :data:`CHECK_TEMPERATURE`, and the one line that reports them (``agent_loop.recipes.warmstart``'s
``--check-episodes``), so that a warm start that did not take shows before RL starts from it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from agent_loop.backends.hf import TransformersBackend
from agent_loop.episode.contracts import as_task
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.options import plural
from agent_loop.runners.local import run_rollouts
from agent_loop.runners.stats import sampling_label
from agent_loop.training.metrics import rollout_metrics
from agent_loop.types import Trajectory

CHECK_TEMPERATURE = 1.0  # as train samples its rollouts: what RL will start from


def check_loop_config(longest: dict[str, int]) -> LoopConfig:
    """The held-out check's loop options: ``rollout``'s defaults, sampled at :data:`CHECK_TEMPERATURE`, with
    budgets raised to what the longest demonstration needs (``turns``, ``response_tokens``, ``turn_tokens``), so
    that the check measures the model, not a budget (the CLI's report names a default budget that is too small)."""
    default = LoopConfig()
    return dataclasses.replace(default, temperature=CHECK_TEMPERATURE, max_turns=max(default.max_turns, longest["turns"]),
                               max_response_tokens=max(default.max_response_tokens, longest["response_tokens"]),
                               max_tokens=max(default.max_tokens, longest["turn_tokens"]))


def held_out_check(model, tokenizer, task, episodes: int, seed: int, longest: dict[str, int], path: Path, *,
                   progress: bool = True) -> list[Trajectory]:
    """``task``'s episodes ``0..episodes-1`` under ``seed`` (a stream the model was not trained on), played by
    ``model`` in this process (the transformers backend, on the model's device), sampled
    (:func:`check_loop_config`), written to ``path`` (an earlier file there replaced)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    Path(path).unlink(missing_ok=True)  # a resumed run's earlier check
    with TransformersBackend(model, device=device, pad_token_id=pad) as backend:
        return asyncio.run(run_rollouts(as_task(task), backend, tokenizer, range(episodes), check_loop_config(longest),
                                        seed, output_path=path, progress=progress))


def check_line(trajectories: list[Trajectory]) -> str:
    """The held-out check as the CLI prints it: success with its sampling and episode count, tool calls and
    tool errors per episode (malformed calls among them); a hint when fewer than half succeed."""
    metrics, n = rollout_metrics(trajectories), len(trajectories)
    line = (f"held-out check ({sampling_label(CHECK_TEMPERATURE)}, {plural(n, 'episode')}): success "
            f"{metrics['success']:.3f}; {metrics['tool_calls']:.2f} tool calls and "
            f"{metrics['errors/tool'] / n:.2f} tool errors an episode")
    if metrics["success"] < 0.5:
        line += ("; under half: the warm start did not take (a larger --lr or more --steps; agent-loop inspect "
                 "shows the episodes)")
    return line
