"""What every renderer gets: the loaded batch, its per-token values and text, and the selected episodes."""

from __future__ import annotations

from dataclasses import dataclass

from agent_loop.inspect.load import Loaded
from agent_loop.inspect.tokens import TokenText, is_success
from agent_loop.inspect.values import BatchValues, compute_values
from agent_loop.types import Trajectory


@dataclass
class InspectView:
    """The batch as loaded (all rows, since values are batch-wide) and the rows chosen for display."""

    source: str
    trajectories: list[Trajectory]
    lines: list[int]  # 1-based line of each trajectory in the source file
    values: BatchValues
    pieces: list[list[str]]  # display text of each response token
    prompts: list[str]  # decoded prompt of each trajectory
    selected: list[int]  # row indices to render, in order
    problems: list[str]  # load and tokenizer messages, shown with the view


def select(trajectories: list[Trajectory], episodes: list[int] | None = None, worst: int | None = None,
           failed: bool = False) -> list[int]:
    """Row indices to show: the given episode indices, else all; then only failures (``failed``),
    then the ``worst`` lowest-reward ones (lowest first). Raises ValueError on an index out of range."""
    rows = list(range(len(trajectories)))
    if episodes:
        for e in episodes:
            if not 0 <= e < len(trajectories):
                raise ValueError(f"--episode {e} is out of range: the file has episodes 0..{len(trajectories) - 1}")
        rows = list(dict.fromkeys(episodes))
    if failed:
        rows = [r for r in rows if not is_success(trajectories[r]) or trajectories[r].finish_reason == "error"]
    if worst is not None:
        rows = sorted(rows, key=lambda r: trajectories[r].reward)[:worst]
    return rows


def build_view(loaded: Loaded, gamma: float = 1.0, tokenizer_dir: str | None = None,
               selected: list[int] | None = None) -> InspectView:
    """Compute values and token text for ``loaded.trajectories`` (which must not be empty)."""
    trajectories = loaded.trajectories
    text = TokenText(tokenizer_dir)
    pieces = [text.pieces(t, t.response_ids) for t in trajectories]
    prompts = [text.text(t, t.prompt_ids) for t in trajectories]
    return InspectView(
        source=str(loaded.path),
        trajectories=trajectories,
        lines=loaded.lines,
        values=compute_values(trajectories, gamma),
        pieces=pieces,
        prompts=prompts,
        selected=list(range(len(trajectories))) if selected is None else selected,
        problems=loaded.problems + text.problems,
    )
