"""Run many episodes concurrently (asyncio) and write each Trajectory as a JSON line as soon as it finishes.

One bad episode never aborts a run: an exception from an episode (a tool that broke the tokenizer, a
backend that kept failing) becomes a Trajectory with finish "error" and the error in
``metrics["error"]``, and the run goes on. Only an exception marked ``fatal`` (the HTTP backend's
circuit breaker: every server down for longer than its retry deadline) stops the run; the episodes
already written stay, and ``agent-loop rollout --resume`` plays the rest later.
"""

from __future__ import annotations

import asyncio
import traceback
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


def first_errors(trajectories: Iterable[Trajectory], limit: int = 3) -> list[str]:
    """``"episode I: error"`` for the first ``limit`` episodes (by index) that ended with an error."""
    failed = sorted((t for t in trajectories if t.finish_reason == "error"), key=lambda t: t.info.get("index", 0))
    return [f"episode {t.info.get('index')}: {episode_error(t)[:300]}" for t in failed[:limit]]


class TrajectorySink:
    """Where finished episodes go, in finishing order: a JSON line each (one whole-line write, so an
    interrupted run keeps what had finished; see ``agent_loop.jsonl``) and a progress bar with the
    running success rate.

    ``output_mode``: "new" refuses an existing non-empty file, "append"/"resume" add to it (a torn last
    line is cut first).
    """

    def __init__(self, total: int, description: str, output_path: str | Path | None = None, progress: bool = True,
                 output_mode: str = "new"):
        self.results: dict[int, Trajectory] = {}
        self.file = JsonlWriter(output_path, output_mode) if output_path else None
        self.bar = tqdm(total=total, desc=description, unit="ep", disable=not progress)

    def add(self, trajectory: Trajectory) -> None:
        self.results[trajectory.info["index"]] = trajectory
        if self.file:
            self.file.write_line(trajectory.to_json())
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


async def _close_connections(backend: Backend) -> None:
    close = getattr(backend, "close_connections", None)
    if close is not None:
        await close()


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

    With ``output_path``, each finished Trajectory is appended at once (``output_mode`` as in
    :class:`TrajectorySink`), so an interrupted run keeps every episode that had finished. An episode
    that raises is recorded with finish "error"; a fatal backend error cancels the rest and is raised.
    The backend's connections (if it has ``close_connections``) are closed before returning.
    """
    indices = list(episodes)
    gate = asyncio.Semaphore(concurrency)

    async def play(index: int) -> Trajectory:
        async with gate:
            return await play_episode(task, index, backend, tokenizer, config, seed)

    try:
        with TrajectorySink(len(indices), f"rollout {task.name}", output_path, progress, output_mode) as sink:
            tasks = [asyncio.ensure_future(play(i)) for i in indices]
            try:
                for finished in asyncio.as_completed(tasks):
                    sink.add(await finished)
            finally:
                for pending in tasks:
                    pending.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await _close_connections(backend)
    return sink.in_order(indices)


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


def error_status(trajectories: list[Trajectory], max_error_fraction: float) -> tuple[int, list[str]]:
    """Exit status (0, or 1 when more than ``max_error_fraction`` of the episodes ended with an error) and
    lines to print about the errors (their count and the first ones)."""
    failed = sum(t.finish_reason == "error" for t in trajectories)
    if not failed:
        return 0, []
    lines = [f"{failed} of {len(trajectories)} episodes ended with an error; the first:", *first_errors(trajectories)]
    return int(failed > max_error_fraction * len(trajectories)), lines
