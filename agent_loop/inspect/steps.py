"""``agent-loop inspect RUN_FOLDER``: a training run over its steps, from what ``agent-loop train`` writes.

Per step: sampled success, reward, turns, tool calls and errors, the finish mix, the advantages (mean, std,
min, max over ASSISTANT tokens) and the KL (``ppo_kl``: the update's policy change; ``ref_kl``: to the
reference, with ``--kl-coef``), plus the held-out greedy evaluation (``eval/success``) where there is one.
They come from ``RUN_FOLDER/metrics.jsonl`` (one line per step, every step); a step without a line there
is read from its step file (``RUN_FOLDER/rollouts/step_NNNNNN.jsonl``, the steps ``--save-rollouts-every``
kept), which also gives the episode count. A resumed run's repeated lines: the last one of a step counts.
Views: a terminal table (rich), a PNG (matplotlib) and a self-contained HTML page with both.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Group
from rich.table import Table
from rich.text import Text

from agent_loop.inspect.html import CSS, esc
from agent_loop.inspect.load import Problems, iter_records
from agent_loop.runners.jsonl import iter_lines
from agent_loop.types import FINISH_REASONS
from masking.kinds import SpanKind

STEP_FILE = re.compile(r"step_(\d{6})\.jsonl$")
SHORT = {"stop": "stop", "max_turns": "max", "length": "len", "error": "err", "observation_overflow": "ovf"}
TABLE_ROWS = 24  # steps the terminal lists by default (evenly spread, the first and the last included)


@dataclass
class StepRow:
    """One step of the run (None: not recorded for that step)."""

    step: int
    episodes: int | None = None  # from the step file
    success: float | None = None  # sampled, at the rollouts' temperature
    reward: float | None = None
    turns: float | None = None
    tool_calls: float | None = None  # per episode
    tool_errors: float | None = None  # failed calls in the step
    finish: dict[str, float] = field(default_factory=dict)  # reason -> share of the step's episodes
    advantage: tuple[float, float, float, float] | None = None  # mean, std, min, max over ASSISTANT tokens
    ppo_kl: float | None = None
    ref_kl: float | None = None
    eval_success: float | None = None  # greedy, on the held-out prompts
    source: str = ""  # "metrics", "step file" or both


@dataclass
class RunSteps:
    folder: Path
    rows: list[StepRow]
    problems: list[str]


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder ``agent-loop train`` wrote (its metrics.jsonl or rollouts/ step files)."""
    path = Path(path)
    return path.is_dir() and ((path / "metrics.jsonl").is_file() or any(step_files(path)))


def step_files(folder: Path) -> list[tuple[int, Path]]:
    rollouts = folder / "rollouts"
    if not rollouts.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in rollouts.iterdir() if (m := STEP_FILE.match(p.name))]
    return sorted(found)


def _number(metrics: dict, name: str) -> float | None:
    value = metrics.get(name)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def from_metrics(line: dict) -> StepRow:
    """A step's line of metrics.jsonl as a row."""
    row = StepRow(int(line["step"]), source="metrics")
    for name in ("success", "reward", "turns", "tool_calls", "ppo_kl", "ref_kl"):
        setattr(row, name, _number(line, name))
    row.tool_errors, row.eval_success = _number(line, "errors/tool"), _number(line, "eval/success")
    row.finish = {r: v for r in FINISH_REASONS if (v := _number(line, f"finish_frac/{r}"))}
    stats = [_number(line, f"advantages/{k}") for k in ("mean", "std", "min", "max")]
    row.advantage = tuple(stats) if None not in stats else None
    return row


def from_step_file(step: int, path: Path, problems: Problems) -> StepRow:
    """A step's row from its step file: one pass, the recorded advantages of its trained episodes. An episode
    is a session: counted once (at its segment 0) in the means; the finish mix is over its records (segments)."""
    row, n, records, calls, errors = StepRow(step, source="step file"), 0, 0, 0, 0
    success = reward = turns = 0.0
    finish: dict[str, int] = {}
    advantages = []
    for record in iter_records(path, problems):
        t = record.trajectory
        records += 1
        if t.segment == 0:
            n, success, reward = n + 1, success + t.success, reward + t.reward
        turns += len(set(t.turn_ids))
        calls += len(t.tool_calls)
        errors += sum(1 for c in t.tool_calls if c.error_kind)
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
        if t.advantages is not None:
            on = np.asarray(t.spans[: len(t.advantages)]) == SpanKind.ASSISTANT
            advantages.append(np.asarray(t.advantages, dtype=float)[on])
    row.episodes = n
    if n:
        row.success, row.reward, row.turns, row.tool_calls = success / n, reward / n, turns / n, calls / n
        row.tool_errors, row.finish = float(errors), {k: v / records for k, v in finish.items()}
    values = np.concatenate(advantages) if advantages else np.zeros(0)
    if values.size:
        row.advantage = (float(values.mean()), float(values.std()), float(values.min()), float(values.max()))
    return row


def metrics_lines(path: Path, problems: list[str]) -> dict[int, dict]:
    """The lines of metrics.jsonl by step (the last line of a step wins: a resumed run appends)."""
    out: dict[int, dict] = {}
    if not path.is_file():
        return out
    with open(path, "rb") as f:
        for number, _, raw, _ in iter_lines(f):
            try:
                line = json.loads(raw)
                out[int(line["step"])] = line
            except (TypeError, ValueError, KeyError):
                if raw is None or raw.strip():
                    problems.append(f"{path}:{number}: not a metrics line (JSON with a step), skipped")
    return out


def read_run(folder: str | Path) -> RunSteps:
    """Every step of the run in ``folder``: metrics.jsonl's line, else the step file's episodes (both when
    both exist: the step file adds the episode count)."""
    folder, problems = Path(folder), []
    lines = metrics_lines(folder / "metrics.jsonl", problems)
    files = dict(step_files(folder))
    rows = []
    for step in sorted(set(lines) | set(files)):
        found = Problems()
        from_file = from_step_file(step, files[step], found) if step in files else None
        problems += found.lines()
        if step not in lines:
            rows.append(from_file)
            continue
        row = from_metrics(lines[step])
        if from_file is not None:
            row.episodes, row.source = from_file.episodes, "metrics + step file"
            row.advantage = row.advantage or from_file.advantage
        rows.append(row)
    return RunSteps(folder, rows, problems)


# -- views ------------------------------------------------------------------------------------------

def finish_mix(finish: dict[str, float]) -> str:
    """``stop 88% max 12%``: the reasons of a step, most frequent first."""
    return " ".join(f"{SHORT.get(k, k)} {v:.0%}" for k, v in sorted(finish.items(), key=lambda kv: -kv[1]))


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def cells(row: StepRow) -> dict[str, str]:
    """The row as the table's cells (column -> text)."""
    adv = "-" if row.advantage is None else f"{row.advantage[0]:+.2f}±{row.advantage[1]:.2f}"
    kl = fmt(row.ppo_kl, ".1e") + ("" if row.ref_kl is None else f" ref {row.ref_kl:.1e}")
    return {"step": str(row.step), "eps": fmt(row.episodes, "d"), "succ": fmt(row.success),
            "reward": fmt(row.reward), "turns": fmt(row.turns, ".2f"), "calls": fmt(row.tool_calls, ".2f"),
            "errs": fmt(row.tool_errors, ".0f"), "finish": finish_mix(row.finish), "adv±std": adv,
            "kl": kl, "eval": fmt(row.eval_success)}


def listed(rows: list[StepRow], limit: int | None) -> list[StepRow]:
    """At most ``limit`` rows, evenly spread over the run (the first and the last kept); None: all."""
    if limit is None or len(rows) <= limit:
        return rows
    picks = np.unique(np.linspace(0, len(rows) - 1, limit).round().astype(int))
    return [rows[i] for i in picks]


def trend(run: RunSteps, window: int = 5) -> str:
    """Sampled success over the first and the last steps (the mean of up to ``window``), and the greedy
    evaluation's first and last, each named as what it is."""
    def ends(values):
        values = [v for v in values if v is not None]
        if not values:
            return None
        k = max(1, min(window, len(values) // 2))
        return sum(values[:k]) / k, sum(values[-k:]) / k, k
    parts = []
    if (s := ends([r.success for r in run.rows])) is not None:
        parts.append(f"sampled success {s[0]:.3f} (mean of the first {s[2]} steps) -> {s[1]:.3f} (the last {s[2]})")
    evals = [r.eval_success for r in run.rows if r.eval_success is not None]
    if evals:
        parts.append(f"greedy eval success {evals[0]:.3f} -> {evals[-1]:.3f} (held-out prompts)")
    return "; ".join(parts) or "no step recorded a success"


DROPPED_FIRST = ("calls", "eps", "turns", "errs", "kl")  # left out, in this order, when the width is short
CUT = {"finish": 6, "kl": 7}  # columns cut with … (to this width at the least) before any is left out


def table(run: RunSteps, width: int, limit: int | None = TABLE_ROWS):
    """The terminal table: one line per step that fits ``width`` (80 columns and up): ``finish`` and ``kl`` are
    cut with … first, then the least telling columns are left out (said under the table); then the trend."""
    rows = listed(run.rows, limit)
    shown = [cells(r) for r in rows]
    columns = [c for c in shown[0] if any(s[c] not in ("-", "") for s in shown)] if shown else []
    full = {c: max([len(c)] + [len(s[c]) for s in shown]) for c in columns}
    need = {c: min(CUT.get(c, full[c]), full[c]) for c in columns}
    left_out = []
    for name in DROPPED_FIRST:
        if sum(need[c] + 3 for c in columns) + 1 <= width:
            break
        if name in columns:
            columns.remove(name)
            left_out.append(name)
    spare = width - (sum(need[c] + 3 for c in columns) + 1)
    for name in CUT:  # give the cut columns back what fits
        if name in columns:
            grow = min(max(spare, 0), full[name] - need[name])
            need[name], spare = need[name] + grow, spare - grow
    title = (f"{run.folder}: {len(run.rows)} steps" + (f" ({len(rows)} listed, evenly spread; --all for every one)"
                                                       if len(rows) < len(run.rows) else ""))
    out = Table(title=title, title_justify="left")
    for name in columns:
        out.add_column(name, no_wrap=True, justify="left" if name in CUT else "right", overflow="ellipsis",
                       width=need[name])
    for s in shown:
        out.add_row(*(s[c] for c in columns))
    note = f" (left out at {width} columns: {', '.join(left_out)}; --width or --html shows them)" if left_out else ""
    return Group(out, Text(trend(run) + note))


def series(run: RunSteps, name: str) -> tuple[np.ndarray, np.ndarray]:
    """x (steps) and y of one attribute, NaN where a step did not record it."""
    x = np.asarray([r.step for r in run.rows], dtype=float)
    y = np.asarray([np.nan if getattr(r, name) is None else getattr(r, name) for r in run.rows], dtype=float)
    return x, y


def figure(run: RunSteps):
    """Six panels over the steps: success (sampled; greedy eval), reward, turns and tool use, the finish mix,
    the advantages (mean, ±std, min-max) and the KL. Each line has a ``gid`` (the attribute it draws)."""
    # matplotlib: 1 s to import, for the figures alone; its Agg backend is chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(3, 2, figsize=(12, 9), constrained_layout=True, squeeze=False)
    (ok, rw), (tu, fi), (ad, kl) = axes
    for ax, names, title in ((ok, ("success", "eval_success"), "success (sampled; eval: greedy, held-out)"),
                             (rw, ("reward",), "mean reward"),
                             (tu, ("turns", "tool_calls", "tool_errors"), "turns, tool calls per episode, tool errors"),
                             (kl, ("ppo_kl", "ref_kl"), "KL (ppo_kl: the update; ref_kl: to the reference)")):
        for name in names:
            x, y = series(run, name)
            if np.isfinite(y).any():
                ax.plot(x, y, "o-" if len(x) < 30 else "-", ms=3, lw=1.3, gid=name, label=name)
        ax.set_title(title, fontsize=9, loc="left")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    x = np.asarray([r.step for r in run.rows], dtype=float)
    reasons = [k for k in FINISH_REASONS if any(k in r.finish for r in run.rows)]
    if reasons:
        fi.stackplot(x, *[[r.finish.get(k, 0.0) for r in run.rows] for k in reasons], labels=reasons, alpha=0.8)
        fi.legend(fontsize=7, loc="lower left")
    fi.set_title("finish reasons (share of the step's episodes)", fontsize=9, loc="left")
    stats = np.asarray([r.advantage if r.advantage else (np.nan,) * 4 for r in run.rows], dtype=float).reshape(-1, 4)
    if np.isfinite(stats).any():
        ad.fill_between(x, stats[:, 2], stats[:, 3], color="#1f77b4", alpha=0.12, lw=0, label="min-max")
        ad.fill_between(x, stats[:, 0] - stats[:, 1], stats[:, 0] + stats[:, 1], color="#1f77b4", alpha=0.3, lw=0,
                        label="mean ± std")
        ad.plot(x, stats[:, 0], "-", color="#1f77b4", lw=1.3, gid="advantage", label="mean")
        ad.legend(fontsize=7, loc="best")
    ad.set_title("advantages over ASSISTANT tokens", fontsize=9, loc="left")
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"{run.folder}: {len(run.rows)} steps · {trend(run)}", fontsize=10, x=0.01, ha="left")
    return fig


def render_png(run: RunSteps, path: str | Path) -> None:
    import matplotlib.pyplot as plt  # matplotlib: as in figure()

    fig = figure(run)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def render_html(run: RunSteps) -> str:
    """One self-contained page: the figure (inline PNG), the trend line and every step's row."""
    buffer = io.BytesIO()
    render_png(run, buffer)
    image = base64.b64encode(buffer.getvalue()).decode("ascii")
    shown = [cells(r) for r in run.rows]
    columns = list(shown[0]) if shown else []
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = "".join(f'<tr data-step="{s["step"]}">' + "".join(f"<td>{esc(s[c])}</td>" for c in columns) + "</tr>"
                   for s in shown)
    warnings = "".join(f'<div class="card warn">warning: {esc(m)}</div>' for m in run.problems)
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>agent-loop inspect: {esc(run.folder)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>agent-loop inspect · {esc(run.folder)} · {len(run.rows)} steps</h1></header><main>{warnings}"
            f'<section class="card"><p>{esc(trend(run))}</p><img alt="the run over its steps" style="max-width:100%" '
            f'src="data:image/png;base64,{image}"></section><section class="card"><table class="steps">'
            f"<tr>{head}</tr>{body}</table></section></main></body></html>")
