"""Asynchronous rollouts (``--max-staleness K``): a producer keeps playing episodes while the trainer trains.

Who owns what (docs/design.md section 8a):

- **The producer** (:class:`RolloutProducer`, rank 0 only) owns a thread with its own asyncio event loop,
  the rollout backend (in-process, or the HTTP backend over ``--server`` with its failover)
  wrapped in a :class:`VersionedBackend`, and ``concurrency`` worker tasks: the local runner's pool
  (``agent_loop.runners.local.play_pool``: the same episode playing, errors and cancellation). Each worker
  takes the next episode index (whole groups: a group's first member is admitted only under the staleness
  budget, its other members follow it), plays it and hands its Trajectories (one per segment: a context policy
  may rewrite the history) to the producer's sink, which stamps the run's ``info`` as every runner's sink does
  and files the session under its group, as one member.
- **The hand-over** is the producer's table of finished groups, under one ``threading.Condition``: the
  producer adds, the trainer takes (:meth:`RolloutProducer.take`). A group is released only when every
  member has finished, so group estimators always see whole groups.
- **The trainer** (every rank) owns the model and the optimizer; rank 0 takes a step's groups and
  broadcasts them to the other ranks; after the update rank 0 pushes the weights through the producer
  (:meth:`RolloutProducer.push`; the trainer's ``agent_loop.training.transports.producer``), which swaps them in between
  requests.

Versions: the weights after ``v`` trainer steps are version ``v`` (a step whose update was skipped still
advances the version: its weights equal the previous ones). :class:`VersionedBackend` stamps every
generation with the version it ran on (``GenerationResult.policy_version``), and the loop records it on
each ASSISTANT token (``Trajectory.policy_versions``). A swap closes the backend's gate (new requests
wait), lets the requests in flight finish, loads the weights, sets the version and opens the gate: no
request mixes two versions, and an episode in flight simply continues with the new weights on its next
turn (a *partial rollout*: its tokens carry both versions). Versions never decrease along an episode,
so its oldest is the version of its first ASSISTANT token.

The staleness rule: trainer step ``s`` (weights version ``s``) trains on a group only if the oldest token
of every member was sampled by version ``s - K`` or later; a complete group older than that is dropped
(``episodes/dropped_stale``, counted per episode, a session's segments once; written to the step's rollouts
file, ``info["stale"]``, never trained on). The producer admits a new group only while
``groups started - groups dropped < (version + K + 1) x prompts_per_step``: at most ``K + 1`` steps of groups
are in flight or waiting, and with ``K = 0`` it plays exactly step ``s``'s groups with version ``s``, the
synchronous step (tested equal). A step takes the ``prompts_per_step`` complete groups
with the lowest group ids (the oldest first, so the fewest expire).

The question stream: groups start in id order; :meth:`RolloutProducer.position` (saved in each checkpoint)
is the first group never started and the groups started but neither taken nor dropped (in flight or
waiting). A resumed producer plays those first, then goes on from the first never started: every question
is trained on or dropped once, as in a run that was never stopped.

Dynamic sampling (``filter_rounds``, ``train --filter-groups``; ``agent_loop.runners.group_filter``): a take
examines the complete groups in id order as they come, sets aside those whose sessions' outcomes do not differ
(their places in the budget go to new groups, as a stale group's) and stops when ``prompts_per_step`` are kept
or ``(1 + filter_rounds) x prompts_per_step`` were examined.

Faults: a failed episode is a Trajectory with finish ``error`` (the step drops it, as in the synchronous
step); the HTTP backend moves a dead server's sessions to a live one; an error that stops the producer
(a fatal backend error: every server down past the deadline) is raised by the trainer's next
:meth:`~RolloutProducer.take`, :meth:`~RolloutProducer.push` or :meth:`~RolloutProducer.run` as
:class:`RolloutProducerError` naming the cause, and :meth:`~RolloutProducer.close` stops the producer's
thread (in-flight episodes cancelled, the backend's run ended; a thread stuck past a bound is left behind with
a warning that shows where it waits); the last complete checkpoint resumes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import time
import traceback
import warnings
from collections import Counter, deque
from typing import Callable, Sequence

from agent_loop.backends.base import Backend, FatalBackendError, GenerationResult, SamplingParams, check_backend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.group_filter import GroupSelection
from agent_loop.runners.local import TrajectorySink, play_pool
from agent_loop.runners.spec import RunSpec
from agent_loop.types import Trajectory, count_sessions, in_episode_order

CLOSE_TIMEOUT_S = 60.0  # a producer whose thread runs this long after close() cancelled it is stuck


class RolloutProducerError(RuntimeError):
    """The rollout producer stopped (its cause chained): the run cannot go on."""


def oldest_version(trajectory: Trajectory, default: int) -> int:
    """The policy version of the episode's first ASSISTANT token (versions never decrease along an episode,
    so it is the oldest), or ``default`` when it has none (a failed episode, or a backend without versions)."""
    return next((v for v in trajectory.policy_versions or () if v >= 0), default)


def session_oldest(trajectories: Sequence[Trajectory], default: int) -> dict[str, int]:
    """Each session's oldest version (``Trajectory.session_id``: a session of several segments, a rewritten
    history, is one episode): the oldest over its segments (:func:`oldest_version`, ``default`` for none)."""
    oldest: dict[str, int] = {}
    for trajectory in trajectories:
        version = oldest_version(trajectory, default)
        oldest[trajectory.session_id] = min(oldest.get(trajectory.session_id, version), version)
    return oldest


def staleness_metrics(trajectories: Sequence[Trajectory], version: int, max_staleness: int) -> dict[str, float]:
    """Per step: ``staleness/kJ`` (how many of the trained episodes, sessions counted once, have their oldest token
    ``J`` versions behind ``version``, J = 0..K, every key every step), ``staleness/mean`` and ``staleness/max``; an
    episode without versions counts as ``J = 0``."""
    lags = [version - oldest for oldest in session_oldest(trajectories, version).values()]
    counts = Counter(lags)
    metrics = {f"staleness/k{j}": float(counts.get(j, 0)) for j in range(max(max_staleness, max(lags, default=0)) + 1)}
    metrics["staleness/mean"] = sum(lags) / len(lags) if lags else 0.0
    metrics["staleness/max"] = float(max(lags, default=0))
    return metrics


class VersionedBackend(Backend):
    """``inner`` with a weights version: every generation is stamped with the version it ran on, and weights
    change only between requests (:meth:`swap`: new requests wait, those in flight finish first). A backend
    that reports the version it ran on (the vLLM engine's LoRA adapter) must report this one, else the request
    raises ``FatalBackendError`` (a stale adapter is never trained on as the current policy).

    Used by the trainer in both modes: synchronously it just sets ``version`` between runs (no request is in
    flight then); the producer swaps through the gate while episodes play. The gate's asyncio primitives are
    made for the running event loop (one per ``asyncio.run`` of the synchronous trainer, one for the producer)."""

    def __init__(self, inner: Backend, version: int = 0):
        self.inner = check_backend(inner)
        self.version = version
        self.persistent = False  # True under the producer: a run (evaluate's) ending leaves ``inner`` open
        self.retries_itself = inner.retries_itself
        self._in_flight = 0
        self._swapping = False
        self._gate: asyncio.Condition | None = None
        self._gate_loop = None

    @property
    def context_length(self) -> int | None:
        return self.inner.context_length

    def describe(self, session_id: str | None = None) -> str:
        return self.inner.describe(session_id)

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._gate_loop is not loop:
            self._gate, self._gate_loop = asyncio.Condition(), loop
        return self._gate

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       session_id: str | None = None) -> GenerationResult:
        gate = self._condition()
        async with gate:
            await gate.wait_for(lambda: not self._swapping)
            self._in_flight += 1
            version = self.version
        try:
            result = await self.inner.generate(prompt_ids, sampling, session_id=session_id)
        finally:
            async with gate:
                self._in_flight -= 1
                gate.notify_all()
        if result.policy_version is not None and result.policy_version != version:  # a backend that knows (LoRA)
            raise FatalBackendError(f"the request ran on weights version {result.policy_version}, the policy is "
                                    f"version {version}: a stale adapter")
        return result._replace(policy_version=version)

    async def swap(self, load: Callable[[], object] | None, version: int) -> None:
        """Close the gate, wait for the requests in flight, run ``load`` (the new weights into the backend or
        the servers; None: the weights did not change) on a thread, set ``version``, open the gate. If
        ``load`` raises, the version stays and the error propagates (the gate opens either way)."""
        gate = self._condition()
        async with gate:
            self._swapping = True
            await gate.wait_for(lambda: self._in_flight == 0)
        try:
            if load is not None:
                await asyncio.to_thread(load)
            self.version = version
        finally:
            async with gate:
                self._swapping = False
                gate.notify_all()

    def update_weights(self, state_dict: dict) -> None:
        self.inner.update_weights(state_dict)

    async def end_run(self) -> None:
        if not self.persistent:
            await self.inner.end_run()

    def close(self) -> None:
        self.inner.close()


class GroupTable:
    """The producer's question stream and hand-over table (the module docstring: admission, the staleness rule).

    Groups start in id order from ``position`` (a checkpoint's :meth:`RolloutProducer.position`: its pending groups
    first, then its ``next_group`` on; None: from group ``first_step x groups_per_step``); each episode's admission
    version is noted; finished episodes wait under their group until it is complete. The admission budget counts
    groups started less groups dropped as stale or set aside; ``freed`` is called whenever one of its places frees,
    so that admission is checked again. ``counts``: episodes started, finished, taken, dropped as stale and filtered
    (started = finished + in flight; finished = taken + dropped + filtered + waiting), a session of several
    segments counted once. It has no lock of its own: the producer calls it under its hand-over lock
    (:meth:`may_start` aside, a read that admission repeats)."""

    def __init__(self, *, group_size: int, groups_per_step: int, max_staleness: int, first_step: int,
                 last_step: int | None, position: dict | None, freed: Callable[[], None]):
        self.group_size, self.groups_per_step, self.max_staleness = group_size, groups_per_step, max_staleness
        self.last_step = last_step  # no group beyond what steps up to this one can train on is started
        self.freed = freed
        position = position or {"next_group": first_step * groups_per_step, "pending": []}
        self.replay = deque(sorted(position["pending"]))  # started before a resume, never trained on: first
        self.next_group = position["next_group"]  # the first group never started
        self.open: set[int] = set()  # groups started, neither taken nor dropped
        self.group, self.members = -1, group_size  # the group being started, how many of its members started
        self.budget_used = first_step * groups_per_step  # groups started - groups dropped (the admission rule)
        self.admitted: dict[int, int] = {}  # episode in flight -> the version it was admitted under
        self.finished: dict[int, list[Trajectory]] = {}  # group -> its finished members' records (waiting)
        self.oldest: dict[int, int] = {}  # group -> the oldest version among its finished members
        self.complete: set[int] = set()  # groups whose every member finished: ready to take
        self.counts = Counter(started=0, finished=0, taken=0, dropped_stale=0, filtered=0)
        self.last_take = (time.perf_counter(), 0)  # (when, episodes finished then): the producer's throughput

    def may_start(self, version: int) -> bool:
        """Whether the next episode may start under weights ``version``: a group's later members always (a group is
        never half started); the first member of the next group only within the staleness budget."""
        if self.members < self.group_size:
            return True
        steps = version + self.max_staleness + 1
        budget = (steps if self.last_step is None else min(steps, self.last_step)) * self.groups_per_step
        return self.budget_used < budget

    def start_next(self, version: int) -> int:
        """The next episode's index (the next member of the group being started, or the first of the next group: a
        pending one from before a resume, else the next never started), noted as admitted under ``version``."""
        if self.members == self.group_size:
            if self.replay:
                self.group = self.replay.popleft()
            else:
                self.group, self.next_group = self.next_group, self.next_group + 1
            self.members = 0
            self.open.add(self.group)
            self.budget_used += 1
        index = self.group * self.group_size + self.members
        self.members += 1
        self.counts["started"] += 1
        self.admitted[index] = version
        return index

    def file(self, segments: list[Trajectory]) -> bool:
        """A finished episode (its segments in order, ``info`` stamped) into its group as one member; True when
        it was the group's last member."""
        index = segments[0].info["index"]
        group = index // self.group_size
        started = self.admitted.pop(index)
        self.counts["finished"] += 1
        self.finished.setdefault(group, []).extend(segments)
        # its oldest token's version (an episode admitted under one version may sample its first token under a
        # later one: it waited at the gate during a push); ``started`` only for an episode without tokens
        oldest = min(oldest_version(t, started) for t in segments)
        self.oldest[group] = min(self.oldest.get(group, oldest), oldest)
        if count_sessions(self.finished[group]) < self.group_size:
            return False
        self.complete.add(group)
        return True

    def drop_stale(self, version: int) -> list[Trajectory]:
        """Drop the complete groups whose oldest token is more than ``max_staleness`` behind ``version`` (their
        places in the budget go to new groups); returns their episodes, each marked ``info["stale"]`` (its
        staleness)."""
        dropped = []
        for group in sorted(g for g in self.complete if self.oldest[g] < version - self.max_staleness):
            self.complete.discard(group)
            members = in_episode_order(self.finished.pop(group))
            oldest = session_oldest(members, self.oldest[group])
            for trajectory in members:
                trajectory.info["stale"] = version - oldest[trajectory.session_id]
            del self.oldest[group]
            dropped += members
            self.open.discard(group)
            self.budget_used -= 1
        self.counts["dropped_stale"] += count_sessions(dropped)
        if dropped:
            self.freed()
        return dropped

    def ready(self, selection: GroupSelection | None) -> bool:
        """Whether a step can be taken: ``groups_per_step`` complete groups; with dynamic sampling, the complete
        groups not yet examined are offered to ``selection`` (in id order, until it is done) first, and a group it
        sets aside frees its place in the budget."""
        if selection is None:
            return len(self.complete) >= self.groups_per_step
        for group in sorted(self.complete):
            if selection.done:
                break
            members = self._remove(group)
            if not selection.offer(members):
                self.budget_used -= 1
                self.counts["filtered"] += count_sessions(members)
                self.freed()
        return selection.done

    def take(self, selection: GroupSelection | None) -> list[Trajectory]:
        """A ready step's episodes (:meth:`ready`): the ``groups_per_step`` complete groups with the lowest ids, in
        index order, or those ``selection`` kept (a short step still spends a whole step's places in the budget)."""
        if selection is None:
            taken = [t for group in sorted(self.complete)[: self.groups_per_step] for t in self._remove(group)]
        else:
            taken = selection.trajectories()
            self.budget_used += self.groups_per_step - len(selection.kept)
        self.counts["taken"] += count_sessions(taken)
        return taken

    def _remove(self, group: int) -> list[Trajectory]:
        """A complete group out of the table (neither in flight nor waiting any more): its members in index order."""
        self.complete.discard(group)
        self.open.discard(group)
        del self.oldest[group]
        return in_episode_order(self.finished.pop(group))

    def position(self) -> dict[str, int | list[int]]:
        """``next_group`` and ``pending`` (:meth:`RolloutProducer.position`)."""
        return {"next_group": self.next_group, "pending": sorted(self.open | set(self.replay))}

    def throughput(self, now: float) -> dict[str, float]:
        """``producer/episodes_per_s`` (finished since the last call), ``producer/in_flight`` and
        ``producer/waiting`` (finished, not yet taken)."""
        when, finished = self.last_take
        self.last_take = (now, self.counts["finished"])
        return {"producer/episodes_per_s": (self.counts["finished"] - finished) / max(now - when, 1e-9),
                "producer/in_flight": float(self.counts["started"] - self.counts["finished"]),
                "producer/waiting": float(sum(count_sessions(members) for members in self.finished.values()))}


class _Handover(TrajectorySink):
    """The producer's sink: every runner's ``TrajectorySink`` (the run's ``info`` stamped, running statistics;
    no file, no progress bar), then the episode (its segments) is filed under its group in ``groups`` for the
    trainer to take, under the hand-over lock ``lock``, whose waiters are woken when a group completes."""

    def __init__(self, groups: GroupTable, lock: threading.Condition, *, info: dict):
        super().__init__(0, "rollout producer", progress=False, info=info)
        self.groups, self.lock = groups, lock

    def add_episode(self, segments: list[Trajectory]) -> None:
        super().add_episode(segments)
        with self.lock:
            if self.groups.file(segments):
                self.lock.notify_all()


class RolloutProducer:
    """Plays episodes on its own thread and event loop, ahead of the trainer by at most ``max_staleness``
    versions (the module docstring: admission, hand-over, the staleness rule, faults).

    ``task`` plays question ``index // group_size`` as episode ``index`` (a ``GroupedTask``); groups are
    started in id order from group ``first_step x groups_per_step``, or from ``position`` (a checkpoint's
    :meth:`position`: its pending groups first, then its ``next_group`` on); ``first_step`` is the steps
    already trained (the trainer's step) and ``backend.version`` the version the producer starts with;
    ``last_step``: the run's last step (no group is started that no step up to it could take).
    ``filter_rounds``: dynamic sampling (``agent_loop.runners.group_filter``; None: off): a step keeps only
    groups whose sessions' outcomes differ, examining at most ``(1 + filter_rounds) x groups_per_step``.
    ``groups``: the question stream and hand-over table (:class:`GroupTable`); ``counts``: its episodes started,
    finished, taken, dropped as stale and filtered, for the metrics and the no-episode-lost check."""

    def __init__(self, task, backend: VersionedBackend, tokenizer, config: LoopConfig, *, seed: int,
                 concurrency: int, group_size: int, groups_per_step: int, max_staleness: int, first_step: int = 0,
                 last_step: int | None = None, position: dict | None = None, filter_rounds: int | None = None):
        self.task, self.backend, self.tokenizer, self.config, self.seed = task, backend, tokenizer, config, seed
        backend.persistent = True  # the producer's loop is one long run: evaluate's runs leave the backend open
        self.spec = RunSpec(task, tokenizer, (), config, seed, progress=False)
        self.group_size, self.groups_per_step, self.max_staleness = group_size, groups_per_step, max_staleness
        self.concurrency, self.filter_rounds, self.last_step = concurrency, filter_rounds, last_step
        self.groups = GroupTable(group_size=group_size, groups_per_step=groups_per_step, max_staleness=max_staleness,
                                 first_step=first_step, last_step=last_step, position=position, freed=self._wake)
        self.counts = self.groups.counts
        self._handover = threading.Condition()  # guards the table: the producer files, the trainer takes
        # stamps info as every runner's sink does, then files the episode into the table
        self._sink = _Handover(self.groups, self._handover, info=self.spec.recorded())
        self._error: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self._changed = asyncio.Event()  # set (on the loop) when the version moved or a group was dropped
        self._main = self.loop.create_task(self._produce())
        self._thread = threading.Thread(target=self._run_loop, name="rollout-producer", daemon=True)
        self._thread.start()

    # --- the producer's thread -----------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main)
        except BaseException:  # cancelled by close(), or recorded as the producer's error in _produce
            pass
        finally:
            self.loop.run_until_complete(self.loop.shutdown_default_executor())  # a decode batch in a thread ends
            self.loop.close()

    async def _produce(self) -> None:
        try:
            with self._sink:
                await play_pool(self.spec, self.backend, self._sink, self._admit, workers=self.concurrency)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a fatal backend error (or a bug): the trainer's next call raises it
            with self._handover:
                self._error = error
                self._handover.notify_all()
        finally:
            await self.backend.inner.end_run()

    async def _admit(self) -> int:
        """The next episode's index once the staleness budget allows it (:meth:`GroupTable.start_next`), admitted
        under the backend's version. The stream never ends: the pool plays until :meth:`close`."""
        while not self.groups.may_start(self.backend.version):
            self._changed.clear()
            await self._changed.wait()
        with self._handover:  # position() reads the stream from the trainer's thread
            return self.groups.start_next(self.backend.version)

    def _wake(self) -> None:
        """Re-check admission (from any thread)."""
        self.loop.call_soon_threadsafe(self._changed.set)

    # --- the trainer's side ----------------------------------------------------------------------------

    def take(self, version: int) -> tuple[list[Trajectory], list[Trajectory], dict[str, float]]:
        """Wait for ``groups_per_step`` complete groups fit for a step at weights ``version``, dropping the stale
        ones on the way; return their episodes in index order, the episodes dropped as stale (marked
        ``info["stale"]``), and the hand-over metrics: ``time/idle_s`` (the wait), ``episodes/dropped_stale``,
        ``producer/episodes_per_s`` (finished since the last take), ``producer/in_flight``,
        ``producer/waiting`` (finished, not yet taken). Raises RolloutProducerError if the producer stopped.

        With ``filter_rounds`` (dynamic sampling) the complete groups are examined in id order as they come
        (``GroupSelection``): a group without outcome variance is set aside (its place goes to a new group) and
        returned with the stale ones (marked ``info["filtered"]``), until ``groups_per_step`` are kept or the
        bound on groups examined is reached (a short step still spends a whole step's places in the budget);
        the metrics add the step's ``filter_groups/*``."""
        started, dropped = time.perf_counter(), []
        selection = None if self.filter_rounds is None else GroupSelection(self.groups_per_step, self.filter_rounds)
        with self._handover:
            while True:
                dropped += self.groups.drop_stale(version)  # their places go to new groups (which this wait may need)
                if self.groups.ready(selection):
                    break
                self._raise_if_stopped()
                self._handover.wait(timeout=1.0)  # woken by each finished group; the timeout re-checks the thread
            taken = self.groups.take(selection)
            metrics = {} if selection is None else selection.metrics()
            now = time.perf_counter()
            metrics.update({"time/idle_s": now - started, "episodes/dropped_stale": float(count_sessions(dropped))})
            metrics.update(self.groups.throughput(now))
        return taken, dropped + (selection.set_aside if selection else []), metrics

    def position(self) -> dict[str, int | list[int]]:
        """Where the question stream stands, for a checkpoint (plain ints): ``next_group``, the first group never
        started, and ``pending``, the groups started (or queued to replay) but neither taken nor dropped; a
        producer made with this ``position`` plays ``pending`` first, then goes on from ``next_group``."""
        with self._handover:
            return self.groups.position()

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise RolloutProducerError(f"the rollout producer stopped: {type(self._error).__name__}: "
                                       f"{self._error}") from self._error
        if self._main.done() or self.loop.is_closed() or not self._thread.is_alive():
            raise RolloutProducerError("the rollout producer is closed")

    def run(self, coroutine):
        """Run ``coroutine`` on the producer's event loop (where its backend lives) and return its result."""
        with self._handover:
            try:
                self._raise_if_stopped()
            except RolloutProducerError:
                coroutine.close()
                raise
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():  # the loop closed before it ran the coroutine
                    self._raise_if_stopped()

    def push(self, load: Callable[[], object] | None, version: int) -> None:
        """Swap in new weights between requests (``VersionedBackend.swap``) as ``version``, then admit the
        groups the new version allows. Raises what ``load`` raised (a failed weight sync)."""
        self.run(self.backend.swap(load, version))
        self._wake()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop for good: cancel the episodes in flight, end the backend's run, join the thread. Idempotent.

        A thread still running ``timeout_s`` after the cancel is stuck (a plug-in or a client library that never
        yields): it is left behind (a daemon thread, it ends with the process) and a RuntimeWarning shows where it
        and each of its tasks wait, so that the end of a run never hangs on it."""
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._main.cancel)
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            warnings.warn(f"the rollout producer's thread did not end within {timeout_s:g} s of close(); left behind "
                          f"(a daemon thread: it ends with the process). Where it waits:\n"
                          f"{where_it_waits(self._thread, self.loop)}", RuntimeWarning, stacklevel=2)


def where_it_waits(thread: threading.Thread, loop: asyncio.AbstractEventLoop) -> str:
    """The stack of ``thread`` (running ``loop``) and of each task pending on ``loop``, innermost call last: what a
    stuck event-loop thread is waiting on, read from another thread (for a warning; the loop may move meanwhile)."""
    frame = sys._current_frames().get(thread.ident)
    parts = [f"thread {thread.name}:\n" + "".join(traceback.format_stack(frame)) if frame else ""]
    try:
        tasks = asyncio.all_tasks(loop)
    except RuntimeError:  # the loop's task set kept changing
        tasks = set()
    parts += [f"{task!r}, awaiting:\n" + "".join(_await_chain(task.get_coro())) for task in tasks]
    return "\n".join(part for part in parts if part)


def _await_chain(awaitable) -> list[str]:
    """Where a suspended coroutine waits: its frame, then the frame of what it awaits, down to a future."""
    lines = []
    while awaitable is not None:
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is None:
            lines.append(f"  {awaitable!r}\n")
            break
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}\n')
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return lines
