"""The episodes of a training step: played now (synchronous) or taken from the asynchronous producer, filtered
(dynamic sampling), the unusable ones dropped, and collated into the step's batch.

A step plays ``prompts_per_step`` questions of the run's question stream, ``group_size`` samples each
(:class:`StepRollouts`); with several ranks each plays its share and all get every episode, in order. With
``max_staleness`` K >= 1 a ``RolloutProducer`` (agent_loop.runners.producer) plays ahead on rank 0 and each step
takes its episodes from it (rank 0 broadcasts them). With ``filter_groups`` the step plays rounds of fresh
questions until it holds ``prompts_per_step`` groups whose raw outcomes differ (agent_loop.runners.group_filter).
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections import defaultdict

import torch

from agent_loop.proxy.agents import agent_rollouts
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.runners.group_filter import GroupSelection
from agent_loop.runners.local import run_rollouts
from agent_loop.runners.producer import RolloutProducer
from masking.batch import Batch


def group_of(trajectory, group_size: int) -> int:
    """The question (group) an episode played: ``info["group"]``, or from its index where the record of a
    failed episode lacks it (``GroupedTask``: episode ``i`` plays question ``i // group_size``)."""
    return trajectory.info.get("group", trajectory.info["index"] // group_size)


def by_group(trajectories, group_size: int) -> dict[int, list]:
    """``trajectories`` by their question (group), each group's members in order."""
    groups: dict[int, list] = defaultdict(list)
    for trajectory in trajectories:
        groups[group_of(trajectory, group_size)].append(trajectory)
    return groups


def usable_episodes(trajectories, group_size: int, grouped: bool) -> tuple[list, dict[str, float]]:
    """The records a step trains on, and how many episodes (sessions) were dropped (``episodes/dropped_failed``,
    ``episodes/dropped_lone``).

    A session counts once, whatever its number of segments (:attr:`Trajectory.session_id`). A failed one (a
    record with finish ``error``: its reward, the backend or the prompt raised) has no true reward: every segment
    of it is dropped. For a group-relative estimator (``grouped``) the other sessions of its group are kept, their
    baseline taken over the survivors (mean, std and leave-one-out are defined for any group of 2 or more); a
    session left *alone* by its group's failures is dropped too, since the estimators' group-of-one rule would
    train on its raw score as if it had a baseline of 0.
    """
    failed = {t.session_id for t in trajectories if t.finish_reason == "error"}
    kept = [t for t in trajectories if t.session_id not in failed]
    dropped = {"episodes/dropped_failed": float(len(failed)), "episodes/dropped_lone": 0.0}
    if grouped and group_size > 1:
        sessions: dict[int, set[str]] = defaultdict(set)
        for t in kept:
            sessions[group_of(t, group_size)].add(t.session_id)
        lone = {group for group, members in sessions.items() if len(members) == 1}
        kept = [t for t in kept if group_of(t, group_size) not in lone]
        dropped["episodes/dropped_lone"] = float(len(lone))
    return kept, dropped


def training_batch(trajectories, *, group_size: int, pad_token_id: int, device, credit: str = "session") -> Batch:
    """Collated tensors plus ``index`` (b,), the group id of each row (and, where an agent rewrote its history,
    ``session``/``segment``: a session is one sample to the estimator; ``credit="segment"``: the row-per-segment
    ablation, every segment its own sample), on ``device``."""
    groups = [group_of(t, group_size) for t in trajectories]
    batch = trajectories_to_batch(trajectories, pad_token_id=pad_token_id, index=groups, sessions=credit == "session")
    batch.index = torch.tensor(groups, dtype=torch.long)
    return batch.to(device)


def first_group(start, prompts_per_step: int, *, asynchronous: bool) -> int:
    """The first question a run's synchronous stream plays: ``start.step x prompts_per_step``, or where a resumed
    run stood (``start.next_group``: --filter-groups plays extra rounds). An asynchronous checkpoint resumed
    synchronously restarts at ``step x prompts_per_step`` (a warning says so): its producer's place is not a
    synchronous stream's."""
    if start.stream_position is not None and not asynchronous:
        warnings.warn(f"resume: an asynchronous checkpoint resumed synchronously (--max-staleness 0): the question "
                      f"stream restarts at step {start.step} x prompts_per_step, not where its producer stood "
                      f"(group {start.stream_position['next_group']})", stacklevel=3)
    return start.step * prompts_per_step if start.next_group is None else start.next_group


def handed_over(played, started: float) -> dict[str, float]:
    """A synchronous step's hand-over metrics: the trainer waited for every episode it played."""
    waited = time.perf_counter() - started
    return {"time/idle_s": waited, "time/rollout_s": waited, "episodes/dropped_stale": 0.0,
            "producer/episodes_per_s": len(played) / max(waited, 1e-9)}


class StepRollouts:
    """A run's question stream played on its rollout backend (see the module docstring).

    ``task``: the grouped task (``GroupedTask``: episode ``i`` plays question ``i // group_size``); ``backend``: the
    ``VersionedBackend`` over the rollout backend; ``prompts_per_step`` questions of ``group_size`` samples a
    step, ``concurrency`` episodes in flight, the run's ``seed``; ``filter_rounds``: dynamic sampling's extra
    rounds (None: no filtering); ``agent`` (and ``agent_timeout_s``): the user's own agent plays the episodes;
    ``next_group``: the first question never played (a resumed run's).
    """

    def __init__(self, task, backend, tokenizer, loop_config, *, dp, seed: int, group_size: int,
                 prompts_per_step: int, concurrency: int, filter_rounds: int | None = None, agent: str | None = None,
                 agent_timeout_s: float = 600.0, next_group: int = 0):
        self.task, self.backend, self.tokenizer, self.loop_config = task, backend, tokenizer, loop_config
        self.dp, self.seed, self.group_size, self.prompts_per_step = dp, seed, group_size, prompts_per_step
        self.concurrency, self.filter_rounds, self.next_group = concurrency, filter_rounds, next_group
        self.agent, self.agent_timeout_s = agent, agent_timeout_s
        self.producer: RolloutProducer | None = None  # rank 0's, once started
        self.asynchronous = False  # every rank's: the episodes come from rank 0's producer

    def start_producer(self, *, step: int, last_step: int, max_staleness: int,
                       position: dict | None = None) -> RolloutProducer | None:
        """Asynchronous rollouts from ``step`` to ``last_step``: rank 0 starts a ``RolloutProducer`` over the
        backend, at most ``max_staleness`` versions ahead of the trainer (returned; None on the other ranks). With 0
        it plays exactly the synchronous steps' episodes with the same weights (tests/training/test_async_training.py).
        ``position``: a resumed run's question stream (a checkpoint's ``producer``): it goes on from there."""
        self.asynchronous = True
        if self.dp.is_main:
            self.producer = RolloutProducer(
                self.task, self.backend, self.tokenizer, self.loop_config, seed=self.seed,
                concurrency=self.concurrency, group_size=self.group_size, groups_per_step=self.prompts_per_step,
                max_staleness=max_staleness, first_step=step, last_step=last_step, position=position,
                filter_rounds=self.filter_rounds)
        return self.producer

    def take(self, step: int) -> tuple[list, dict[str, float], list, list]:
        """Step ``step``'s episodes, how they were handed over (``time/idle_s``: the trainer waited for them,
        ``episodes/dropped_stale``, ``producer/episodes_per_s``; asynchronously also ``producer/in_flight``,
        ``producer/waiting``; with ``filter_groups`` the step's ``filter_groups/*``), the episodes dropped as
        stale (rank 0, for the step's rollouts file) and those dynamic sampling set aside (``info["filtered"]``)."""
        if self.asynchronous:
            taken, dropped, metrics = self.producer.take(step) if self.dp.is_main else (None, [], None)
            stale = [t for t in dropped if "filtered" not in t.info]
            filtered = [t for t in dropped if "filtered" in t.info] if self.dp.is_main else None
            taken, metrics, filtered = self.dp.broadcast_object((taken, metrics, filtered))
            return taken, metrics, stale, filtered
        started = time.perf_counter()
        if self.filter_rounds is None:
            played = self.play_next()
            return played, handed_over(played, started), [], []
        # dynamic sampling: rounds of fresh questions until the batch holds prompts_per_step groups, or the bound
        selection = GroupSelection(self.prompts_per_step, self.filter_rounds)
        while not selection.done:
            groups = by_group(self.play_next(), self.group_size)
            for group in sorted(groups):
                selection.offer(groups[group])
        kept = selection.trajectories()
        return kept, handed_over(kept + selection.set_aside, started) | selection.metrics(), [], selection.set_aside

    def play_next(self) -> list:
        """The next ``prompts_per_step`` questions of the synchronous stream (:meth:`play_groups`)."""
        first, self.next_group = self.next_group, self.next_group + self.prompts_per_step
        return self.play_groups(first)

    def play_groups(self, first: int) -> list:
        """The episodes of questions ``first ... first + P - 1`` (P: ``prompts_per_step``), ``group_size`` samples
        each (with several ranks, each plays its share and all get every episode, in order)."""
        n = self.group_size
        episodes = self.dp.shard(range(first * n, (first + self.prompts_per_step) * n))
        return self.dp.gather_trajectories(asyncio.run(self.play(self.task, episodes, self.loop_config, self.seed)))

    def play_held_out(self, task, episodes: range, loop_config, seed: int) -> list:
        """``episodes`` of ``task`` (the held-out questions of an evaluation), every rank's, in order: on the
        producer's loop when there is one (rank 0 plays them all, where its backend lives), else sharded."""
        if self.asynchronous:
            played = self.producer.run(self.play(task, episodes, loop_config, seed)) if self.dp.is_main else None
            return self.dp.broadcast_object(played)
        return self.dp.gather_trajectories(asyncio.run(self.play(task, self.dp.shard(episodes), loop_config, seed)))

    async def play(self, task, episodes, loop_config, seed: int) -> list:
        """``run_rollouts`` on the (versioned) backend, which ends the run on it (HTTP pools live in one event
        loop) unless the producer's loop holds it; with ``agent``, the user's own agent through an in-process
        recording proxy (docs/agents.md)."""
        if self.agent:
            return await agent_rollouts(task, self.backend, self.tokenizer, episodes, loop_config, seed=seed,
                                        agent=self.agent, concurrency=self.concurrency, timeout_s=self.agent_timeout_s)
        return await run_rollouts(task, self.backend, self.tokenizer, episodes, loop_config, seed=seed,
                                  concurrency=self.concurrency, progress=False)

    def close(self) -> None:
        """Stop the asynchronous producer (its episodes in flight are cancelled)."""
        if self.producer is not None:
            self.producer.close()
