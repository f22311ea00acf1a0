"""Run episodes on Ray actors, each with its own backend, and write each Trajectory as a JSON line as it finishes.

Scale-out of `agent_loop.runners.local.run_rollouts` (docs/design.md section 6): every episode is played by the
same `run_episode`, so for the same task, seed and episode indices the trajectories are the same as
the in-process runner's. Works on a laptop (`ray.init()`, or none: Ray starts a local cluster) and on
an existing cluster (`ray.init(address=...)` before calling).

Backends are built inside each actor by `backend_factory` (anything picklable that returns a
Backend, e.g. `functools.partial(VLLMEngineBackend, path)` for one engine per actor, or
`functools.partial(OpenAIHTTPBackend, urls, model)` for actors sharing HTTP servers).

Faults: an actor that dies (killed, out of memory, node lost) is replaced by a fresh one, and the
episodes it had in flight are played again elsewhere, before any new one (each is deterministic in its
index and seed); episodes it had finished are already written and kept.

Memory: the episode indices are pulled one at a time (``--episodes 50000000`` builds no list), and
:func:`stream_rollouts_ray` keeps running statistics only, as the in-process runner does. An episode that raises is written with
finish "error" (`agent_loop.runners.local.play_episode`); only a fatal backend error stops the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from collections import deque
from typing import Callable

import ray

from agent_loop.backends.base import Backend, is_fatal
from agent_loop.options import plural
from agent_loop.runners.local import TrajectorySink, error_trajectory, play_episode, tracked
from agent_loop.runners.spec import RunSpec
from agent_loop.runners.stats import RolloutStats
from agent_loop.types import Trajectory

_quiet = contextlib.suppress(Exception)  # closing or killing actors that may already be dead


@ray.remote
class RolloutWorker:
    """One actor: one backend, up to `max_concurrency` episodes in flight on its event loop (an async actor)."""

    def __init__(self, spec: RunSpec, backend_factory: Callable[[], Backend]):
        self.spec = spec
        self.backend = backend_factory()

    async def play(self, index: int) -> list[Trajectory]:  # the episode's segments
        spec = self.spec
        return await play_episode(spec.task, index, self.backend, spec.tokenizer, spec.config, spec.seed)

    async def close(self) -> None:
        """Shut the backend down (engine process, connection pool)."""
        await self.backend.end_run()
        self.backend.close()


class _ActorPool:
    """The actors of one run and their episodes: which slot runs what, replacements, replays.

    Indices are pulled from ``spec.episodes`` one at a time as slots free up (``--episodes 50000000`` builds
    no list); memory is the episodes in flight plus those a dead actor left to replay."""

    def __init__(self, spec: RunSpec, backend_factory, num_workers: int, concurrency: int, options: dict,
                 replacements: int, max_attempts: int, total: int, order: list[int] | None = None):
        self.spec, self.concurrency, self.max_attempts = spec, concurrency, max_attempts
        self.replacements_left, self.left = replacements, total  # left: episodes not yet written
        self.options = {"max_concurrency": concurrency, **options}
        # the actors get the spec without its indices (a lazy iterable may not pickle; they need none)
        self.refs = (ray.put(dataclasses.replace(spec, episodes=())), ray.put(backend_factory))
        self.todo = iter(tracked(spec.episodes, order))  # order: indices as first handed out (keep=True)
        self.replays: deque[int] = deque()  # a dead actor's unfinished episodes, played before new ones
        self.attempts: dict[int, int] = {}  # per episode in flight or waiting for its replay
        self.workers: list = [self._new_worker() for _ in range(min(num_workers, max(total, 1)))]
        self.load = [0] * len(self.workers)  # episodes in flight per slot (on its current actor)
        self.in_flight: dict[ray.ObjectRef, tuple[int, object, int]] = {}  # ref -> (slot, actor, episode index)

    def _new_worker(self):
        return RolloutWorker.options(**self.options).remote(*self.refs)

    def start(self) -> None:
        for _ in range(self.concurrency):  # round-robin, so the first episodes go to every actor
            for slot in range(len(self.workers)):
                self._submit(slot)

    def refill(self) -> None:
        for slot in range(len(self.workers)):
            while self._submit(slot):
                pass
        if not self.in_flight and all(w is None for w in self.workers) and self._next_index(peek=True) is not None:
            raise RuntimeError(f"every rollout worker died; {plural(self.left, 'episode')} not played "
                               "(the finished ones are written; rerun with --resume)")

    def _next_index(self, peek: bool = False) -> int | None:
        """The next episode to play: a replay first, else the next index of ``spec.episodes``; None when none is left."""
        if not self.replays:
            index = next(self.todo, None)
            if index is None:
                return None
            self.replays.append(index)
        return self.replays[0] if peek else self.replays.popleft()

    def _submit(self, slot: int) -> bool:
        if self.workers[slot] is None or self.load[slot] >= self.concurrency:
            return False
        index = self._next_index()
        if index is None:
            return False
        self.attempts[index] = self.attempts.get(index, 0) + 1
        self.in_flight[self.workers[slot].play.remote(index)] = (slot, self.workers[slot], index)
        self.load[slot] += 1
        return True

    def next_result(self, sink: TrajectorySink) -> None:
        """Wait for the next finished episode and hand it to ``sink`` (or replay it, if its actor died)."""
        done, _ = ray.wait(list(self.in_flight), num_returns=1)
        slot, actor, index = self.in_flight.pop(done[0])
        if self.workers[slot] is actor:
            self.load[slot] -= 1
        try:
            self._written(sink, index, ray.get(done[0]))
        except ray.exceptions.RayActorError as error:
            self._actor_died(slot, actor, index, error, sink)
        except ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None) or error
            if is_fatal(cause):
                raise cause from None
            self._written(sink, index, [error_trajectory(self.spec.task, index, self.spec.seed, cause, self.spec.tokenizer)])

    def _written(self, sink: TrajectorySink, index: int, trajectories: list[Trajectory]) -> None:
        for trajectory in trajectories:
            sink.add(trajectory)
        self.attempts.pop(index, None)
        self.left -= 1

    def _actor_died(self, slot: int, actor, index: int, error: BaseException, sink: TrajectorySink) -> None:
        if self.workers[slot] is actor:  # first news of this death: replace the actor once
            with _quiet:
                ray.kill(actor, no_restart=True)
            replaced = self.replacements_left > 0
            self.replacements_left -= replaced
            self.workers[slot] = self._new_worker() if replaced else None
            self.load[slot] = 0
            warnings.warn(f"rollout worker {slot} died ({type(error).__name__}); "
                          + ("replaced it, replaying its episodes" if replaced else "no replacements left"), stacklevel=4)
        if self.attempts[index] >= self.max_attempts:
            spec = self.spec
            self._written(sink, index, [error_trajectory(spec.task, index, spec.seed, f"lost with {self.attempts[index]} "
                                                         f"dead actors: {error}", spec.tokenizer)])
        else:
            self.replays.appendleft(index)

    def close(self) -> None:
        live = [w for w in self.workers if w is not None]
        with _quiet:
            ray.wait([w.close.remote() for w in live], num_returns=len(live), timeout=30)
        for worker in live:
            with _quiet:
                ray.kill(worker)


def stream_rollouts_ray(
    spec: RunSpec,
    backend_factory: Callable[[], Backend],
    *,
    num_workers: int = 2,
    concurrency_per_worker: int = 16,
    worker_options: dict | None = None,
    max_worker_replacements: int | None = None,
    max_episode_attempts: int = 3,
    keep: bool = False,
    sample_size: int = 0,
    total: int | None = None,
) -> tuple[RolloutStats, list[Trajectory] | None]:
    """Play ``spec.episodes`` on ``num_workers`` actors; return running statistics (and, with ``keep=True``,
    the trajectories in the order of ``spec.episodes``), as :func:`agent_loop.runners.local.stream_rollouts`.

    Each actor keeps at most ``concurrency_per_worker`` episodes in flight and gets its next episode
    when one finishes, so faster actors take more. ``spec.episodes`` is read one index at a time (a range or
    any lazy iterable; ``total`` sizes the progress bar when it has no ``len``), so without ``keep`` memory
    does not grow with the run. With ``spec.output_path``, each finished Trajectory is written at once
    (finishing order), so an interrupted run keeps what had finished; ``sample_size``: the first episodes
    kept in the statistics' ``sample``. ``worker_options`` go to ``RolloutWorker.options`` (e.g.
    ``{"num_gpus": 1}`` for one engine per GPU).

    A dead actor is replaced (at most ``max_worker_replacements`` times in all, default 2 per worker)
    and its unfinished episodes are played again first; an episode lost with ``max_episode_attempts``
    actors is written with finish "error". With no actor left, RuntimeError (finished episodes stay written).
    A fatal backend error stops the run and is raised.
    """
    episodes = spec.episodes
    if total is None:
        episodes = episodes if hasattr(episodes, "__len__") else list(episodes)
        total = len(episodes)
    todo, order = iter(episodes), [] if keep else None
    head = list(itertools.islice(todo, sample_size))
    stats = RolloutStats(sample_indices=frozenset(head))
    spec = dataclasses.replace(spec, episodes=itertools.chain(head, todo))
    replacements = 2 * num_workers if max_worker_replacements is None else max_worker_replacements
    pool = _ActorPool(spec, backend_factory, num_workers, concurrency_per_worker, worker_options or {}, replacements,
                      max_episode_attempts, total, order)
    with TrajectorySink(total, f"rollout {spec.task.name} (ray)", spec.output_path, spec.progress,
                        spec.output_mode, keep=keep, stats=stats, info=spec.recorded()) as sink:
        try:
            pool.start()
            while pool.in_flight:
                pool.next_result(sink)
                pool.refill()
        finally:
            pool.close()
    return stats, (sink.in_order(order) if keep else None)


def run_rollouts_ray(spec: RunSpec, backend_factory: Callable[[], Backend], **options) -> list[Trajectory]:
    """:func:`stream_rollouts_ray` with every Trajectory kept: them, in the order of ``spec.episodes`` (what a
    training step needs; ``options`` as there)."""
    return stream_rollouts_ray(spec, backend_factory, keep=True, **options)[1]
