"""The episodes each training step trained on, on disk: ``OUTPUT_DIR/rollouts/step_NNNNNN.jsonl``.

One ``Trajectory.to_json`` line per episode of the step (whole-line writes, ``JsonlWriter``), with the
per-response-token ``returns`` and ``advantages`` the step used (None for episodes it dropped) and
``info["step"]`` (1-based), ``info["trained"]``, and how the values were made as ``agent-loop rollout``
records it (:func:`made_with`): ``info["gamma"]``, ``info["estimator"]``, the estimator's other settings
(``info["lam"]``, ``info["step_advantage_w"]``, ``info["gigpo_mode"]``) and ``info["kl_coef"]`` where they apply,
``info["options"]``. Files of steps after the step a run resumes from (left by the interrupted run) are moved
aside, never deleted.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

from advantages import gigpo_anchor_groups
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.files import move_aside
from agent_loop.options import pick, plural
from agent_loop.runners.batch import estimator_arguments
from agent_loop.runners.jsonl import JsonlWriter
from agent_loop.tasks.registry import TaskOptions

FOLDER = "rollouts"
_NAME = re.compile(r"step_(\d{6})\.jsonl$")


def step_file(output_dir: str | Path, step: int) -> Path:
    """The file of 1-based ``step``."""
    return Path(output_dir) / FOLDER / f"step_{step:06d}.jsonl"


def keeps(step: int, every: int) -> bool:
    """Whether 1-based ``step`` is saved with ``save_rollouts_every = every`` (0: none)."""
    return every > 0 and step % every == 0


def move_aside_after(output_dir: str | Path, step: int) -> list[Path]:
    """Rename the step files of steps after ``step`` to ``step_NNNNNN.jsonl.interrupted[-K]`` (a free name),
    with a one-line warning; returns the new paths. Nothing is deleted or truncated."""
    folder = Path(output_dir) / FOLDER
    if not folder.is_dir():
        return []
    moved = []
    for path in sorted(folder.iterdir()):
        match = _NAME.match(path.name)
        if not match or int(match.group(1)) <= step:
            continue
        moved.append(move_aside(path, "interrupted"))
    if moved:
        warnings.warn(f"{folder}: moved {plural(len(moved), 'step file')} of steps after step {step} aside (suffix "
                      f".interrupted, from an earlier or interrupted run): {', '.join(p.name for p in moved[:3])}"
                      f"{', ...' if len(moved) > 3 else ''}", stacklevel=2)
    return moved


def made_with(estimator, played_with, kl_coef: float = 0.0) -> dict:
    """How the step's values were computed and its episodes played, recorded as ``agent-loop rollout`` records
    it: ``estimator.made_with`` (an ``agent_loop.runners.spec.EstimatorOptions``: ``gamma``, ``estimator``, the
    estimator's other settings as it used them, ``lam``, ``step_advantage_w``, ``gigpo_mode`` where it takes them)
    of the loop's and the task's options in ``played_with`` (what the episodes were played with), ``kl_coef``
    when on, and ``session_credit`` when it is the row-per-segment ablation."""
    options = {**pick(LoopConfig, played_with), **pick(TaskOptions, played_with)}
    ablation = getattr(estimator, "session_credit", "session") == "segment"
    return estimator.made_with(options, kl_coef=float(kl_coef) if kl_coef > 0 else None,
                               session_credit="segment" if ablation else None)


def anchor_groups(estimator, batch) -> tuple | None:
    """gigpo's anchor-state groups of ``batch`` (``advantages.gigpo_anchor_groups``: per row and turn the group's
    id, and how many other episodes' turns it holds, 0 where gigpo fell back to the turn-index baseline), as the
    step computed them; None for another estimator or no batch."""
    if batch is None or estimator.name != "gigpo":
        return None
    arguments = {name: value for name, value in estimator_arguments(estimator, batch).items()
                 if name in ("index", "spans", "turn_ids", "responses", "turn_states")}
    sets, others = gigpo_anchor_groups(batch.response_mask, **arguments)
    return sets.cpu(), others.cpu()


def annotated(trajectories, kept, batch, step: int, how: dict, anchors: tuple | None = None) -> list:
    """Copies of ``trajectories`` with ``info`` (step, trained, ``how``) and, for those in ``kept`` (row ``i``
    of ``batch``), their returns and advantages unpadded over their response length. ``batch`` may be None
    (a skipped step: nothing trained). ``anchors`` (:func:`anchor_groups`): each kept episode's
    ``info["anchor_groups"]`` and ``info["anchor_others"]``, one entry per assistant turn."""
    rows = {id(t): i for i, t in enumerate(kept)} if batch is not None else {}
    if rows:  # one device-to-host copy for the file
        advantages, returns = batch.advantages.detach().cpu(), batch.returns.detach().cpu()
    out = []
    for t in trajectories:
        row = rows.get(id(t))
        info = {**t.info, "step": step, "trained": row is not None, **how}
        if row is None:
            out.append(dataclasses.replace(t, info=info, returns=None, advantages=None))
            continue
        if anchors is not None:
            present = anchors[0][row] >= 0
            info["anchor_groups"] = anchors[0][row][present].tolist()
            info["anchor_others"] = anchors[1][row][present].tolist()
        n = len(t.response_ids)
        out.append(dataclasses.replace(t, info=info, returns=returns[row, :n].tolist(),
                                       advantages=advantages[row, :n].tolist()))
    return out


def write_step(output_dir: str | Path, step: int, trajectories) -> Path:
    """Write ``trajectories`` (already annotated) to the file of ``step``; returns its path."""
    path = step_file(output_dir, step)
    with JsonlWriter(path) as writer:
        for t in trajectories:
            writer.write_line(t.to_json())
    return path


__all__ = ["FOLDER", "anchor_groups", "annotated", "keeps", "made_with", "move_aside_after", "step_file", "write_step"]
