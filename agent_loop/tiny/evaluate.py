"""The tiny agent's check: held-out episodes played through the real agent loop (``run_episode``).

The model runs in a :class:`TransformersBackend`, so calls are parsed by the template's parser,
the real tools run, and observations are the chat template's tokens, exactly as in a rollout.
"""

from __future__ import annotations

import asyncio

from agent_loop.backends.hf import TransformersBackend
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.tasks.registry import get_task
from agent_loop.tiny.data import ideal_calls
from agent_loop.types import Trajectory

# Turns: the ideal tool calls and the answer; 64 tokens a turn is twice what a good reply needs.
EVAL_CONFIG = dict(max_tokens=64, max_response_tokens=512)


def evaluate(model, tokenizer, task_name: str, episodes: int, seed: int, greedy: bool) -> dict:
    """Rates over ``episodes`` held-out episodes: a well-formed tool call in the first turn (it parses and
    names a known tool), the ideal arguments in it, and the task's success."""
    task = get_task(task_name)
    backend = TransformersBackend(model, pad_token_id=tokenizer.pad_token_id or 0)
    turns = len(ideal_calls(task_name, task.make_episode(0, seed).info)) + 1
    config = LoopConfig(temperature=0.0 if greedy else 1.0, max_turns=turns, **EVAL_CONFIG)

    async def play() -> list[Trajectory]:
        return await asyncio.gather(*(run_episode(task, i, backend, tokenizer, config, seed) for i in range(episodes)))

    trajectories = asyncio.run(play())
    first_calls = [t.tool_calls[0] if t.tool_calls and t.tool_calls[0].turn == 0 else None for t in trajectories]
    well_formed = [c is not None and c.error_kind not in ("malformed_json", "unknown_tool") for c in first_calls]
    right = [ok and c.arguments == ideal_calls(task_name, t.info)[0][1] for ok, c, t in zip(well_formed, first_calls, trajectories)]
    return {
        "task": task_name,
        "episodes": episodes,
        "greedy": greedy,
        "well_formed": sum(well_formed) / episodes,
        "right_arguments": sum(right) / episodes,
        "success": sum(t.success for t in trajectories) / episodes,
    }
