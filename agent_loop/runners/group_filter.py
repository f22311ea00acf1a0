"""Dynamic sampling (DAPO's ``filter_groups``; ``agent-loop train --filter-groups``): a step trains only on the
groups whose members' raw outcomes differ, and plays fresh questions until it holds its batch.

A group whose members all succeed, or all fail, has zero advantage under GRPO and RLOO: it cost a rollout and
teaches nothing. The outcome is the task's judgement of the episode (``Trajectory.success``, from
``Task.success``), never the reward the estimator sees, which a task may shape (partial credit, per-turn
rewards) and a KL penalty moves: filtering on the shaped reward keeps all-fail groups whose shaping differs,
whose "phantom gradient" wrecks the policy (NeMo-RL #2431, verl-recipe #125). A group is the question's
samples (``info["group"]``), never one trajectory (rLLM #605: every group of size 1). Its members are sessions,
not rows: the rows of one proxy session (its segments, ``info["session_id"]``, ``info["segment"]``) count once,
with the outcome of its last segment; a failed session (finish ``error``) has no outcome (the step drops it).

:class:`GroupSelection` is one step's account, the same for the synchronous trainer (rounds of
``prompts_per_step`` fresh groups) and the asynchronous producer (each group as it completes): groups are
offered in order, the mixed ones kept until the batch is full, the others set aside (marked
``info["filtered"]``), until the batch is full or ``(1 + max_rounds) x prompts_per_step`` groups were examined.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Sequence

from agent_loop.types import Trajectory, in_episode_order

# why a group was set aside (info["filtered"]): all its sessions succeeded, all failed, fewer than 2 had an
# outcome, or it was mixed but the batch was already full (a synchronous round's surplus)
SET_ASIDE = ("all_success", "all_failed", "too_few", "surplus")


def session_outcomes(members: Sequence[Trajectory]) -> list[bool]:
    """The raw outcome of each session of a group (``Trajectory.session_id``): its last segment's ``success``;
    a session with a failed record (finish ``error``) has none and is left out."""
    outcomes: dict[str, bool] = {}
    failed = {t.session_id for t in members if t.finish_reason == "error"}
    for trajectory in sorted(members, key=lambda t: t.segment):
        if trajectory.session_id not in failed:
            outcomes[trajectory.session_id] = trajectory.success
    return list(outcomes.values())


def outcome_kind(members: Sequence[Trajectory]) -> str:
    """``mixed`` (the sessions' outcomes differ: the group teaches), ``all_success``, ``all_failed``, or
    ``too_few`` (fewer than 2 sessions with an outcome)."""
    outcomes = session_outcomes(members)
    if len(outcomes) < 2:
        return "too_few"
    if all(outcomes):
        return "all_success"
    return "all_failed" if not any(outcomes) else "mixed"


@dataclasses.dataclass
class GroupSelection:
    """One step's dynamic sampling: :meth:`offer` each complete group, in order, until :attr:`done`.

    ``wanted``: the step's groups (``prompts_per_step``); ``max_rounds``: the extra rounds allowed, a round being
    ``wanted`` groups examined, so at most ``(1 + max_rounds) x wanted`` groups are examined."""

    wanted: int
    max_rounds: int
    kept: list[list[Trajectory]] = dataclasses.field(default_factory=list)
    set_aside: list[Trajectory] = dataclasses.field(default_factory=list)  # marked info["filtered"]
    counts: Counter = dataclasses.field(default_factory=Counter)  # groups set aside, by SET_ASIDE reason
    examined: int = 0

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.wanted

    @property
    def bound(self) -> int:
        """The most groups a step examines."""
        return (1 + self.max_rounds) * self.wanted

    @property
    def done(self) -> bool:
        """The batch is full, or the bound on rounds is reached."""
        return self.full or self.examined >= self.bound

    def offer(self, members: list[Trajectory]) -> bool:
        """Examine one complete group (every member finished); True if kept, else its members are set aside,
        each marked ``info["filtered"]`` with the reason."""
        self.examined += 1
        kind = outcome_kind(members)
        if kind == "mixed" and not self.full:
            self.kept.append(members)
            return True
        reason = "surplus" if kind == "mixed" else kind
        self.counts[reason] += 1
        for trajectory in members:
            trajectory.info["filtered"] = reason
        self.set_aside += members
        return False

    def trajectories(self) -> list[Trajectory]:
        """The kept groups' episodes, in episode order (segments of a session in order)."""
        return in_episode_order(t for members in self.kept for t in members)

    def metrics(self) -> dict[str, float]:
        """The step's ``filter_groups/*``: ``kept`` groups; ``filtered`` (zero outcome variance: all succeeded, all
        failed, or fewer than 2 sessions with an outcome; also by kind) and ``share_filtered`` of the groups
        examined; ``surplus`` (mixed groups past a full batch); ``extra_rounds`` (rounds of ``wanted`` groups
        examined beyond the first); ``bound_hit``: 1 when the bound ended the step short of its batch, 0 when
        the batch filled."""
        filtered = self.examined - len(self.kept) - self.counts["surplus"]
        return {"filter_groups/kept": float(len(self.kept)), "filter_groups/filtered": float(filtered),
                "filter_groups/share_filtered": filtered / max(self.examined, 1),
                **{f"filter_groups/{kind}": float(self.counts[kind]) for kind in SET_ASIDE},
                "filter_groups/examined": float(self.examined),
                "filter_groups/extra_rounds": float(max(math.ceil(self.examined / self.wanted) - 1, 0)),
                "filter_groups/bound_hit": float(not self.full)}


__all__ = ["SET_ASIDE", "GroupSelection", "outcome_kind", "session_outcomes"]
