"""The records of a file grouped into sessions (episodes), as they stream by (issue 54).

A session whose agent rewrote its history is several records: its segments ``0..n-1`` (``Trajectory.segment``,
``Trajectory.session_id``), all but the last ending with finish reason ``history_rewrite``. ``inspect`` counts,
chooses and shows whole sessions: :class:`SessionGrouper` gathers a session's records until its last segment
(one that did not end in a rewrite) has come, and hands the session on with its segments in order; what is
still open at the end of the file is handed on then. A session whose segments cannot be joined (a segment
missing, as on a damaged line; segments that differ in reward) carries a ``problem``: its values are
computed segment by segment, and the views say so.

:func:`value_rows` is what the values are computed on (``agent_loop.inspect.values``): each session's records
under one key of its own (a file appended to twice may repeat a session id), so the registered estimators
join each session's segments (``masking.sessions``, ``advantages.sessions``) and its returns run across them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from agent_loop.inspect.load import Record
from agent_loop.types import Trajectory

REWRITE = "history_rewrite"  # the finish reason of every segment but a session's last


@dataclass
class Session:
    """One episode: its records in segment order; ``problem``: why its segments are not joined ("" when they are)."""

    records: list[Record]
    problem: str = ""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [r.trajectory for r in self.records]

    @property
    def first(self) -> Trajectory:
        return self.records[0].trajectory

    @property
    def last(self) -> Trajectory:
        return self.records[-1].trajectory

    def counted(self) -> list[Trajectory]:
        """The records as the summary counts them (``RolloutStats`` counts a session at its segment 0): a session
        whose segment 0 is missing (a damaged line) still counts once, at its first record."""
        first = self.first
        if first.segment == 0:
            return self.trajectories
        return [dataclasses.replace(first, info={**first.info, "segment": 0}), *self.trajectories[1:]]

    @property
    def turns(self) -> int:
        return sum(len(set(t.turn_ids)) for t in self.trajectories)

    @property
    def tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.trajectories)


def join_problem(trajectories: list[Trajectory]) -> str:
    """Why the segments (in segment order) of one session cannot be joined, or ""."""
    numbers = [t.segment for t in trajectories]
    if numbers != list(range(len(numbers))):
        return f"session {trajectories[0].session_id}: segments {numbers}, expected 0..{len(numbers) - 1}"
    rewards = {t.reward for t in trajectories}
    if len(rewards) > 1:
        return f"session {trajectories[0].session_id}: its segments differ in reward ({sorted(rewards)})"
    tasks = {(t.info.get("task"), t.info.get("seed"), t.info.get("index")) for t in trajectories}
    if len(tasks) > 1:
        return f"session {trajectories[0].session_id}: its segments differ in task, seed or index ({sorted(map(str, tasks))})"
    return ""


def session_of(records: list[Record]) -> Session:
    """A session of ``records`` (its segments, in any order), in segment order, with its join problem."""
    records = sorted(records, key=lambda r: (r.trajectory.segment, r.line))
    return Session(records, join_problem([r.trajectory for r in records]))


class SessionGrouper:
    """Gathers streamed records into sessions: :meth:`add` returns the sessions a record completes (in the
    order they complete), :meth:`flush` the ones still open at the end. A record whose session has one
    segment completes at once; memory holds only the sessions still waiting for their last segment."""

    def __init__(self):
        self.open: dict[str, list[Record]] = {}

    def add(self, record: Record) -> list[Session]:
        traj = record.trajectory
        key = traj.session_id
        if traj.segment == 0 and key in self.open:  # the id again from its start: the earlier session ends here
            done = [session_of(self.open.pop(key))]
        else:
            done = []
        records = self.open.setdefault(key, [])
        records.append(record)
        ended = any(r.trajectory.finish_reason != REWRITE for r in records)
        if ended and sorted(r.trajectory.segment for r in records) == list(range(len(records))):
            done.append(session_of(self.open.pop(key)))
        return done

    def flush(self) -> list[Session]:
        """The sessions still open (their last segment never came), in the order they started."""
        done = [session_of(records) for records in self.open.values()]
        self.open.clear()
        return done


def sessions_of(trajectories: Iterable[Trajectory]) -> list[Session]:
    """A list of trajectories grouped as a file would be (their position as the line number)."""
    grouper, out = SessionGrouper(), []
    for line, traj in enumerate(trajectories, start=1):
        out += grouper.add(Record(traj, line, 0))
    return out + grouper.flush()


def value_rows(trajectories: list[Trajectory]) -> list[Trajectory]:
    """``trajectories`` as the values are computed on them, in the same order: shallow copies whose
    ``info["session_id"]`` is a key of their session's own (sessions as :func:`sessions_of` groups them; a file
    appended to twice may repeat an id); a session with a ``problem`` has each record as a session of its own
    (segment 0). The records themselves are left as they are."""
    rows = list(trajectories)
    for k, session in enumerate(sessions_of(rows)):
        for j, record in enumerate(session.records):  # record.line: the row's place in ``rows``, from 1
            traj = record.trajectory
            key, segment = (f"{k}/{j}", 0) if session.problem else (str(k), traj.segment)
            rows[record.line - 1] = dataclasses.replace(traj, info={**traj.info, "session_id": key, "segment": segment})
    return rows
