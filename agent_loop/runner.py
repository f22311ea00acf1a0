"""Run many episodes concurrently (asyncio) and write each Trajectory as a JSON line as soon as it finishes.

Memory stays flat however many episodes a run plays: finished episodes go to the file and into
:class:`RolloutStats` (O(1) running counts), and are kept in memory only when asked
(:func:`run_rollouts` asks; :func:`stream_rollouts` keeps nothing but a bounded sample).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

from agent_loop.loop import LoopConfig, run_episode
from agent_loop.types import Backend, Task, Trajectory


@dataclass
class RolloutStats:
    """Running totals of a rollout, updated per finished episode in O(1) time and memory.

    ``first_errors`` keeps the first ``max_errors`` backend errors (index, message), so a run whose
    episodes all failed can say why; ``sample`` keeps the episodes whose index is in ``sample_indices``
    (for a summary of the batch tensors without holding the whole run).
    """

    episodes: int = 0
    successes: int = 0
    reward_sum: float = 0.0
    turns: int = 0
    assistant_tokens: int = 0
    observation_tokens: int = 0
    tool_calls: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    tool_errors: Counter = field(default_factory=Counter)
    first_errors: list[tuple[int, str]] = field(default_factory=list)
    max_errors: int = 3
    sample_indices: frozenset = frozenset()
    sample: list[Trajectory] = field(default_factory=list)

    def add(self, trajectory: Trajectory) -> None:
        metrics = trajectory.metrics
        self.episodes += 1
        self.successes += trajectory.success
        self.reward_sum += trajectory.reward
        self.turns += metrics.get("turns", 0)
        self.assistant_tokens += metrics.get("assistant_tokens", 0)
        self.observation_tokens += metrics.get("observation_tokens", 0)
        self.tool_calls += metrics.get("tool_calls", 0)
        self.finish_reasons[trajectory.finish_reason] += 1
        self.tool_errors.update(metrics.get("tool_errors", {}))
        if trajectory.finish_reason == "error" and len(self.first_errors) < self.max_errors:
            message = metrics.get("backend_error") or trajectory.info.get("error") or "no message recorded"
            self.first_errors.append((trajectory.info.get("index", -1), str(message)))
        if trajectory.info.get("index") in self.sample_indices:
            self.sample.append(trajectory)

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    def mean(self, name: str) -> float:
        """Per-episode mean of a running total (``reward_sum``, ``turns``, ``assistant_tokens``, ...)."""
        return getattr(self, name) / self.episodes if self.episodes else 0.0


class TrajectorySink:
    """Where finished episodes go, in finishing order: a JSON line each (appended and flushed at once, so
    an interrupted run keeps what had finished) and a progress bar with the running success rate.

    Memory: ``stats`` (O(1)); the trajectories themselves only with ``keep=True``.
    """

    def __init__(self, total: int, description: str, output_path: str | Path | None = None, progress: bool = True,
                 *, keep: bool = False, stats: RolloutStats | None = None):
        self.results: dict[int, Trajectory] | None = {} if keep else None
        self.stats = stats if stats is not None else RolloutStats()
        self.file = open(output_path, "a", encoding="utf-8") if output_path else None
        self.bar = tqdm(total=total, desc=description, unit="ep", disable=not progress)

    def add(self, trajectory: Trajectory) -> None:
        if self.results is not None:
            self.results[trajectory.info["index"]] = trajectory
        self.stats.add(trajectory)
        if self.file:
            self.file.write(trajectory.to_json() + "\n")
            self.file.flush()
        if not self.bar.disable:  # the postfix is redrawn with the bar (tqdm rate-limits that), not per episode
            self.bar.set_postfix_str(f"success={self.stats.success_rate:.2f}", refresh=False)
        self.bar.update()

    def in_order(self, indices: list[int]) -> list[Trajectory]:
        if self.results is None:
            raise RuntimeError("TrajectorySink(keep=False) keeps no trajectories; pass keep=True to get them back")
        return [self.results[i] for i in indices]

    def __enter__(self) -> "TrajectorySink":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
        if self.file:
            self.file.close()


async def stream_rollouts(
    task: Task,
    backend: Backend,
    tokenizer,
    episodes: Iterable[int],
    config: LoopConfig | None = None,
    seed: int = 0,
    concurrency: int = 16,
    output_path: str | Path | None = None,
    progress: bool = True,
    *,
    keep: bool = False,
    sample_size: int = 0,
    total: int | None = None,
) -> tuple[RolloutStats, list[Trajectory] | None]:
    """Play ``episodes`` with at most ``concurrency`` in flight; return running statistics (and, with
    ``keep=True``, the trajectories in index order).

    ``concurrency`` worker tasks pull the next index from ``episodes`` when one finishes, so a run of
    any length holds ``concurrency`` episodes in flight and no more (``episodes`` may be a lazy
    iterable; ``total`` sizes the progress bar then). Without ``keep``, memory does not grow with the
    run: each Trajectory goes to ``output_path`` (appended and flushed at once, so an interrupted run
    keeps every episode that had finished) and into the :class:`RolloutStats`, whose ``sample`` holds
    the first ``sample_size`` episodes of ``episodes``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if total is None:
        episodes = list(episodes)
        total = len(episodes)
    todo = iter(episodes)
    if keep or sample_size:
        order: list[int] = []

        def tracked(iterator):
            for index in iterator:
                if keep:
                    order.append(index)
                yield index

        head = list(itertools.islice(todo, sample_size))
        todo = tracked(itertools.chain(head, todo))
    stats = RolloutStats(sample_indices=frozenset(head) if sample_size else frozenset())

    with TrajectorySink(total, f"rollout {task.name}", output_path, progress, keep=keep, stats=stats) as sink:
        async def worker() -> None:
            for index in todo:  # one shared iterator: each index is played once
                sink.add(await run_episode(task, index, backend, tokenizer, config, seed))

        workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, max(total, 1)))]
        try:
            await asyncio.gather(*workers)
        except BaseException:  # an episode raised, or we were cancelled: stop the rest, raise the first error
            for task_ in workers:
                task_.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
    return stats, (sink.in_order(order) if keep else None)


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

    Keeps every Trajectory in memory (what a training step needs); for long runs use
    :func:`stream_rollouts`, which keeps only running statistics. With ``output_path``, each finished
    Trajectory is appended and flushed at once, so an interrupted run keeps every episode that had finished.
    """
    _, trajectories = await stream_rollouts(task, backend, tokenizer, episodes, config, seed, concurrency,
                                            output_path, progress, keep=True)
    return trajectories


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read a JSON Lines file written by :func:`run_rollouts` (strict: any bad line raises)."""
    with open(path, encoding="utf-8") as f:
        return [Trajectory.from_json(line) for line in f if line.strip()]
