"""PNG figures (matplotlib, Agg): per-token returns and advantages of the shown episodes.

What the lines mean (docs/inspect.md): a value is drawn only on ASSISTANT tokens; the series has
NaN on OBSERVATION tokens, so no line crosses an observation band (grey). Across each band a dashed
segment shows the running return R that carry-through holds unchanged there (its value at the next
assistant token). With ``compare`` the reset-at-observation returns are drawn too (they drop to 0
before every observation: R is reset there) and the ignore-mask returns on every token.
Every line has a ``gid`` (``return``, ``carried``, ``advantage``, ``return:<estimator>``,
``carried:<estimator>``), so tests can read the data that is drawn.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from agent_loop.inspect.tokens import segments  # noqa: E402
from agent_loop.inspect.values import carried  # noqa: E402
from agent_loop.inspect.view import InspectView, carried_on, episode_label  # noqa: E402
from masking.spans import SpanKind  # noqa: E402

MAX_EPISODE_PLOTS = 8
OBSERVATION_GREY = "#c9ced6"
COLORS = {"carry-through": "#d62728", "advantage": "#1f77b4", "reset-at-observation": "#ff7f0e",
          "ignore-mask": "#7f3fbf"}


def on_assistant(values, spans: list[int]) -> np.ndarray:
    """One row's values as floats with NaN on every non-ASSISTANT token (a gap in the line)."""
    y = np.asarray(values[: len(spans)], dtype=float).copy()
    y[np.asarray(spans) != SpanKind.ASSISTANT] = np.nan
    return y


def held_segments(runs: list[tuple[int, int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """x, y of horizontal segments over each run [start, end) (edges at +-0.5), NaN-separated."""
    x, y = [], []
    for start, end, value in runs:
        x += [start - 0.5, end - 0.5, np.nan]
        y += [value, value, np.nan]
    return np.asarray(x, dtype=float), np.asarray(y, dtype=float)


def episode_axes(ax, view: InspectView, row: int, compare: bool) -> None:
    """Returns and advantages (or the estimators' returns) over the response positions of one row."""
    v, traj = view.values, view.trajectories[row]
    spans, n = traj.spans, len(traj.response_ids)
    for seg in segments(traj):
        if seg.span == SpanKind.OBSERVATION:
            ax.axvspan(seg.start - 0.5, seg.end - 0.5, color=OBSERVATION_GREY, alpha=0.55, lw=0)
    for start in sorted({seg.start for seg in segments(traj) if seg.span == SpanKind.ASSISTANT})[1:]:
        ax.axvline(start - 0.5, color="#4a6d96", lw=0.8, ls=":")  # a new assistant turn starts
    x = np.arange(n)
    returns = v.returns[row, :n]
    ax.plot(x, on_assistant(returns, spans), "-", color=COLORS["carry-through"], lw=1.6, gid="return",
            label="return R (carry-through)")
    runs = carried(returns, spans, carried_on(view, row))
    if runs:
        ax.plot(*held_segments(runs), "--", color=COLORS["carry-through"], lw=1.4, gid="carried",
                label="R carried across the observation")
    if compare:
        reset = v.compare["reset-at-observation"][row, :n]
        ax.plot(x, on_assistant(reset, spans), "-", color=COLORS["reset-at-observation"], lw=1.3,
                gid="return:reset-at-observation", label="return, reset-at-observation")
        if runs:
            ax.plot(*held_segments([(s, e, 0.0) for s, e, _ in runs]), "--", color=COLORS["reset-at-observation"],
                    lw=1.1, gid="carried:reset-at-observation", label="reset: R = 0 at the observation")
        ax.plot(x, v.compare["ignore-mask"][row, :n].numpy(), ":", color=COLORS["ignore-mask"], lw=1.3,
                gid="return:ignore-mask", label="return, ignore-mask (every token)")
    else:
        ax.plot(x, on_assistant(v.advantages[row, :n], spans), "-", color=COLORS["advantage"], lw=1.1,
                gid="advantage", label="advantage (whitened over the file)")
    rewards = v.token_level_rewards[row, :n]
    hits = rewards.nonzero().flatten()
    ax.scatter(hits.numpy(), rewards[hits].numpy(), marker="*", s=70, color="black", zorder=3, label="reward")
    ax.axhline(0, color="#888", lw=0.5)
    ax.set_xlim(-0.5, max(n, 1) - 0.5)
    ok = traj.success
    ax.set_title(f"{episode_label(view, row)} (line {view.lines[row]}): {'success' if ok else 'FAILED'}, "
                 f"reward {traj.reward:g}, finish {traj.finish_reason}", fontsize=9, loc="left",
                 color="black" if ok else "#b00020")
    assistant = np.asarray(spans) == SpanKind.ASSISTANT
    if not np.any(np.asarray(returns, dtype=float)[assistant]):
        ax.text(0.5, 0.5, f"{'failed' if not ok else 'no reward'}: every return is 0 (reward {traj.reward:g}); "
                "the advantages only reflect the file's mean", transform=ax.transAxes, ha="center", va="center",
                fontsize=10, color="#b00020", bbox=dict(facecolor="white", edgecolor="#b00020", alpha=0.9), gid="zero-note")


def flat(view: InspectView, row: int) -> bool:
    """Whether every return and reward of the row is 0 (a flat failure: its advantages only reflect the mean)."""
    v, spans = view.values, view.trajectories[row].spans
    assistant = np.asarray(spans) == SpanKind.ASSISTANT
    n = len(spans)
    return not (np.any(v.returns[row, :n].numpy()[assistant]) or np.any(v.token_level_rewards[row, :n].numpy()))


def panel_rows(view: InspectView) -> list[int]:
    """The rows that get a panel: the selected ones with nonzero values (in selection order), at most
    MAX_EPISODE_PLOTS. A flat failure (every return and reward 0: a flat line) gets none while any episode
    with values is shown, only counted in the title; when every selected episode is flat, the first one is drawn."""
    if view.values is None:
        return []
    rows = [r for r in view.selected if not flat(view, r)]
    return rows[:MAX_EPISODE_PLOTS] if rows else view.selected[:1]


def one_legend(fig: Figure, axes) -> None:
    """One legend for the figure, under the panels (never over the title): every label drawn on any panel, once."""
    handles: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), fontsize=7, loc="outside lower center",
                   ncols=min(len(handles), 4))


def title_lines(text: str, fig: Figure, fontsize: float) -> str:
    """``text`` wrapped to the figure's width (about 0.6 em per character), so its end is never cut off."""
    chars = max(40, int(fig.get_figwidth() * 72 / (0.6 * fontsize)) - 4)
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def figure(view: InspectView, compare: bool = False) -> Figure:
    """The figure: up to MAX_EPISODE_PLOTS of the selected episodes (:func:`panel_rows`), one legend, and
    a title that says the gamma, where the values come from and how many episodes were left out."""
    rows = panel_rows(view)
    fig, axes = plt.subplots(max(len(rows), 1), 1, figsize=(12, 2.4 * max(len(rows), 1) + 0.9), squeeze=False,
                             constrained_layout=True)
    for ax, row in zip(axes[:, 0], rows):
        episode_axes(ax, view, row, compare)
    one_legend(fig, axes[:, 0])
    axes[-1, 0].set_xlabel("response position (token); grey: observation tokens, dotted: a new assistant turn")
    if not rows:
        axes[0, 0].text(0.5, 0.5, "no episode matches the selection", ha="center", va="center")
    matching = view.matching
    left_out = matching - len(rows)
    flat_out = sum(flat(view, r) for r in view.selected) - sum(flat(view, r) for r in rows)
    shown = f"{len(rows)} of {matching} episodes shown" + (
        f" ({left_out} left out" + (f", {flat_out} of them with all values 0" if flat_out else "")
        + ": --episode N, --worst K, --failed choose others)" if left_out else "")
    values = f" · {view.trained_note}" if view.trained_note else ""
    text = f"{view.source} · returns with gamma {view.stats.gamma:g} ({view.gamma_note}){values}\n{shown}"
    fig.suptitle(title_lines(text, fig, 10), fontsize=10, x=0.01, ha="left")
    return fig


def render(view: InspectView, path: str | Path, compare: bool = False) -> None:
    """Write :func:`figure` to ``path`` (PNG)."""
    fig = figure(view, compare)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
