"""Read a rollouts JSON Lines file into Trajectory records, keeping the good lines of a damaged file.

Each problem becomes one message naming the file and the 1-based line, so an interrupted rollout
(a truncated last line) or one corrupt record never hides the rest of the batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from agent_loop.types import Trajectory
from masking.spans import SpanKind

PER_TOKEN_FIELDS = ("spans", "turn_ids", "logprobs")


@dataclass
class Loaded:
    """The trajectories that loaded (with their 1-based line numbers) and one message per problem."""

    path: Path
    trajectories: list[Trajectory] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def check_trajectory(traj: Trajectory) -> None:
    """Raise ValueError if the per-token lists disagree in length or hold unknown span kinds."""
    n = len(traj.response_ids)
    for name in PER_TOKEN_FIELDS:
        if len(getattr(traj, name)) != n:
            raise ValueError(f"{name} has {len(getattr(traj, name))} entries but response_ids has {n}")
    allowed = {SpanKind.ASSISTANT, SpanKind.OBSERVATION}
    for pos, kind in enumerate(traj.spans):
        if kind not in allowed:
            raise ValueError(f"spans[{pos}] = {kind!r}, expected 1 (ASSISTANT) or 2 (OBSERVATION)")
    if (traj.reward or any(traj.turn_rewards or [])) and SpanKind.ASSISTANT not in traj.spans:
        raise ValueError("a nonzero reward but no ASSISTANT token to put it on")
    if traj.turn_rewards is not None:
        turns = {t for t, s in zip(traj.turn_ids, traj.spans) if s == SpanKind.ASSISTANT}
        if len(traj.turn_rewards) != len(turns):
            raise ValueError(f"turn_rewards has {len(traj.turn_rewards)} entries for {len(turns)} assistant turns")


def load_trajectories(path: str | Path) -> Loaded:
    """Parse every non-blank line of ``path``; a bad line adds a message instead of stopping the read."""
    path = Path(path)
    loaded = Loaded(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        loaded.problems.append(f"{path}: cannot read: {exc.strerror or exc}")
        return loaded
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        loaded.problems.append(f"{path}: the file is empty (no trajectories)")
        return loaded
    last = max(i for i, line in enumerate(lines) if line.strip())
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            hint = " (truncated last line: interrupted rollout?)" if i == last else ""
            loaded.problems.append(f"{where}: not valid JSON{hint}: {exc.msg} at column {exc.colno}")
            continue
        try:
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            traj = Trajectory.from_dict(data)
            check_trajectory(traj)
        except (TypeError, ValueError) as exc:
            loaded.problems.append(f"{where}: not a Trajectory: {exc}")
            continue
        loaded.trajectories.append(traj)
        loaded.lines.append(i + 1)
    return loaded
