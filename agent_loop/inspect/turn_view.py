"""The per-turn view of an episode (issue 47): what each assistant turn got from the estimator, for the terminal.

A turn-level estimator (``turn_returns``, ``turn_rloo``, ``turn_index_normalized``, ``gigpo``, ``turn_gae``;
advantages/turn_credit.py) gives every ASSISTANT token of a turn the same advantage; a token-level one gives each
its own, and the turn's is then their mean. :func:`turn_rows` lists, per turn: its ASSISTANT tokens, its reward
(the sum of the token-level rewards on them: the turn's reward, and the outcome on the last turn), its return and
advantage (at its first ASSISTANT token, and the mean), and the anchor-state group it joined, as the training
step recorded it (``info["anchor_groups"]`` / ``info["anchor_others"]``, written by ``train --estimator gigpo``).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_loop.inspect.view import InspectView
from masking.spans import SpanKind


@dataclass
class TurnRow:
    """One assistant turn of an episode, as :func:`turn_rows` gives it."""

    turn: int
    tokens: int  # ASSISTANT tokens of the turn
    reward: float  # sum of the token-level rewards on them
    ret: float  # the return at the turn's first ASSISTANT token
    advantage: float  # the mean advantage over the turn's ASSISTANT tokens (one value for a turn-level estimator)
    anchor: str  # which anchor-state group the turn joined ("" when none is recorded)
    state: str  # the task's state key of the turn (info["turn_states"]), "" when none is recorded


def anchor_label(info: dict, k: int) -> str:
    """``group 7 (3 others)``, ``group 7 (alone: turn-index baseline)``, or "" when the record holds none."""
    groups, others = info.get("anchor_groups"), info.get("anchor_others")
    if not isinstance(groups, list) or not isinstance(others, list) or k >= min(len(groups), len(others)):
        return ""
    if not others[k]:
        return f"group {groups[k]} (alone: turn-index baseline)"
    return f"group {groups[k]} ({others[k]} other{'s' * (others[k] != 1)})"


def turn_rows(view: InspectView, row: int) -> list[TurnRow]:
    """One :class:`TurnRow` per assistant turn of episode ``row`` of ``view``, in order (serial: a few episodes)."""
    traj, v = view.trajectories[row], view.values
    positions: dict[int, list[int]] = {}
    for pos, (span, turn) in enumerate(zip(traj.spans, traj.turn_ids)):
        if span == SpanKind.ASSISTANT:
            positions.setdefault(turn, []).append(pos)
    states = traj.info.get("turn_states")
    out = []
    for k, (turn, at) in enumerate(sorted(positions.items())):
        advantages = [float(v.advantages[row, p]) for p in at]
        state = str(states[k]) if isinstance(states, list) and k < len(states) else ""
        out.append(TurnRow(turn, len(at), sum(float(v.token_level_rewards[row, p]) for p in at),
                           float(v.returns[row, at[0]]), sum(advantages) / len(advantages),
                           anchor_label(traj.info, k), state))
    return out


def turn_advantage_of(view: InspectView, row: int) -> dict[int, float]:
    """Turn -> its advantage (:class:`TurnRow` ``advantage``) for episode ``row``."""
    return {r.turn: r.advantage for r in turn_rows(view, row)}
