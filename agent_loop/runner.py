"""Run many episodes concurrently (asyncio) and write each Trajectory as a JSON line as soon as it finishes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

from agent_loop.loop import LoopConfig, run_episode
from agent_loop.types import Backend, Task, Trajectory


async def run_rollouts(
    task: Task,
    backend: Backend,
    tokenizer,
    episodes: Iterable[int],
    config: LoopConfig | None = None,
    seed: int = 0,
    concurrency: int = 16,
    output_path: str | Path | None = None,
    progress: bool = True,
) -> list[Trajectory]:
    """Play ``episodes`` (episode indices) with at most ``concurrency`` in flight; return them in index order.

    With ``output_path``, each finished Trajectory is appended and flushed at once, so an interrupted
    run keeps every episode that had finished.
    """
    indices = list(episodes)
    gate = asyncio.Semaphore(concurrency)

    async def play(index: int) -> Trajectory:
        async with gate:
            return await run_episode(task, index, backend, tokenizer, config, seed)

    results: dict[int, Trajectory] = {}
    sink = open(output_path, "a", encoding="utf-8") if output_path else None
    bar = tqdm(total=len(indices), desc=f"rollout {task.name}", unit="ep", disable=not progress)
    try:
        for finished in asyncio.as_completed([play(i) for i in indices]):
            trajectory = await finished
            results[trajectory.info["index"]] = trajectory
            if sink:
                sink.write(trajectory.to_json() + "\n")
                sink.flush()
            bar.update()
            bar.set_postfix(success=f"{sum(t.reward > 0 for t in results.values()) / len(results):.2f}")
    finally:
        bar.close()
        if sink:
            sink.close()
    return [results[i] for i in indices]


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read a JSON Lines file written by :func:`run_rollouts` (strict: any bad line raises)."""
    with open(path, encoding="utf-8") as f:
        return [Trajectory.from_json(line) for line in f if line.strip()]
