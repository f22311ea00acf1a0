"""Run many episodes concurrently (asyncio) and write each Trajectory as a JSON line as soon as it finishes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

from agent_loop.loop import LoopConfig, run_episode
from agent_loop.types import Backend, Task, Trajectory


class TrajectorySink:
    """Where finished episodes go, in finishing order: a JSON line each (appended and flushed at once, so
    an interrupted run keeps what had finished) and a progress bar with the running success rate."""

    def __init__(self, total: int, description: str, output_path: str | Path | None = None, progress: bool = True):
        self.results: dict[int, Trajectory] = {}
        self.file = open(output_path, "a", encoding="utf-8") if output_path else None
        self.bar = tqdm(total=total, desc=description, unit="ep", disable=not progress)

    def add(self, trajectory: Trajectory) -> None:
        self.results[trajectory.info["index"]] = trajectory
        if self.file:
            self.file.write(trajectory.to_json() + "\n")
            self.file.flush()
        self.bar.update()
        self.bar.set_postfix(success=f"{sum(t.reward > 0 for t in self.results.values()) / len(self.results):.2f}")

    def in_order(self, indices: list[int]) -> list[Trajectory]:
        return [self.results[i] for i in indices]

    def __enter__(self) -> "TrajectorySink":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
        if self.file:
            self.file.close()


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

    with TrajectorySink(len(indices), f"rollout {task.name}", output_path, progress) as sink:
        for finished in asyncio.as_completed([play(i) for i in indices]):
            sink.add(await finished)
    return sink.in_order(indices)


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read a JSON Lines file written by :func:`run_rollouts` (strict: any bad line raises)."""
    with open(path, encoding="utf-8") as f:
        return [Trajectory.from_json(line) for line in f if line.strip()]
