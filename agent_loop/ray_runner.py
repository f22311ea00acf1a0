"""Run episodes on Ray actors, each with its own backend, and write each Trajectory as a JSON line as it finishes.

Scale-out of `agent_loop.runner.run_rollouts` (docs/design.md section 6): every episode is played by the
same `run_episode`, so for the same task, seed and episode indices the trajectories are the same as
the in-process runner's. Works on a laptop (`ray.init()`, or none: Ray starts a local cluster) and on
an existing cluster (`ray.init(address=...)` before calling).

Backends are built inside each actor by `backend_factory` (anything picklable that returns a
Backend, e.g. `functools.partial(VLLMEngineBackend, path)` for one engine per actor, or
`functools.partial(OpenAIHTTPBackend, urls, model)` for actors sharing HTTP servers).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable, Iterable

import ray

from agent_loop.loop import LoopConfig, run_episode
from agent_loop.runner import TrajectorySink
from agent_loop.types import Backend, Task, Trajectory


@ray.remote
class RolloutWorker:
    """One actor: one backend, up to `max_concurrency` episodes in flight on its event loop (an async actor)."""

    def __init__(self, task: Task, backend_factory: Callable[[], Backend], tokenizer, config: LoopConfig | None, seed: int):
        self.task, self.tokenizer, self.config, self.seed = task, tokenizer, config, seed
        self.backend = backend_factory()

    async def play(self, index: int) -> Trajectory:
        return await run_episode(self.task, index, self.backend, self.tokenizer, self.config, self.seed)

    async def close(self) -> None:
        """Shut the backend down (engine process, connection pool) if it has a `close`."""
        close = getattr(self.backend, "close", None)
        if close is not None and inspect.isawaitable(result := close()):
            await result


def run_rollouts_ray(
    task: Task,
    backend_factory: Callable[[], Backend],
    tokenizer,
    episodes: Iterable[int],
    config: LoopConfig | None = None,
    seed: int = 0,
    num_workers: int = 2,
    concurrency_per_worker: int = 16,
    output_path: str | Path | None = None,
    progress: bool = True,
    worker_options: dict | None = None,
) -> list[Trajectory]:
    """Play `episodes` (episode indices) on `num_workers` actors; return them in index order.

    Each actor keeps at most `concurrency_per_worker` episodes in flight and gets its next episode
    when one finishes, so faster actors take more. With `output_path`, each finished Trajectory is
    appended and flushed at once (finishing order), so an interrupted run keeps what had finished.
    `worker_options` go to `RolloutWorker.options` (e.g. `{"num_gpus": 1}` for one engine per GPU).
    """
    indices = list(episodes)
    options = {"max_concurrency": concurrency_per_worker, **(worker_options or {})}
    task_ref, factory_ref, tokenizer_ref = ray.put(task), ray.put(backend_factory), ray.put(tokenizer)
    workers = [
        RolloutWorker.options(**options).remote(task_ref, factory_ref, tokenizer_ref, config, seed)
        for _ in range(min(num_workers, max(len(indices), 1)))
    ]
    todo = iter(indices)
    in_flight: dict[ray.ObjectRef, RolloutWorker] = {}

    def submit(worker) -> None:
        index = next(todo, None)
        if index is not None:
            in_flight[worker.play.remote(index)] = worker

    with TrajectorySink(len(indices), f"rollout {task.name} (ray)", output_path, progress, keep=True) as sink:
        try:
            for _ in range(concurrency_per_worker):
                for worker in workers:
                    submit(worker)
            while in_flight:
                done, _ = ray.wait(list(in_flight), num_returns=1)
                worker = in_flight.pop(done[0])
                trajectory = ray.get(done[0])
                submit(worker)
                sink.add(trajectory)
        finally:
            ray.get([worker.close.remote() for worker in workers])
            for worker in workers:
                ray.kill(worker)
    return sink.in_order(indices)
