"""PNG figures (matplotlib, Agg): per-token returns/advantages of each shown episode with the
observation runs shaded, and a heatmap of the batch's spans."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from agent_loop.inspect.tokens import segments  # noqa: E402
from agent_loop.inspect.values import ESTIMATORS  # noqa: E402
from agent_loop.inspect.view import InspectView  # noqa: E402
from masking.spans import SpanKind  # noqa: E402

MAX_EPISODE_PLOTS = 8
SPAN_COLORS = ["#ffffff", "#59b359", "#b8bec7"]  # PAD, ASSISTANT, OBSERVATION
ESTIMATOR_STYLES = {"carry-through": ("#d62728", "-"), "reset-at-observation": ("#ff7f0e", "--"),
                    "ignore-mask": ("#7f3fbf", ":")}


def episode_axes(ax, view: InspectView, row: int, compare: bool) -> None:
    """Returns and advantages (or the estimators' returns) over response positions of one row."""
    v, traj = view.values, view.trajectories[row]
    n = len(traj.response_ids)
    for seg in segments(traj):
        if seg.span == SpanKind.OBSERVATION:
            ax.axvspan(seg.start - 0.5, seg.end - 0.5, color=SPAN_COLORS[SpanKind.OBSERVATION], alpha=0.5, lw=0)
    for start in sorted({seg.start for seg in segments(traj) if seg.span == SpanKind.ASSISTANT})[1:]:
        ax.axvline(start - 0.5, color="#4a6d96", lw=0.8, ls=":")  # a new assistant turn starts
    positions = range(n)
    if compare:
        for name in ESTIMATORS:
            color, style = ESTIMATOR_STYLES[name]
            ax.plot(positions, v.compare[name][row, :n].numpy(), style, color=color, lw=1.5, label=f"return, {name}")
    else:
        ax.plot(positions, v.returns[row, :n].numpy(), "-", color="#d62728", lw=1.5, label="return")
        ax.plot(positions, v.advantages[row, :n].numpy(), "-", color="#1f77b4", lw=1.2, label="advantage")
    rewards = v.token_level_rewards[row, :n]
    hits = rewards.nonzero().flatten()
    ax.scatter(hits.numpy(), rewards[hits].numpy(), marker="*", s=60, color="black", zorder=3, label="reward")
    ax.axhline(0, color="#888", lw=0.5)
    ax.set_xlim(-0.5, max(n, 1) - 0.5)
    ax.set_title(f"episode {row}: reward {traj.reward:g}, finish {traj.finish_reason} "
                 "(grey: observation tokens; dotted: a new assistant turn)",
                 fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def render(view: InspectView, path: str | Path, compare: bool = False) -> None:
    """Write one PNG: up to MAX_EPISODE_PLOTS of the selected episodes, then the batch span heatmap."""
    rows = view.selected[:MAX_EPISODE_PLOTS]
    spans = view.values.batch["spans"]
    fig, axes = plt.subplots(len(rows) + 1, 1, figsize=(12, 2.2 * len(rows) + 0.4 * len(view.trajectories) + 1.5),
                             squeeze=False, constrained_layout=True)
    for ax, row in zip(axes[:, 0], rows):
        episode_axes(ax, view, row, compare)
    if rows:
        axes[len(rows) - 1, 0].set_xlabel("response position")
    heat = axes[-1, 0]
    heat.imshow(spans.numpy(), aspect="auto", interpolation="nearest", cmap=ListedColormap(SPAN_COLORS), vmin=0, vmax=2)
    heat.set_title(f"spans of the batch ({spans.shape[0]} episodes × {spans.shape[1]} positions)", fontsize=9, loc="left")
    heat.set_xlabel("response position")
    heat.set_ylabel("episode")
    if spans.shape[0] <= 40:
        heat.set_yticks(range(spans.shape[0]))
    heat.legend(handles=[Patch(facecolor=c, edgecolor="#888", label=SpanKind(k).name.lower())
                         for k, c in enumerate(SPAN_COLORS)], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)
