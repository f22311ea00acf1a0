"""Run many episodes concurrently (asyncio) and write each Trajectory as a JSON line as soon as it finishes.

One bad episode never aborts a run: an exception from an episode (a tool that broke the tokenizer, a
backend that kept failing) becomes a Trajectory with finish "error" and the error in
``metrics["error"]``, and the run goes on. Only an exception marked ``fatal`` (the HTTP backend's
circuit breaker: every server down for longer than its retry deadline) stops the run; the episodes
already written stay, and ``agent-loop rollout --resume`` plays the rest later.

Memory stays flat however many episodes a run plays: finished episodes go to the file and into
:class:`~agent_loop.runners.stats.RolloutStats` (O(1) running counts), and are kept in memory only when
asked (:func:`run_rollouts` asks; :func:`stream_rollouts` keeps nothing but a bounded sample).
"""

from __future__ import annotations

import asyncio
import itertools
import traceback
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

from agent_loop.backends.base import Backend, check_backend, is_fatal
from agent_loop.episode.contracts import Task
from agent_loop.episode.info import episode_info
from agent_loop.episode.loop import formatter_for, run_session
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tools import ToolExecutor
from agent_loop.options import rate
from agent_loop.runners.jsonl import MAX_LINE_BYTES, JsonlWriter, check_output, iter_lines, written_episodes
from agent_loop.runners.spec import RunSpec
from agent_loop.runners.stats import RolloutStats
from agent_loop.types import Trajectory, episode_session_id


def error_trajectory(task: Task, index: int, seed: int, error: BaseException | str, tokenizer=None) -> Trajectory:
    """The record of an episode that raised: finish "error", no response, the error text in ``metrics["error"]``.

    Its prompt ids are rendered when that still works (so a training batch keeps its shape), else empty.
    """
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    prompt_ids: list[int] = []
    messages: list[dict] = []
    # the episode's answer, session and own info, as a played episode's record has them
    session = {"session_id": episode_session_id(task.name, seed, index), "segment": 0}
    identity, extra = session, {}
    try:
        episode = task.make_episode(index, seed)
        identity, extra = {"answer": episode.answer, **session}, dict(episode.info)
        messages = [dict(m) for m in episode.messages]
        if tokenizer is not None:
            prompt_ids = formatter_for(tokenizer, ToolExecutor(episode.tools).schemas).prompt_ids(messages)
    except Exception:  # the prompt itself may be what failed; the record still names the episode
        pass
    metrics = {"turns": 0, "turn_tokens": [], "assistant_tokens": 0, "observation_tokens": 0, "tool_calls": 0,
               "tool_errors": {}, "observation_truncations": 0, "generate_s": 0.0, "tools_s": 0.0, "total_s": 0.0,
               "error": message}
    return Trajectory(prompt_ids=prompt_ids, response_ids=[], spans=[], turn_ids=[], logprobs=[], messages=messages,
                      reward=0.0, finish_reason="error", metrics=metrics,
                      info=episode_info(task.name, index, seed, success=False, tokenizer=tokenizer, identity=identity,
                                        extra=extra))


async def play_episode(task: Task, index: int, backend: Backend, tokenizer, config: LoopConfig | None = None,
                       seed: int = 0) -> list[Trajectory]:
    """``run_session`` (the episode's segments: one, unless its context policy rewrote its history), with any
    non-fatal exception turned into an :func:`error_trajectory`."""
    try:
        return await run_session(task, index, backend, tokenizer, config, seed)
    except Exception as error:
        if is_fatal(error):
            raise
        trajectory = error_trajectory(task, index, seed, error, tokenizer)
        trajectory.metrics["traceback"] = "".join(traceback.format_exception(error)[-3:])[-2000:]
        return [trajectory]


class TrajectorySink:
    """Where finished episodes go, in finishing order: a JSON line each (one whole-line write, so an
    interrupted run keeps what had finished; see :mod:`agent_loop.runners.jsonl`), running statistics, and a
    progress bar with the running success rate.

    ``output_mode``: "new" refuses an existing non-empty file, "append"/"resume" add to it (a torn last
    line is cut first). ``info``: keys added to each episode's ``info`` (``RunSpec.recorded()``: how the
    run was made). Memory: ``stats`` (O(1)); the trajectories themselves only with ``keep=True``.
    """

    def __init__(self, total: int, description: str, output_path: str | Path | None = None, progress: bool = True,
                 output_mode: str = "new", *, keep: bool = False, stats: RolloutStats | None = None,
                 info: dict | None = None):
        self.info = info or {}
        self.results: dict[int, list[Trajectory]] | None = {} if keep else None  # index -> its segments
        self.stats = stats if stats is not None else RolloutStats()
        self.file = JsonlWriter(output_path, output_mode) if output_path else None
        self.bar = tqdm(total=total, desc=description, unit="ep", disable=not progress)

    def add(self, trajectory: Trajectory) -> None:
        trajectory.info.update({k: dict(v) if isinstance(v, dict) else v for k, v in self.info.items()})
        if self.results is not None:
            self.results.setdefault(trajectory.info["index"], []).append(trajectory)
        self.stats.add(trajectory)
        if self.file:
            self.file.write_line(trajectory.to_json())
        if not self.bar.disable:  # the postfix is redrawn with the bar (tqdm rate-limits that), not per episode
            self.bar.set_postfix_str(f"success={rate(self.stats.success_rate)}", refresh=False)
        self.bar.update()

    def add_episode(self, segments: list[Trajectory]) -> None:
        """A finished episode: its records, one per segment (one unless its history was rewritten), in order."""
        for trajectory in segments:
            self.add(trajectory)

    def in_order(self, indices: list[int]) -> list[Trajectory]:
        if self.results is None:
            raise RuntimeError("TrajectorySink(keep=False) keeps no trajectories; pass keep=True to get them back")
        return [t for i in indices for t in sorted(self.results[i], key=lambda t: t.segment)]

    def __enter__(self) -> "TrajectorySink":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
        if self.file:
            self.file.close()


async def stream_rollouts(spec: RunSpec, backend: Backend, *, concurrency: int = 16, keep: bool = False,
                          sample_size: int = 0, total: int | None = None) -> tuple[RolloutStats, list[Trajectory] | None]:
    """Play ``spec.episodes`` with at most ``concurrency`` in flight; return running statistics (and, with
    ``keep=True``, the trajectories in the order of ``spec.episodes``).

    ``concurrency`` worker tasks pull the next index when one finishes, so a run of any length holds
    ``concurrency`` episodes in flight and no more (``spec.episodes`` may be a lazy iterable; ``total``
    sizes the progress bar then). Without ``keep``, memory does not grow with the run: each Trajectory
    goes to ``spec.output_path`` (written at once, so an interrupted run keeps every episode that had
    finished) and into the :class:`RolloutStats`, whose ``sample`` holds the first ``sample_size``
    episodes. An episode that raises is recorded with finish "error"; a fatal backend error cancels the
    rest and is raised. The backend's :meth:`~agent_loop.backends.base.Backend.end_run` runs before returning.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    check_backend(backend)
    episodes = spec.episodes if total is not None else list(spec.episodes)
    total = len(episodes) if total is None else total
    todo, order, head = iter(episodes), [] if keep else None, []
    if keep or sample_size:
        head = list(itertools.islice(todo, sample_size))
    todo = tracked(itertools.chain(head, todo), order)
    stats = RolloutStats(sample_indices=frozenset(head))
    try:
        with TrajectorySink(total, f"rollout {spec.task.name}", spec.output_path, spec.progress, spec.output_mode,
                            keep=keep, stats=stats, info=spec.recorded()) as sink:
            async def next_index() -> int | None:
                return next(todo, None)  # one shared iterator: each index is played once

            await play_pool(spec, backend, sink, next_index, workers=min(concurrency, max(total, 1)))
    finally:
        await backend.end_run()
    return stats, (sink.in_order(order) if keep else None)


def tracked(indices: Iterable[int], order: list[int] | None) -> Iterable[int]:
    """``indices``, each appended to ``order`` (when given) as it is handed out: the one place a runner records
    the order its episodes were handed out in (what ``TrajectorySink.in_order`` returns them by)."""
    for index in indices:
        if order is not None:
            order.append(index)
        yield index


async def play_pool(spec: RunSpec, backend: Backend, sink: TrajectorySink, next_index, *, workers: int) -> None:
    """The in-process worker pool (the local runner's and the asynchronous producer's): ``workers`` tasks, each
    awaiting ``next_index()`` (an episode index, or None: no more), playing it with :func:`play_episode` and
    handing the Trajectory to ``sink`` (which stamps the run's ``info``). A fatal backend error (or a
    cancellation) stops the other workers, then is raised."""
    async def worker() -> None:
        while (index := await next_index()) is not None:
            sink.add_episode(await play_episode(spec.task, index, backend, spec.tokenizer, spec.config, spec.seed))

    tasks = [asyncio.ensure_future(worker()) for _ in range(workers)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)  # a cancel here stays ours
        for task in done:
            task.result()  # a worker's error
    finally:
        while not all(task.done() for task in tasks):
            for task in tasks:  # again each second: a plug-in's own except may swallow one cancel
                task.cancel()
            await asyncio.wait(tasks, timeout=1.0)
        await asyncio.gather(*tasks, return_exceptions=True)  # all done: their errors are collected, not logged


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
    *,
    info: dict | None = None,
) -> list[Trajectory]:
    """Play ``episodes`` (episode indices) with at most ``concurrency`` in flight; return them in index order.

    Keeps every Trajectory in memory (what a training step needs); for long runs use
    :func:`stream_rollouts`, which keeps only running statistics. With ``output_path``, each finished
    Trajectory is appended and flushed at once, so an interrupted run keeps every episode that had finished.
    Each episode's ``info`` records the loop options (``options``) and ``info`` (``RunSpec.info``, e.g.
    ``made_with(gamma=0.9)``).
    """
    spec = RunSpec(task, tokenizer, episodes, config, seed, output_path, output_mode, progress, info or {})
    _, trajectories = await stream_rollouts(spec, backend, concurrency=concurrency, keep=True)
    return trajectories


def read_trajectories(path: str | Path, *, max_line_bytes: int = MAX_LINE_BYTES) -> list[Trajectory]:
    """Read a JSON Lines file written by :func:`run_rollouts` (strict: any bad line raises).

    Lines are read with the CLI readers' cap (:func:`~agent_loop.runners.jsonl.iter_lines`): a line longer
    than ``max_line_bytes`` raises ValueError naming it, without being loaded.
    """
    trajectories = []
    with open(path, "rb") as f:
        for number, _, raw, _ in iter_lines(f, max_line_bytes):
            if raw is None:
                raise ValueError(f"{path}: line {number} is longer than {max_line_bytes} bytes (not read)")
            if raw.strip():
                trajectories.append(Trajectory.from_json(raw.decode("utf-8")))
    return trajectories


def plan_output(path: str | Path, episodes: range, seed: int, task_name: str, *, resume: bool = False,
                append: bool = False) -> tuple[str, Iterable[int], int]:
    """Check the output before anything runs; return its mode, the episodes still to play (a lazy iterable:
    ``--episodes 50000000`` builds no list) and how many they are.

    Without ``resume``/``append`` an existing non-empty file is refused (``OutputExistsError``), never
    emptied; ``resume`` drops the episodes the file already holds for this seed and task (by index; the
    file is read a line at a time, memory is the set of indices written).
    """
    if resume and append:
        raise ValueError("--resume and --append exclude each other")
    mode = "resume" if resume else "append" if append else "new"
    check_output(path, mode)
    if not resume:
        return mode, episodes, len(episodes)
    done = written_episodes(path, seed, task_name)
    if not done:
        return mode, episodes, len(episodes)
    return mode, (i for i in episodes if i not in done), len(episodes) - sum(1 for i in done if i in episodes)


def error_status(stats: RolloutStats, max_error_fraction: float) -> tuple[int, list[str]]:
    """Exit status (0, or 1 when more than ``max_error_fraction`` of the episodes ended with an error) and
    lines to print about the errors (their count and the first ones, by episode index)."""
    failed = stats.finish_reasons.get("error", 0)
    if not failed:
        return 0, []
    scoring = f" ({stats.reward_errors} in scoring: the reward failed or hung)" if stats.reward_errors else ""
    lines = [f"{failed} of {stats.episodes} episodes ended with an error{scoring}; the first:",
             *(f"episode {index}: {message[:300]}" for index, message in sorted(stats.first_errors))]
    return int(failed > max_error_fraction * stats.episodes), lines
