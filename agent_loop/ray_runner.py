"""Run episodes on Ray actors, each with its own backend, and write each Trajectory as a JSON line as it finishes.

Scale-out of `agent_loop.runner.run_rollouts` (docs/design.md section 6): every episode is played by the
same `run_episode`, so for the same task, seed and episode indices the trajectories are the same as
the in-process runner's. Works on a laptop (`ray.init()`, or none: Ray starts a local cluster) and on
an existing cluster (`ray.init(address=...)` before calling).

Backends are built inside each actor by `backend_factory` (anything picklable that returns a
Backend, e.g. `functools.partial(VLLMEngineBackend, path)` for one engine per actor, or
`functools.partial(OpenAIHTTPBackend, urls, model)` for actors sharing HTTP servers).

Faults: an actor that dies (killed, out of memory, node lost) is replaced by a fresh one, and the
episodes it had in flight are played again elsewhere (each is deterministic in its index and seed);
episodes it had finished are already written and kept. An episode that raises is written with
finish "error" (`agent_loop.runner.play_episode`); only a fatal backend error stops the run.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections import deque
from pathlib import Path
from typing import Callable, Iterable

import ray

from agent_loop.loop import LoopConfig
from agent_loop.runner import TrajectorySink, error_trajectory, is_fatal, play_episode
from agent_loop.types import Backend, Task, Trajectory

_quiet = contextlib.suppress(Exception)  # closing or killing actors that may already be dead


@ray.remote
class RolloutWorker:
    """One actor: one backend, up to `max_concurrency` episodes in flight on its event loop (an async actor)."""

    def __init__(self, task: Task, backend_factory: Callable[[], Backend], tokenizer, config: LoopConfig | None, seed: int):
        self.task, self.tokenizer, self.config, self.seed = task, tokenizer, config, seed
        self.backend = backend_factory()

    async def play(self, index: int) -> Trajectory:
        return await play_episode(self.task, index, self.backend, self.tokenizer, self.config, self.seed)

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
    output_mode: str = "new",
    max_worker_replacements: int | None = None,
    max_episode_attempts: int = 3,
) -> list[Trajectory]:
    """Play `episodes` (episode indices) on `num_workers` actors; return them in index order.

    Each actor keeps at most `concurrency_per_worker` episodes in flight and gets its next episode
    when one finishes, so faster actors take more. With `output_path`, each finished Trajectory is
    written at once (finishing order; `output_mode` as in `TrajectorySink`), so an interrupted run
    keeps what had finished. `worker_options` go to `RolloutWorker.options` (e.g. `{"num_gpus": 1}`
    for one engine per GPU).

    A dead actor is replaced (at most `max_worker_replacements` times in all, default 2 per worker)
    and its unfinished episodes go back in the queue; an episode lost with `max_episode_attempts`
    actors is written with finish "error". With no actor left, RuntimeError (finished episodes stay written).
    """
    indices = list(episodes)
    options = {"max_concurrency": concurrency_per_worker, **(worker_options or {})}
    task_ref, factory_ref, tokenizer_ref = ray.put(task), ray.put(backend_factory), ray.put(tokenizer)
    replacements_left = 2 * num_workers if max_worker_replacements is None else max_worker_replacements

    def new_worker():
        return RolloutWorker.options(**options).remote(task_ref, factory_ref, tokenizer_ref, config, seed)

    workers: list = [new_worker() for _ in range(min(num_workers, max(len(indices), 1)))]  # slot -> actor (None: gone)
    todo = deque(indices)
    attempts = dict.fromkeys(indices, 0)
    in_flight: dict[ray.ObjectRef, tuple[int, object, int]] = {}  # ref -> (slot, actor, episode index)
    load = [0] * len(workers)

    def submit(slot: int) -> bool:
        if not todo or workers[slot] is None or load[slot] >= concurrency_per_worker:
            return False
        index = todo.popleft()
        attempts[index] += 1
        in_flight[workers[slot].play.remote(index)] = (slot, workers[slot], index)
        load[slot] += 1
        return True

    def actor_died(slot: int, actor, index: int, error: BaseException, sink: TrajectorySink) -> None:
        nonlocal replacements_left
        if workers[slot] is actor:  # first news of this death: replace the actor once
            with _quiet:
                ray.kill(actor, no_restart=True)
            if replacements_left > 0:
                replacements_left -= 1
                workers[slot] = new_worker()
                warnings.warn(f"rollout worker {slot} died ({type(error).__name__}); replaced it, replaying its episodes",
                              stacklevel=3)
            else:
                workers[slot] = None
                warnings.warn(f"rollout worker {slot} died ({type(error).__name__}); no replacements left", stacklevel=3)
        if attempts[index] >= max_episode_attempts:
            sink.add(error_trajectory(task, index, seed, f"lost with {attempts[index]} dead actors: {error}", tokenizer))
        else:
            todo.appendleft(index)

    with TrajectorySink(len(indices), f"rollout {task.name} (ray)", output_path, progress, output_mode,
                        keep=True) as sink:
        try:
            for _ in range(concurrency_per_worker):  # round-robin start, so the first episodes go to every actor
                for slot in range(len(workers)):
                    submit(slot)
            while in_flight:
                done, _ = ray.wait(list(in_flight), num_returns=1)
                slot, actor, index = in_flight.pop(done[0])
                if workers[slot] is actor:
                    load[slot] -= 1
                try:
                    sink.add(ray.get(done[0]))
                except ray.exceptions.RayActorError as error:
                    actor_died(slot, actor, index, error, sink)
                    if workers[slot] is not None and workers[slot] is not actor:
                        load[slot] = sum(1 for s, a, _ in in_flight.values() if s == slot and a is workers[slot])
                except ray.exceptions.RayTaskError as error:
                    cause = getattr(error, "cause", None) or error
                    if is_fatal(cause):
                        raise cause from None
                    sink.add(error_trajectory(task, index, seed, cause, tokenizer))
                for refill in range(len(workers)):
                    while submit(refill):
                        pass
                if todo and not in_flight and all(w is None for w in workers):
                    raise RuntimeError(f"every rollout worker died; {len(todo)} episodes not played "
                                       "(the finished ones are written; rerun with --resume)")
        finally:
            live = [w for w in workers if w is not None]
            with _quiet:
                ray.wait([w.close.remote() for w in live], num_returns=len(live), timeout=30)
            for worker in live:
                with _quiet:
                    ray.kill(worker)
    return sink.in_order(indices)
