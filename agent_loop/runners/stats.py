"""The one summary of a set of episodes: running totals, updated one episode at a time in O(1) memory.

The rollout command's table, the trainer's per-step metrics and ``inspect``'s summaries all read it.
Counts come from each Trajectory's own token lists and tool calls (what every record holds), so a file
written by any version summarises the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from agent_loop.types import Trajectory
from masking.kinds import SpanKind


def sampling_label(temperature: float) -> str:
    """How episodes were sampled, as every success figure names it: ``greedy`` or ``sampled at T=0.7``."""
    return "greedy" if temperature == 0 else f"sampled at T={temperature:g}"


def reward_error(trajectory: Trajectory) -> str | None:
    """Why scoring the episode failed (its reward function raised, hung or returned a non-number), or None."""
    return trajectory.info.get("reward_error")


def episode_error(trajectory: Trajectory) -> str | None:
    """The error an episode ended with (raised, or from the backend), or None."""
    if trajectory.finish_reason != "error":
        return None
    return trajectory.metrics.get("error") or trajectory.metrics.get("backend_error") or "error"


@dataclass
class RolloutStats:
    """Running totals over episodes (:meth:`add` each one).

    ``per_turn`` holds, per assistant turn, ``[episodes, assistant tokens, observation tokens]``.
    ``first_errors`` keeps the first ``max_errors`` errors (index, message), so a run whose episodes all
    failed can say why (``first_reward_errors``: the same for reward failures, counted in ``reward_errors``);
    ``sample`` keeps the episodes whose index is in ``sample_indices`` (for a summary of the batch tensors
    without holding the whole run). ``first_index``/``last_index``: the smallest and
    largest episode index seen.
    """

    episodes: int = 0  # sessions: a session whose agent rewrote its history is one episode of several segments
    segments: int = 0  # records (rows): one per episode, more where a session has several segments
    successes: int = 0
    reward_sum: float = 0.0
    turns: int = 0
    assistant_tokens: int = 0
    observation_tokens: int = 0
    tool_calls: int = 0
    template_mismatches: int = 0  # episodes whose tokens differ from a one-go render of their messages
    template_drifts: int = 0  # episodes that ran in history_mode="keep_seen" and drifted from a fresh render
    template_mismatch_turns: int = 0  # the same, counted in turns
    template_drift_turns: int = 0
    task_metrics: Counter = field(default_factory=Counter)  # sums of the task's own per-episode numbers
    finish_reasons: Counter = field(default_factory=Counter)
    tool_errors: Counter = field(default_factory=Counter)
    per_turn: dict[int, list[int]] = field(default_factory=dict)
    first_errors: list[tuple[int, str]] = field(default_factory=list)
    reward_errors: int = 0  # episodes whose reward could not be computed (info["reward_error"])
    first_reward_errors: list[tuple[int, str]] = field(default_factory=list)
    max_errors: int = 3
    sample_indices: frozenset = frozenset()
    sample: list[Trajectory] = field(default_factory=list)
    first_index: int | None = None
    last_index: int | None = None
    temperatures: Counter = field(default_factory=Counter)  # episodes per sampling temperature (info["options"])

    def add(self, trajectory: Trajectory, index: int | None = None) -> None:
        """Count one record (``index``: its episode's number, default ``info["index"]``). A session counts once, at
        its first segment (every segment holds the session's reward and success); turns and tokens add up over
        its segments, so per-episode means are per session."""
        index = trajectory.info.get("index") if index is None else index
        metrics = trajectory.metrics
        self.segments += 1
        if trajectory.segment == 0:
            self.episodes += 1
            self.successes += trajectory.success
            self.reward_sum += trajectory.reward
        self._add_tokens(trajectory)
        self.tool_calls += len(trajectory.tool_calls)
        self.tool_errors.update(c.error_kind for c in trajectory.tool_calls if c.error_kind)
        self.template_mismatches += bool(metrics.get("template_mismatch"))
        self.template_drifts += bool(metrics.get("template_drift"))
        self.template_mismatch_turns += metrics.get("template_mismatch", 0)
        self.template_drift_turns += metrics.get("template_drift", 0)
        self.finish_reasons[trajectory.finish_reason] += 1
        self.temperatures[(trajectory.info.get("options") or {}).get("temperature")] += 1
        self.task_metrics.update(metrics.get("task", {}))
        if trajectory.finish_reason == "error" and len(self.first_errors) < self.max_errors:
            self.first_errors.append((index if index is not None else -1, episode_error(trajectory)))
        if (reward_message := reward_error(trajectory)) is not None:
            self.reward_errors += 1
            if len(self.first_reward_errors) < self.max_errors:
                self.first_reward_errors.append((index if index is not None else -1, reward_message))
        if index in self.sample_indices:
            self.sample.append(trajectory)
        if isinstance(index, int):
            self.first_index = index if self.first_index is None else min(self.first_index, index)
            self.last_index = index if self.last_index is None else max(self.last_index, index)

    def _add_tokens(self, trajectory: Trajectory) -> None:
        counts = Counter(zip(trajectory.turn_ids, trajectory.spans))  # (turn, span) -> tokens, counted in C
        turns: dict[int, list[int]] = {}
        for (turn, span), n in counts.items():
            turns.setdefault(turn, [1, 0, 0])[1 if span == SpanKind.ASSISTANT else 2] += n
        self.turns += len(turns)
        for turn, (one, assistant, observation) in turns.items():
            totals = self.per_turn.setdefault(turn, [0, 0, 0])
            totals[0] += one
            totals[1] += assistant
            totals[2] += observation
            self.assistant_tokens += assistant
            self.observation_tokens += observation

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def sampling(self) -> str:
        """How the episodes were sampled (:func:`sampling_label`), from their records: one temperature, a mix
        (``mixed: greedy 4, sampled at T=1 12``) or ``sampling not recorded`` (records without options)."""
        labels = Counter({("sampling not recorded" if t is None else sampling_label(t)): n
                          for t, n in self.temperatures.items()})
        if len(labels) == 1:
            return next(iter(labels))
        return "mixed: " + ", ".join(f"{label} {n}" for label, n in sorted(labels.items()))

    def mean(self, name: str) -> float:
        """Per-episode mean of a running total (``reward_sum``, ``turns``, ``assistant_tokens``, ...)."""
        return getattr(self, name) / self.episodes if self.episodes else 0.0
