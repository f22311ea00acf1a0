"""Terminal view (rich): each episode as its turns, tokens coloured by span, tool calls, optional
per-token value tables and the estimator comparison."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from agent_loop.inspect.tokens import Segment, show_whitespace, turns, versions_note
from agent_loop.inspect.turn_view import turn_advantage_of, turn_rows
from agent_loop.inspect.values import COMPARED
from agent_loop.inspect.values import carried as carried_runs
from agent_loop.inspect.view import (
    InspectView,
    carried_on,
    continues_note,
    episode_label,
    episodes_text,
    row_values_note,
    segment_note,
)
from agent_loop.options import plural, rate
from masking.spans import SpanKind

# two shades per span so that neighbouring tokens stay distinguishable
TOKEN_STYLES = {
    SpanKind.ASSISTANT: ("black on #9be59b", "black on #c9f2c9"),
    SpanKind.OBSERVATION: ("#303030 on #d0d0d0", "#303030 on #e6e6e6"),
}
# --color-by version: ASSISTANT tokens by the policy version that sampled them, the episode's oldest first
VERSION_STYLES = ("black on #9be59b", "black on #f2d28b", "black on #9cc9f5", "black on #f0a3c0", "black on #c8b5f2")
PROMPT_CHARS = 160  # the end of the prompt: the question and the generation prompt


def _fmt(x: float) -> str:
    return f"{x:+.3f}" if x else "0"


def advantage_style(value: float, scale: float) -> str:
    """A background from white to green (positive) or red (negative), by ``|value| / scale``."""
    level = min(abs(value) / scale, 1.0) if scale > 0 else 0.0
    end = (90, 200, 90) if value >= 0 else (230, 95, 95)
    r, g, b = (round(255 + (c - 255) * level) for c in end)
    return f"black on rgb({r},{g},{b})"


def legend(color_by: str = "span") -> Text:
    if color_by == "turn-advantage":
        text = Text("assistant tokens by their turn's advantage: ")
        for value in (-1.0, -0.5, 0.0, 0.5, 1.0):
            text.append(f" {value:+.1f} " if value else " 0 ", style=advantage_style(value, 1.0))
        text.append(" ")
        text.append(" observation ", style=TOKEN_STYLES[SpanKind.OBSERVATION][0])
        return text.append("  (scaled to each episode's largest |advantage|; the per-turn table gives the values)",
                           style="dim")
    if color_by == "version":
        text = Text("assistant tokens by policy version: ")
        for k, style in enumerate(VERSION_STYLES):
            text.append(" oldest " if k == 0 else f" +{k} ", style=style)
        text.append(" ")
        text.append(" observation ", style=TOKEN_STYLES[SpanKind.OBSERVATION][0])
        return text.append("  (versions relative to the episode's oldest; colours repeat after 5)", style="dim")
    text = Text("tokens: ")
    text.append(" assistant ", style=TOKEN_STYLES[SpanKind.ASSISTANT][0])
    text.append(" ")
    text.append(" observation ", style=TOKEN_STYLES[SpanKind.OBSERVATION][0])
    text.append("  (↵ newline; shades alternate per token)", style="dim")
    return text


def episode_header(view: InspectView, row: int) -> Text:
    traj = view.trajectories[row]
    n_assistant = sum(1 for s in traj.spans if s == SpanKind.ASSISTANT)
    status = Text("success", style="bold green") if traj.success else Text("failed", style="bold red")
    segment = segment_note(view, row)
    header = Text.assemble(
        (f"episode {view.ids[row]}", "bold"), (f" · {segment}" if segment else "", "bold magenta"), f" · line {view.lines[row]} · reward {traj.reward:g} · ", status,
        f" · finish {traj.finish_reason}{' (truncated)' if traj.truncated else ''}",
        f" · {plural(len(set(traj.turn_ids)), 'turn')} · {n_assistant} assistant / {len(traj.spans) - n_assistant} observation tokens",
    )
    if traj.info.get("task"):
        header.append(f" · task {traj.info['task']}")
    if note := versions_note(traj):
        header.append(f" · {note}", style="magenta" if "partial" in note else "")
    if view.reasons[row]:
        header.append(f" · shown as {view.reasons[row]}", style="italic cyan")
    return header


def segment_text(view: InspectView, row: int, segment: Segment, color_by: str = "span") -> Text:
    """The tokens of one segment, each with its span colour (``color_by="version"``: ASSISTANT tokens by the
    policy version that sampled them, when the episode records versions)."""
    pieces, versions = view.pieces[row], view.trajectories[row].policy_versions
    by_version = color_by == "version" and versions is not None and segment.span == SpanKind.ASSISTANT
    oldest = min((v for v in versions if v >= 0), default=0) if by_version else 0
    by_turn = color_by == "turn-advantage" and segment.span == SpanKind.ASSISTANT and view.values is not None
    if by_turn:  # the turn's advantage, scaled to the episode's largest
        per_turn = turn_advantage_of(view, row)
        turn_style = advantage_style(per_turn[segment.turn], max(map(abs, per_turn.values())))
    text = Text()
    for k, pos in enumerate(range(segment.start, segment.end)):
        style = (VERSION_STYLES[(versions[pos] - oldest) % len(VERSION_STYLES)] if by_version
                 else turn_style if by_turn else TOKEN_STYLES[SpanKind(segment.span)][k % 2])
        text.append(show_whitespace(pieces[pos]), style=style)
    return text


def tool_table(view: InspectView, row: int, turn: int) -> Table | None:
    calls = [c for c in view.trajectories[row].tool_calls if c.turn == turn]
    if not calls:
        return None
    table = Table(title=f"tool calls of turn {turn}", title_justify="left", expand=True, show_lines=False)
    for name, ratio in (("tool", 2), ("arguments", 4), ("result / error", 5), ("latency", 2)):
        table.add_column(name, ratio=ratio, no_wrap=True, overflow="ellipsis",
                         justify="right" if name == "latency" else "left")
    for call in calls:
        outcome = (Text(f"{call.error_kind}: {call.error}", style="bold red") if call.error_kind
                   else Text(str(call.result)))
        table.add_row(call.name, str(call.arguments), outcome, f"{call.latency_s * 1000:.1f} ms")
    return table


def value_table(view: InspectView, row: int, turn: int, segs: list[Segment]) -> Table:
    """One row per assistant token; each observation run collapsed into one row (its returns are 0
    and the running return is carried through it unchanged)."""
    v = view.values
    table = Table(title=f"values of turn {turn} ({row_values_note(view, row)})", title_justify="left", expand=True)
    for name in ("pos", "token", "id", "logprob", "reward", "return", "advantage"):
        table.add_column(name, justify="left" if name == "token" else "right", no_wrap=True, overflow="ellipsis",
                         ratio=3 if name == "token" else None)
    ids = view.trajectories[row].response_ids
    held = {start: r for start, _, r in carried_runs(v.returns[row], view.trajectories[row].spans, carried_on(view, row))}
    for seg in segs:
        if seg.span != SpanKind.ASSISTANT:
            carried = held[seg.start]
            table.add_row(f"{seg.start}-{seg.end - 1}", f"observation × {seg.end - seg.start}", "", "", "",
                          f"R={_fmt(carried)} carried", "", style="dim")
            continue
        for pos in range(seg.start, seg.end):
            table.add_row(
                str(pos), repr(view.pieces[row][pos]), str(ids[pos]),
                f"{float(v.batch['old_logprobs'][row, pos]):.3f}",
                _fmt(float(v.token_level_rewards[row, pos])),
                _fmt(float(v.returns[row, pos])), _fmt(float(v.advantages[row, pos])),
            )
    return table


def turn_table(view: InspectView, row: int) -> Table:
    """One row per assistant turn (:func:`~agent_loop.inspect.turn_view.turn_rows`): tokens, reward, return,
    advantage, and the anchor-state group it joined (gigpo, as trained) or the task's state key."""
    rows = turn_rows(view, row)
    table = Table(title=f"{episode_label(view, row)}: per turn ({row_values_note(view, row)})", title_justify="left")
    for name in ("turn", "tokens", "reward", "return", "advantage", "anchor group", "state"):
        table.add_column(name, justify="left" if name in ("anchor group", "state") else "right", no_wrap=True,
                         overflow="ellipsis")
    scale = max((abs(r.advantage) for r in rows), default=0.0)
    for r in rows:
        table.add_row(str(r.turn), str(r.tokens), _fmt(r.reward), _fmt(r.ret),
                      Text(_fmt(r.advantage), style=advantage_style(r.advantage, scale)),
                      r.anchor or "-", r.state or "-")
    return table


def episode(view: InspectView, row: int, values: bool = False, color_by: str = "span", turns_view: bool = False) -> Group:
    """Header, prompt, then each turn: its tokens (coloured by span, by policy version or by the turn's advantage),
    its tool calls and (``values``) its value table; ``turns_view``: the per-turn table at the end."""
    traj = view.trajectories[row]
    prompt = view.prompts[row].replace("\n", "↵")
    if len(prompt) > PROMPT_CHARS:
        prompt = "…" + prompt[-PROMPT_CHARS:]
    parts: list = [Rule(style="bold")]
    if view.segments[row] > 1 and traj.segment == 0:
        parts.append(Text(f"episode {view.ids[row]}: one session of {view.segments[row]} segments (its agent rewrote "
                          "its history), shown in order; its returns run across them", style="bold magenta"))
    parts += [episode_header(view, row),
                   Text(f"prompt ({plural(len(traj.prompt_ids), 'token')}): ", style="bold").append(prompt, style="dim")]
    for turn, segs in turns(traj):
        parts.append(Rule(f"turn {turn}", style="cyan", align="left"))
        body = Text()
        for seg in segs:
            body.append_text(segment_text(view, row, seg, color_by))
        parts.append(body)
        table = tool_table(view, row, turn)
        if table is not None:
            parts.append(table)
        if values:
            parts.append(value_table(view, row, turn, segs))
    if traj.turn_rewards is not None:
        parts.append(Text(f"turn rewards: {traj.turn_rewards}"))
    if turns_view and view.values is not None:
        parts.append(turn_table(view, row))
    if note := continues_note(view, row):
        parts.append(Text(f"↳ {note}", style="magenta"))
    return Group(*parts)


def problem_lines(view: InspectView) -> list[Text]:
    """Reward errors, tool errors, template mismatches and failed episodes, with their first messages."""
    s, out = view.summary, []
    if s.reward_errors:
        first = "; ".join(f"episode {i}: {m}" for i, m in s.first_reward_errors)
        out.append(Text(f"reward errors: {plural(s.reward_errors, 'episode')} ended as errors because the reward "
                        f"could not be computed (first: {first})", style="bold red"))
    if s.tool_errors:
        out.append(Text(f"tool errors: {plural(sum(s.tool_errors.values()), 'call')} failed ("
                        + ", ".join(f"{k} {c}" for k, c in s.tool_errors.most_common()) + ")", style="red"))
    if s.template_mismatches:
        out.append(Text(f"template mismatches: {plural(s.template_mismatches, 'episode')} "
                        f"({plural(s.template_mismatch_turns, 'turn')}) whose tokens differ from a one-go render "
                        "of their messages", style="red"))
    reward_failed = {i for i, _ in s.first_reward_errors}  # listed above already
    errors = [(i, m) for i, m in s.first_errors if i not in reward_failed and not str(m).startswith("reward: ")]
    if errors:
        out.append(Text("episode errors (first): " + "; ".join(f"episode {i}: {m}" for i, m in errors), style="red"))
    if view.trained_note:
        out.append(Text(f"values: {view.trained_note}", style="bold cyan"))
    return out


def batch_summary(view: InspectView, shown: str, width: int = 80) -> Group:
    """The whole file in one pass, as a two-column table of one line per row that fits ``width`` columns
    (a long value is cut with …, never the names), then one line per kind of problem (these wrap)."""
    s = view.summary
    table = Table(show_header=False)
    n = max(s.episodes, 1)
    errors = ", ".join(f"{k} {c}" for k, c in s.tool_errors.most_common()) or "none"
    rows = (
        ("success rate", f"{rate(s.successes / n)} ({s.successes} of {s.episodes})"),
        ("mean reward", f"{s.reward_sum / n:.3f}"),
        ("mean turns", f"{s.turns / n:.2f}"),
        ("finish reasons", ", ".join(f"{k} {c}" for k, c in s.finish_reasons.most_common())),
        ("tool calls", f"{s.tool_calls} ({plural(sum(s.tool_errors.values()), 'error')}: {errors})"),
        ("reward errors", str(s.reward_errors)),
        ("template diffs", str(s.template_mismatches)),  # template mismatches; 14 columns keep 80 wide
        ("tokens", f"{s.assistant_tokens} assistant / {s.observation_tokens} observation"),
        ("gamma", f"{view.stats.gamma:g} ({view.gamma_note})"),
        ("returns", f"{view.stats.estimator} ({view.estimator_note})" if view.estimator_note else view.stats.estimator),
        ("shown", shown),
    )
    names = max(len(name) for name, _ in rows)
    table.add_column("metric", style="bold", no_wrap=True, min_width=names)
    table.add_column("value", no_wrap=True, overflow="ellipsis", max_width=max(width - names - 7, 8))  # 7: borders
    for name, value in rows:
        table.add_row(name, value)
    return Group(Text(f"{view.source}: {episodes_text(s)}", style="bold"), table, *problem_lines(view))


def estimator_table(view: InspectView) -> Table:
    """One row per estimator: how far its returns on the file's assistant tokens are from carry-through."""
    table = Table(title=f"return estimators over the file (gamma {view.stats.gamma:g}, assistant tokens)",
                  title_justify="left")
    for name in ("estimator", "mean return", "tokens that differ", "mean |diff|"):
        table.add_column(name, justify="left" if name == "estimator" else "right", no_wrap=True)
    summaries = view.stats.summaries()
    for e in summaries:
        table.add_row(e.name, f"{e.mean_return:.4f}",
                      Text(f"{e.differing_tokens} / {e.assistant_tokens}", style="bold red" if e.differing_tokens else "green"),
                      f"{e.mean_abs_diff:.4f}")
    table.caption = " · ".join(f"{e.name}: {e.description}" for e in summaries)
    table.caption_justify = "left"
    return table


def compare_table(view: InspectView, row: int) -> Table:
    """Per run of tokens of one turn and span: the return at its first and last token under each estimator."""
    v = view.values
    table = Table(title=f"{episode_label(view, row)}: returns per span run (first → last token)", title_justify="left")
    for name in ("turn", "span", "positions"):
        table.add_column(name, no_wrap=True)
    for name in COMPARED:
        table.add_column(name, justify="right", no_wrap=True)
    for _, segs in turns(view.trajectories[row]):
        for seg in segs:
            cells = []
            for name in COMPARED:
                first, last = (float(v.compare[name][row, p]) for p in (seg.start, seg.end - 1))
                differs = bool(v.differs(name)[row, seg.start:seg.end].any())
                cells.append(Text(f"{first:.3f}→{last:.3f}".replace("-0.000", "0.000"),
                                  style="bold red" if differs else ""))
            table.add_row(str(seg.turn), seg.span_name[:3], f"{seg.start}-{seg.end - 1}", *cells)
    return table


def shown_line(view: InspectView, all_mode: bool) -> str:
    n, matching = view.episode_count(view.selected), view.matching
    if matching == 0:
        return "none: no episode matches the selection"
    if n == matching:
        return f"all {n} matching episodes" if n != 1 else "1 episode"
    if any(view.reasons):
        return f"the {n} most informative of {matching} (--all for every one)"
    return f"{n} of {matching} matching episodes" + (" (--max-episodes)" if all_mode else "")


def render(view: InspectView, console: Console, values: bool = False, compare: bool = False,
           all_mode: bool = False, color_by: str = "span", turns_view: bool = False) -> None:
    """Print the file's summary (load problems are the caller's to report), then each selected episode
    (and the comparison when ``compare``; the per-turn table when ``turns_view``)."""
    console.print(batch_summary(view, shown_line(view, all_mode), console.width))
    if compare:
        console.print(estimator_table(view))
    if not view.selected:
        console.print(Panel("no episode matches the selection", style="yellow"))
        return
    console.print(legend(color_by))
    for row in view.selected:
        console.print(episode(view, row, values=values, color_by=color_by, turns_view=turns_view))
        if compare:
            console.print(compare_table(view, row))
