"""Run many episodes concurrently (asyncio) and write each Trajectory as a JSON line as soon as it finishes.

One bad episode never aborts a run: an exception from an episode (a tool that broke the tokenizer, a
backend that kept failing) becomes a Trajectory with finish "error" and the error in
``metrics["error"]``, and the run goes on. Only an exception marked ``fatal`` (the HTTP backend's
circuit breaker: every server down for longer than its retry deadline) stops the run; the episodes
already written stay, and ``agent-loop rollout --resume`` plays the rest later.

Memory stays flat however many episodes a run plays: finished episodes go to the file and into
:class:`RolloutStats` (O(1) running counts), and are kept in memory only when asked
(:func:`run_rollouts` asks; :func:`stream_rollouts` keeps nothing but a bounded sample).
"""

from __future__ import annotations

import asyncio
import itertools
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

from agent_loop.jsonl import JsonlWriter
from agent_loop.loop import LoopConfig, run_episode
from agent_loop.types import Backend, Task, Trajectory


def is_fatal(error: BaseException) -> bool:
    """Whether ``error`` should stop the whole run instead of ending one episode (``error.fatal`` is true)."""
    return bool(getattr(error, "fatal", False))


def error_trajectory(task: Task, index: int, seed: int, error: BaseException | str, tokenizer=None) -> Trajectory:
    """The record of an episode that raised: finish "error", no response, the error text in ``metrics["error"]``.

    Its prompt ids are rendered when that still works (so a training batch keeps its shape), else empty.
    """
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    prompt_ids: list[int] = []
    messages: list[dict] = []
    try:
        from agent_loop.loop import _formatter
        from agent_loop.tools import ToolExecutor

        episode = task.make_episode(index, seed)
        messages = [dict(m) for m in episode.messages]
        if tokenizer is not None:
            prompt_ids = _formatter(tokenizer, ToolExecutor(episode.tools).schemas).prompt_ids(messages)
    except Exception:  # the prompt itself may be what failed; the record still names the episode
        pass
    metrics = {"turns": 0, "turn_tokens": [], "assistant_tokens": 0, "observation_tokens": 0, "tool_calls": 0,
               "tool_errors": {}, "observation_truncations": 0, "generate_s": 0.0, "tools_s": 0.0, "total_s": 0.0,
               "error": message}
    return Trajectory(prompt_ids=prompt_ids, response_ids=[], spans=[], turn_ids=[], logprobs=[], messages=messages,
                      reward=0.0, finish_reason="error", metrics=metrics,
                      info={"task": task.name, "index": index, "seed": seed, "success": False})


async def play_episode(task: Task, index: int, backend: Backend, tokenizer, config: LoopConfig | None = None,
                       seed: int = 0) -> Trajectory:
    """``run_episode``, with any non-fatal exception turned into an :func:`error_trajectory`."""
    try:
        return await run_episode(task, index, backend, tokenizer, config, seed)
    except Exception as error:
        if is_fatal(error):
            raise
        trajectory = error_trajectory(task, index, seed, error, tokenizer)
        trajectory.metrics["traceback"] = "".join(traceback.format_exception(error)[-3:])[-2000:]
        return trajectory


def episode_error(trajectory: Trajectory) -> str | None:
    """The error an episode ended with (raised, or from the backend), or None."""
    if trajectory.finish_reason != "error":
        return None
    return trajectory.metrics.get("error") or trajectory.metrics.get("backend_error") or "error"


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
    template_mismatches: int = 0  # episodes whose tokens differ from a one-go render of their messages
    template_drifts: int = 0  # episodes that ran in history_mode="keep_seen" and drifted from a fresh render
    task_metrics: Counter = field(default_factory=Counter)  # sums of the task's own per-episode numbers
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
        self.template_mismatches += bool(metrics.get("template_mismatch"))
        self.template_drifts += bool(metrics.get("template_drift"))
        self.finish_reasons[trajectory.finish_reason] += 1
        self.tool_errors.update(metrics.get("tool_errors", {}))
        self.task_metrics.update(metrics.get("task", {}))
        if trajectory.finish_reason == "error" and len(self.first_errors) < self.max_errors:
            self.first_errors.append((trajectory.info.get("index", -1), episode_error(trajectory)))
        if trajectory.info.get("index") in self.sample_indices:
            self.sample.append(trajectory)

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    def mean(self, name: str) -> float:
        """Per-episode mean of a running total (``reward_sum``, ``turns``, ``assistant_tokens``, ...)."""
        return getattr(self, name) / self.episodes if self.episodes else 0.0


class TrajectorySink:
    """Where finished episodes go, in finishing order: a JSON line each (one whole-line write, so an
    interrupted run keeps what had finished; see ``agent_loop.jsonl``), running statistics, and a
    progress bar with the running success rate.

    ``output_mode``: "new" refuses an existing non-empty file, "append"/"resume" add to it (a torn last
    line is cut first). Memory: ``stats`` (O(1)); the trajectories themselves only with ``keep=True``.
    """

    def __init__(self, total: int, description: str, output_path: str | Path | None = None, progress: bool = True,
                 output_mode: str = "new", *, keep: bool = False, stats: RolloutStats | None = None):
        self.results: dict[int, Trajectory] | None = {} if keep else None
        self.stats = stats if stats is not None else RolloutStats()
        self.file = JsonlWriter(output_path, output_mode) if output_path else None
        self.bar = tqdm(total=total, desc=description, unit="ep", disable=not progress)

    def add(self, trajectory: Trajectory) -> None:
        if self.results is not None:
            self.results[trajectory.info["index"]] = trajectory
        self.stats.add(trajectory)
        if self.file:
            self.file.write_line(trajectory.to_json())
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


async def _close_connections(backend: Backend) -> None:
    close = getattr(backend, "close_connections", None)
    if close is not None:
        await close()


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
    output_mode: str = "new",
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
    run: each Trajectory goes to ``output_path`` (``output_mode`` as in :class:`TrajectorySink`; written
    at once, so an interrupted run keeps every episode that had finished) and into the
    :class:`RolloutStats`, whose ``sample`` holds the first ``sample_size`` episodes of ``episodes``.
    An episode that raises is recorded with finish "error"; a fatal backend error cancels the rest and
    is raised. The backend's connections (if it has ``close_connections``) are closed before returning.
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

    try:
        with TrajectorySink(total, f"rollout {task.name}", output_path, progress, output_mode, keep=keep,
                            stats=stats) as sink:
            async def worker() -> None:
                for index in todo:  # one shared iterator: each index is played once
                    sink.add(await play_episode(task, index, backend, tokenizer, config, seed))

            workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, max(total, 1)))]
            try:
                await asyncio.gather(*workers)
            except BaseException:  # a fatal error, or we were cancelled: stop the rest, raise the first error
                for task_ in workers:
                    task_.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                raise
    finally:
        await _close_connections(backend)
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
    output_mode: str = "new",
) -> list[Trajectory]:
    """Play ``episodes`` (episode indices) with at most ``concurrency`` in flight; return them in index order.

    Keeps every Trajectory in memory (what a training step needs); for long runs use
    :func:`stream_rollouts`, which keeps only running statistics. With ``output_path``, each finished
    Trajectory is appended and flushed at once, so an interrupted run keeps every episode that had finished.
    """
    _, trajectories = await stream_rollouts(task, backend, tokenizer, episodes, config, seed, concurrency,
                                            output_path, progress, output_mode, keep=True)
    return trajectories


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read a JSON Lines file written by :func:`run_rollouts` (strict: any bad line raises)."""
    with open(path, encoding="utf-8") as f:
        return [Trajectory.from_json(line) for line in f if line.strip()]


def plan_output(path: str | Path, episodes: Iterable[int], seed: int, task_name: str, *, resume: bool = False,
                append: bool = False) -> tuple[str, list[int]]:
    """Check the output before anything runs; return its mode and the episodes still to play.

    Without ``resume``/``append`` an existing non-empty file is refused (``OutputExistsError``), never
    emptied; ``resume`` drops the episodes the file already holds for this seed and task (by index).
    """
    from agent_loop.jsonl import check_output, written_episodes

    if resume and append:
        raise ValueError("--resume and --append exclude each other")
    mode = "resume" if resume else "append" if append else "new"
    check_output(path, mode)
    indices = list(episodes)
    if resume:
        done = written_episodes(path, seed, task_name)
        indices = [i for i in indices if i not in done]
    return mode, indices


def error_status(stats: RolloutStats, max_error_fraction: float) -> tuple[int, list[str]]:
    """Exit status (0, or 1 when more than ``max_error_fraction`` of the episodes ended with an error) and
    lines to print about the errors (their count and the first ones, by episode index)."""
    failed = stats.finish_reasons.get("error", 0)
    if not failed:
        return 0, []
    lines = [f"{failed} of {stats.episodes} episodes ended with an error; the first:",
             *(f"episode {index}: {message[:300]}" for index, message in sorted(stats.first_errors))]
    return int(failed > max_error_fraction * stats.episodes), lines
