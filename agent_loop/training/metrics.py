"""Per-step metrics: what the episodes did, and where they go (stdout, a JSON Lines file, TensorBoard, Weights & Biases)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import torch

import agent_loop.files as files
from agent_loop.options import plural
from agent_loop.runners.stats import RolloutStats
from agent_loop.training.distributed import NullLogger
from agent_loop.types import FINISH_REASONS, TOOL_ERROR_KINDS, Trajectory, count_sessions, strict_json

# the policy loss's statistics (advantages.losses, verl's names) as metrics.jsonl names them, once
LOSS_STAT_NAMES = {"clipfrac": "clip_frac", "approx_kl": "ppo_kl"}
UPDATE_METRICS = ("loss", "loss/first", "pg_loss", "clip_frac", "ppo_kl", "entropy")  # NaN when a step has no update


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Reward, success rate, turns, token counts, finish reasons, tool errors and the task's own metrics of
    one batch of episodes: the same running totals the rollout CLI summarises (``RolloutStats``)."""
    stats = RolloutStats()
    for t in trajectories:
        stats.add(t)
    metrics = {
        "reward": stats.mean("reward_sum"),
        "success": stats.success_rate,
        **{name: stats.mean(name) for name in ("turns", "assistant_tokens", "observation_tokens", "tool_calls")},
        **{name: total / stats.episodes for name, total in stats.task_metrics.items()},  # e.g. tool_returned_answer
        # template exactness, in turns (docs/templates.md); mismatches are errors/template below, named once
        "template_drift": float(stats.template_drift_turns),
    }
    metrics["segments"] = stats.segments / stats.episodes  # records per session: 1 unless an agent rewrote its history
    metrics.update({f"finish_frac/{reason}": stats.finish_reasons[reason] / stats.segments for reason in FINISH_REASONS})
    metrics.update({f"tool_errors_count/{kind}": float(stats.tool_errors[kind]) for kind in TOOL_ERROR_KINDS})
    metrics.update({"errors/reward": float(stats.reward_errors), "errors/tool": float(sum(stats.tool_errors.values())),
                    "errors/template": float(stats.template_mismatch_turns)})
    return metrics


def first_errors(trajectories: Sequence[Trajectory]) -> dict[str, str]:
    """The first message of each kind of error in the episodes: ``reward`` (``info["reward_error"]``), ``tool``
    (a failed tool call) and ``template`` (``metrics["template_first_diff"]``); kinds not seen are absent."""
    found: dict[str, str] = {}
    for t in trajectories:
        if "reward" not in found and t.info.get("reward_error"):
            found["reward"] = str(t.info["reward_error"])
        if "tool" not in found:
            failed = next((c for c in t.tool_calls if getattr(c, "error_kind", None)), None)
            if failed is not None:
                found["tool"] = f"{failed.error_kind}: {failed.error or ''}"
        if "template" not in found and t.metrics.get("template_first_diff"):
            found["template"] = str(t.metrics["template_first_diff"])
    return found


def progress_summary(history: Sequence[dict[str, float]], *, sampling: str, episodes_per_step: int,
                     evaluations: Sequence[tuple[int, float]] = (), eval_episodes: int = 0, window: int = 5) -> str:
    """The closing line of a run: the training episodes' success (``sampling``, e.g. ``sampled at T=1``) as the
    mean over the first and the last steps (up to ``window`` each, never overlapping), so one noisy step does
    not decide it; then the held-out evaluation, greedy, first and last (``evaluations``: (step, success)),
    when there is one. Each figure names its sampling and its episode count."""
    k = max(1, min(window, len(history) // 2))
    first = sum(m["success"] for m in history[:k]) / k
    last = sum(m["success"] for m in history[-k:]) / k
    steps = "step" if k == 1 else f"{k} steps"
    line = (f"success ({sampling}, {plural(episodes_per_step, 'episode')} a step) {first:.3f} (mean of the first "
            f"{steps}) -> {last:.3f} (mean of the last {steps})")
    if evaluations:
        (start, before), (end, after) = evaluations[0], evaluations[-1]
        held_out = f"held-out success (greedy, {plural(eval_episodes, 'episode')})"
        line += (f"; {held_out} {after:.3f} at step {end}" if start == end else
                 f"; {held_out} {before:.3f} (step {start}) -> {after:.3f} (step {end})")
    return line


def step_legend(*, sampling: str, episodes_per_step: int, eval_episodes: int = 0) -> str:
    """The line before the per-step lines: what their success and eval columns measure."""
    legend = f"success: the step's {plural(episodes_per_step, 'episode')}, {sampling}"
    if eval_episodes:
        legend += f"; eval: {plural(eval_episodes, 'held-out episode')}, greedy"
    return legend


def masked_summary(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, std, min and max of ``values`` (b, t) over positions where ``mask`` (b, t) is true (host sync: metrics only)."""
    selected = values[mask.bool()].double()
    if selected.numel() == 0:
        return {}
    return {
        f"{name}/mean": selected.mean().item(),
        f"{name}/std": selected.std(correction=0).item(),
        f"{name}/min": selected.min().item(),
        f"{name}/max": selected.max().item(),
    }


def scalars(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-dim tensors -> floats, in one host sync (``advantages.rollout_correction``'s ``mismatch/*``: the
    sampler/trainer KL k1 and k3, the ratio's mean, min, max and 5/50/95th percentiles, the shares of
    ASSISTANT tokens capped and masked; a batch without ASSISTANT tokens gives NaN, written as null)."""
    if not metrics:
        return {}
    values = torch.stack([value.detach().double().reshape(()) for value in metrics.values()]).tolist()
    return dict(zip(metrics, values))


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter  # tensorboard: optional (the tensorboard extra)
    except ImportError:  # the set-up installs tensorboard; a bare `pip install` may not have it
        warnings.warn("tensorboard is not installed: no TensorBoard event files (pip install tensorboard, or "
                      "--no-tensorboard to silence this)", stacklevel=3)
        return None
    return SummaryWriter(log_dir=str(log_dir))


def _wandb_run(project: str, output_dir: Path, run_config: dict, resume: bool):
    import wandb  # wandb: optional; preflight checked that it is installed

    return wandb.init(project=project, dir=str(output_dir), config=run_config, name=output_dir.name,
                      resume="allow" if resume else None)


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl``, and mirrors the scalars to TensorBoard
    (``OUTPUT_DIR/tensorboard``, on by default) and to a Weights & Biases run when ``wandb_project`` is set.

    ``fresh`` starts the file empty (a new run); a resumed run appends to it.
    """

    def __init__(self, output_dir: str | Path, fresh: bool = True, tensorboard: bool = True,
                 wandb_project: str | None = None, run_config: dict | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.path.write_text("")
        self.writer = _tensorboard_writer(self.path.parent / "tensorboard") if tensorboard else None
        self.wandb = _wandb_run(wandb_project, self.path.parent, run_config or {}, not fresh) if wandb_project else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        files.before_write()  # a worker whose launcher died stops here (agent_loop.training.distributed.die_with_launcher)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(strict_json({"step": step, **metrics})[0] + "\n")  # a NaN loss is null: every line strict JSON
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def run_logger(output_dir: str | Path, *, fresh: bool, main: bool, tensorboard: bool, wandb_project: str | None,
               run_config: dict):
    """Rank 0's :class:`MetricsLogger` (``main``), the other ranks' ``NullLogger`` (they write nothing)."""
    if not main:
        return NullLogger(Path(output_dir) / "metrics.jsonl")
    return MetricsLogger(output_dir, fresh=fresh, tensorboard=tensorboard, wandb_project=wandb_project,
                         run_config=run_config)


def compact_line(step: int, metrics: dict[str, float]) -> str:
    """One short stdout line per step (a skipped step: its success, reward and what was dropped)."""
    if metrics.get("skipped_steps"):
        return (f"step {step:4d} | success {metrics['success']:.3f} | reward {metrics['reward']:.3f} | skipped: "
                f"{metrics['episodes/dropped_failed']:.0f} episodes failed, {metrics['episodes/dropped_lone']:.0f} "
                f"left alone in their group | {metrics['time/step_s']:.1f}s")
    parts = [f"step {step:4d}", f"success {metrics['success']:.3f}", f"reward {metrics['reward']:.3f}",
             f"turns {metrics['turns']:.2f}", f"loss {metrics['loss']:+.4f}", f"clip {metrics['clip_frac']:.3f}",
             f"kl {metrics['ppo_kl']:+.2e}", f"ent {metrics['entropy']:.3f}", f"gnorm {metrics['grad_norm']:.3f}",
             f"lp-mismatch {metrics['logprob_mismatch/mean_abs']:.1e}"]
    errors = [f"{kind} {metrics.get(f'errors/{kind}', 0):.0f}" for kind in ("reward", "tool", "template")
              if metrics.get(f"errors/{kind}")]
    if errors:
        parts.append("errors " + " ".join(errors))
    parts.append(f"lr {metrics['lr']:.1e}")
    if "eval/success" in metrics:
        parts.append(f"eval {metrics['eval/success']:.3f}")
    parts.append(f"{metrics['time/step_s']:.1f}s")
    return " | ".join(parts)


def warn_first_errors(trajectories: Sequence[Trajectory], warned: set[str], step: int) -> None:
    """Warn once per run per kind (reward, tool, template; ``warned``: the kinds already warned about) with its
    first message; the counts are in the metrics (``errors/*``)."""
    for kind, message in first_errors(trajectories).items():
        if kind not in warned:
            warned.add(kind)
            warnings.warn(f"step {step}: first {kind} error (counted each step as errors/{kind}; warned once): "
                          f"{message[:300]}", stacklevel=3)


def no_signal_warning(kept: Sequence[Trajectory], metrics: dict[str, float], step: int) -> str | None:
    """The warning of a step whose every advantage is 0 (no learning signal), saying why; None when some is not."""
    if metrics.get("advantages/min", 0.0) != 0.0 or metrics.get("advantages/max", 0.0) != 0.0:
        return None
    rewards = {t.reward for t in kept}
    reasons = []
    if len(rewards) == 1:
        reasons.append(f"all {count_sessions(kept)} sessions' rewards equal ({next(iter(rewards)):g})")
    if all(t.truncated for t in kept):
        reasons.append("every episode was truncated (hit --max-tokens / --max-response-tokens / --max-turns)")
    return (f"step {step} has no learning signal: every advantage is 0"
            + (f" ({'; '.join(reasons)})" if reasons else ""))


def skipped_step_warning(played: Sequence[Trajectory], metrics: dict[str, float], step: int) -> str:
    """The warning of a step with nothing to train on: how many of its episodes failed, were left alone in their
    group or set aside by --filter-groups, and the first error."""
    first = next((t.metrics.get("error", "") for t in played if t.finish_reason == "error"), "")
    filtered = count_sessions([t for t in played if "filtered" in t.info])
    return (f"step {step} skipped: none of its {count_sessions(played)} episodes can be trained on "
            f"({metrics['episodes/dropped_failed']:.0f} failed, {metrics['episodes/dropped_lone']:.0f} "
            f"left alone in their group, " + (f"{filtered} set aside by --filter-groups, " if filtered else "")
            + "the rest without an ASSISTANT token)" + (f"; the first error: {first[:300]}" if first else ""))
