"""``agent-loop inspect A.jsonl B.jsonl``: two runs of the same episodes side by side.

Episodes are matched by ``info.index`` and ``info.seed`` (``match="index"``; a session's segment k with segment k), or by prompt (``match="prompt"``:
the k-th episode of a prompt in A with the k-th of the same prompt in B), which is the default for two
step files of a training run, whose steps play new indices. One pass over each file keeps a small
record per episode (line, offset, outcome, a digest of its tokens); only the pairs shown are read
again in full (by byte offset), to show their token sequences from the first divergence.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

import agent_loop.inspect.html as page_html
from agent_loop.episode.chat import first_difference
from agent_loop.inspect.load import Problems, iter_records, read_at
from agent_loop.inspect.tokens import TokenText, show_whitespace
from agent_loop.inspect.view import episode_id
from agent_loop.options import plural, rate
from agent_loop.runners.stats import RolloutStats
from masking.kinds import SpanKind

SHOWN = 3  # pairs shown in full by default
TABLE_ROWS = 20  # pairs listed by default
DETAILED = 200  # listed pairs that differ whose differing positions are read (each pair read again by offset)
NAMED = 5  # positions (or episodes) a cell or line names before "…"
CONTEXT = 8  # tokens of shared context before the first divergence (terminal)
AFTER = 40  # tokens of each run after it (terminal)


@dataclass
class Brief:
    """What the comparison needs of one episode, without its tokens."""

    line: int
    offset: int
    index: int
    seed: object
    success: bool
    reward: float
    turns: int
    finish: str
    tokens: int
    digest: str
    values: str = ""  # digest of the recorded returns and advantages ("" when the episode carries none)
    prompt: str = ""  # digest of the prompt's token ids
    step: object = None  # info["step"]: the training step of a step file's episode
    segment: int = 0  # its place in its session (a session whose agent rewrote its history has several)

    @property
    def key(self) -> tuple:
        """What pairs it with the other run's: a session's segment k with segment k of the same episode."""
        return (self.index, self.seed, self.segment)


MATCHES = {"index": "(info.index, info.seed)", "prompt": "prompt"}  # how episodes are matched -> as it is said


def briefs(path: str | Path, problems: Problems) -> tuple[list[Brief], RolloutStats]:
    """One pass over ``path``: a brief of each episode and the summary of them all; raises InputError when
    it is not a JSON Lines file."""
    out, summary = [], RolloutStats()
    for ordinal, record in enumerate(iter_records(path, problems)):
        t = record.trajectory
        digest = hashlib.blake2b(repr(t.response_ids).encode(), digest_size=8).hexdigest()
        values = "" if t.returns is None else hashlib.blake2b(repr((t.returns, t.advantages)).encode(),
                                                                digest_size=8).hexdigest()
        prompt = hashlib.blake2b(repr(t.prompt_ids).encode(), digest_size=8).hexdigest()
        out.append(Brief(record.line, record.offset, episode_id(t, ordinal), t.info.get("seed"), t.success,
                         t.reward, len(set(t.turn_ids)), t.finish_reason, len(t.response_ids), digest, values,
                         prompt, t.info.get("step"), t.segment))
        summary.add(t, index=out[-1].index)
    return out, summary


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where the two token sequences differ (the shorter one's end if one is a
    prefix of the other), or None when they are equal."""
    return None if a == b else first_difference(a, b)


@dataclass
class Pair:
    a: Brief
    b: Brief
    divergence: int | None = None  # filled for the pairs read in full
    traj_a: object = None
    traj_b: object = None
    token_diffs: list[int] | None = None  # positions (of the common length) whose token ids differ, once read
    value_diffs: list[int] | None = None  # the same for the recorded returns and advantages (step files)

    @property
    def differs(self) -> bool:
        """Whether the two episodes differ in tokens, outcome or recorded values (from the briefs alone)."""
        a, b = self.a, self.b
        return (a.digest, a.tokens, a.reward, a.finish, a.turns, a.values) != (
            b.digest, b.tokens, b.reward, b.finish, b.turns, b.values)


@dataclass
class Comparison:
    paths: tuple[Path, Path]
    runs: tuple[list[Brief], list[Brief]]
    summaries: tuple[RolloutStats, RolloutStats]
    pairs: list[Pair]
    only: tuple[list[Brief], list[Brief]]  # episodes without a match in the other run
    shown: list[int]  # indices into pairs read in full
    problems: list[str]
    match: str = "index"  # how the episodes were matched (a key of MATCHES)

    def no_match(self) -> str:
        """Why no pair was found, and what to pass: the one line of an empty comparison."""
        a, b = self.runs
        steps = [r[0].step for r in self.runs if r and r[0].step is not None]
        if self.match == "index":
            why = ("two steps of a run play new indices" if len(steps) == 2
                   else "the runs played other episodes (another --seed or --episodes range)")
            return (f"no episode of A matches one of B by {MATCHES['index']}: {why}; --match prompt pairs the "
                    "episodes of the same prompt")
        return (f"no episode of A matches one of B by prompt: the {len(a)} and {len(b)} episodes share no prompt "
                "(another task, model or chat template?); --match index pairs them by (info.index, info.seed)")


def match_pairs(runs, paths, match: str, problems: list[str]) -> tuple[list[Pair], tuple[list, list]]:
    """Pair the briefs of A and B by ``(index, seed)`` or by (prompt, k-th episode of that prompt); a key seen
    twice in a file is named in ``problems`` and its repeat left unmatched. Returns the pairs and the unmatched."""
    keyed, every = [], []
    for path, run in zip(paths, runs):
        keys, count, all_keys = {}, {}, []
        for brief in run:
            if match == "prompt":  # the k-th episode of a prompt (a group of k per prompt per step)
                count[brief.prompt] = count.get(brief.prompt, -1) + 1
                key = (brief.prompt, count[brief.prompt])
            else:
                key = brief.key
            all_keys.append(key)
            if key in keys:
                problems.append(f"{path}:{brief.line}: episode {brief.index} (seed {brief.seed}) again; matched "
                                f"the first one (line {keys[key].line})")
                continue
            keys[key] = brief
        keyed.append(keys)
        every.append(all_keys)
    pairs = [Pair(brief, keyed[1][key]) for key, brief in keyed[0].items() if key in keyed[1]]
    pairs.sort(key=lambda p: (p.a.index, str(p.a.seed)))
    both = keyed[0].keys() & keyed[1].keys()
    return pairs, tuple([b for b, k in zip(run, keys) if k not in both] for run, keys in zip(runs, every))


def compare(path_a, path_b, ids: list[int] | None = None, show_all: bool = False, limit: int = 100,
            failed: bool = False, match: str | None = None) -> Comparison:
    """Match the episodes of two files (``match``: ``"index"`` or ``"prompt"``; None: by prompt when both are
    step files of a training run, else by index) and read the pairs to show in full."""
    problems, runs, summaries = [], [], []
    for path in (path_a, path_b):
        found = Problems()
        run_briefs, summary = briefs(path, found)
        runs.append(run_briefs)
        summaries.append(summary)
        problems += found.lines()
    if match is None:
        match = "prompt" if all(r and r[0].step is not None for r in runs) else "index"
    pairs, only = match_pairs(runs, (path_a, path_b), match, problems)
    candidates = [i for i, p in enumerate(pairs) if not failed or not (p.a.success and p.b.success)]
    if ids:
        shown = [i for i in candidates if pairs[i].a.index in ids]
    elif show_all:
        shown = candidates[:limit]
    else:  # the most telling first: outcomes that differ, then tokens that differ
        def rank(i):
            p = pairs[i]
            return (p.a.success == p.b.success, p.a.digest == p.b.digest, i)
        shown = sorted(candidates, key=rank)[:SHOWN]
    for i in shown:
        read_pair(pairs[i], path_a, path_b)
    return Comparison((Path(path_a), Path(path_b)), (runs[0], runs[1]), (summaries[0], summaries[1]), pairs, only,
                      shown, problems, match)


def positions(a: list | None, b: list | None) -> list[int]:
    """The positions of the common length where ``a`` and ``b`` differ ([] when either is None)."""
    if a is None or b is None:
        return []
    n = min(len(a), len(b))
    return np.flatnonzero(np.asarray(a[:n], dtype=float) != np.asarray(b[:n], dtype=float)).tolist()


def read_pair(pair: Pair, path_a, path_b) -> Pair:
    """Read both episodes of ``pair`` in full (by byte offset) and fill where they differ."""
    if pair.traj_a is None:
        pair.traj_a, pair.traj_b = read_at(path_a, pair.a.offset), read_at(path_b, pair.b.offset)
    ta, tb = pair.traj_a, pair.traj_b
    pair.divergence = first_divergence(ta.response_ids, tb.response_ids)
    pair.token_diffs = positions(ta.response_ids, tb.response_ids)
    pair.value_diffs = sorted(set(positions(ta.returns, tb.returns)) | set(positions(ta.advantages, tb.advantages)))
    return pair


def detail(c: Comparison, rows: list[int]) -> None:
    """Read the differing pairs among ``rows`` (at most DETAILED of them), so the table says where they differ."""
    for i in [i for i in rows if c.pairs[i].differs and c.pairs[i].token_diffs is None][:DETAILED]:
        read_pair(c.pairs[i], *c.paths)


def named(values: list, cap: int = NAMED) -> str:
    """``"3, 7, 9"``, or the first ``cap`` and ``…``."""
    return ", ".join(map(str, values[:cap])) + (", …" if len(values) > cap else "")


def stats(summary: RolloutStats) -> dict[str, str]:
    """A run's summary as the rows of the comparison table."""
    segments = f" ({plural(summary.segments, 'segment')})" if summary.segments != summary.episodes else ""
    return {"episodes": f"{summary.episodes}{segments}", "success rate": rate(summary.success_rate),
            "mean reward": f"{summary.mean('reward_sum'):.3f}", "mean turns": f"{summary.mean('turns'):.2f}",
            "mean tokens": f"{summary.mean('assistant_tokens') + summary.mean('observation_tokens'):.1f}"}


def tokens_state(pair: Pair) -> str:
    """What differs between the two episodes: "same", or the tokens (how many positions and which, once the
    pair is read; else their lengths), the outcome fields and the recorded values (step files), comma-separated."""
    a, b, out = pair.a, pair.b, []
    if a.digest != b.digest or a.tokens != b.tokens:
        out.append(token_difference(pair))
    out += [f"{name} {x} vs {y}" for name, x, y in (("reward", f"{a.reward:g}", f"{b.reward:g}"),
                                                     ("finish", a.finish, b.finish), ("turns", a.turns, b.turns))
            if x != y]
    if a.values != b.values:
        if not (a.values and b.values):
            out.append(f"values only in {'A' if a.values else 'B'}")
        elif pair.value_diffs is None:
            out.append("values differ")
        else:
            out.append(f"values differ at {plural(len(pair.value_diffs), 'position')}: {named(pair.value_diffs)}"
                       if pair.value_diffs else "values differ past the shorter run's end")
    return ", ".join(out) or "same"


def token_difference(pair: Pair) -> str:
    """How the token sequences of a pair differ: at how many positions and which (read pairs), and lengths."""
    a, b, diffs = pair.a, pair.b, pair.token_diffs
    lengths = f"lengths {a.tokens} vs {b.tokens}" if a.tokens != b.tokens else ""
    if diffs is None:
        return (f"tokens differ ({a.tokens} vs {b.tokens})" if lengths
                else f"tokens differ (same length {a.tokens}, other ids)")
    if not diffs:
        return f"tokens differ: {lengths}, the first {min(a.tokens, b.tokens)} the same"
    return (f"tokens differ at {plural(len(diffs), 'position')}: {named(diffs)}"
            + (f" ({lengths})" if lengths else ""))


def outcome(b: Brief) -> str:
    return f"{'ok' if b.success else 'FAIL'} {b.reward:g} {b.turns}t"


# -- terminal ----------------------------------------------------------------------------------------

LABEL_MIN = 12  # the narrowest label column the summary table is drawn with; narrower: one plain line per row


def summary_table(c: Comparison, width: int = 80) -> Table | Text:
    """The two runs side by side within ``width`` columns: the values keep their full width, the labels wrap.
    Too narrow for that: one line per row (``label: A x · B y``, wrapped by the console)."""
    a, b = (stats(r) for r in c.summaries)
    rows = [(key, a[key], b[key]) for key in a] + [
        (f"matched by {MATCHES[c.match]}", str(len(c.pairs)), str(len(c.pairs))),
        ("without a match", str(len(c.only[0])), str(len(c.only[1])))]
    title = f"A = {c.paths[0]}\nB = {c.paths[1]}"
    values = [max([1] + [len(row[k]) for row in rows]) for k in (1, 2)]
    if width - sum(values) - 3 * 3 - 1 < LABEL_MIN:
        return Text("\n".join([title] + [f"{key}: A {x} · B {y}" for key, x, y in rows]))
    table = Table(title=title, title_justify="left")
    table.add_column("", justify="left")
    for name, value_width in zip(("A", "B"), values):
        table.add_column(name, justify="right", no_wrap=True, min_width=value_width)
    for row in rows:
        table.add_row(*row)
    return table


def changes(c: Comparison) -> str:
    """How many matched episodes changed outcome and tokens, and which (episode indices, the first few)."""
    outcome_changed = [p.a.index for p in c.pairs if p.a.success != p.b.success]
    tokens_changed = [p.a.index for p in c.pairs if p.a.digest != p.b.digest]

    def which(indices):
        return f" (episodes {named(indices)})" if indices else ""
    return (f"{plural(len(outcome_changed), 'matched episode')} changed outcome{which(outcome_changed)}, "
            f"{len(tokens_changed)} changed tokens{which(tokens_changed)}")


def unlisted(c: Comparison, rows: list[int]) -> str:
    """The line under the table about the pairs it leaves out: how many, how many of them differ, and which."""
    left = [p for i, p in enumerate(c.pairs) if i >= len(rows)]
    differ = [p.a.index for p in left if p.differs]
    return (f"({plural(len(left), 'more matched episode')}, {len(differ)} of them with differences"
            + (f": episodes {named(differ, 2 * NAMED)}" if differ else "") + "; --all or --episode N lists them)")


def episode_cell(p: Pair) -> str:
    """The pair's episode number: A's, and B's after an arrow when they differ (episodes matched by prompt)."""
    return str(p.a.index) if p.a.index == p.b.index else f"{p.a.index}→{p.b.index}"


def fit_words(text: str, width: int) -> str:
    """``text`` in ``width`` characters: whole, or cut after its last whole word that fits (a trailing comma
    dropped) and ended with …."""
    if len(text) <= width:
        return text
    cut = text[: max(0, width - 1)]
    space = cut.rfind(" ")
    return (cut[:space] if space > 0 else cut).rstrip(",;: ") + "…"


DIFFERS_MIN = 12  # the narrowest "what differs" column the table is drawn with; narrower: one plain line per pair


def pairs_table(c: Comparison, rows: list[int], width: int = 80) -> Table | Text:
    """One line per pair within ``width`` columns: the short cells (episode, seed, A, B) keep their full width and
    "what differs" takes exactly the rest, cut after a whole word with … (the line under the table and --episode
    say all). Too narrow for that: one plain line per pair, cut the same way."""
    cells = [(episode_cell(c.pairs[i]), str(c.pairs[i].a.seed), outcome(c.pairs[i].a), outcome(c.pairs[i].b))
             for i in rows]
    widths = [max([len(name)] + [len(row[k]) for row in cells]) for k, name in enumerate(("episode", "seed", "A", "B"))]
    title = f"matched episodes ({len(rows)} of {len(c.pairs)} listed)"
    differs = width - sum(widths) - 3 * 5 - 1  # 5 columns: 2 spaces of padding and a rule each, and the last rule
    if differs < DIFFERS_MIN:
        lines = [fit_words(title, width)] + [
            fit_words(f"{episode} seed {seed}: A {a} · B {b} · {tokens_state(c.pairs[i])}", width)
            for i, (episode, seed, a, b) in zip(rows, cells)]
        return Text("\n".join(lines))
    table = Table(title=fit_words(title, width), title_justify="left")
    for k, name in enumerate(("episode", "seed", "A", "B")):
        table.add_column(name, no_wrap=True, width=widths[k], justify="right" if k < 2 else "left")
    table.add_column("what differs", no_wrap=True, width=differs)
    for i, (episode, seed, a, b) in zip(rows, cells):
        p = c.pairs[i]
        style = "bold red" if p.a.success and not p.b.success else "bold green" if p.b.success and not p.a.success else ""
        table.add_row(episode, seed, a, Text(b, style=style), fit_words(tokens_state(p), differs))
    return table


def styled_tokens(text: TokenText, traj, start: int, end: int, diverged_from: int | None) -> Text:
    pieces = text.pieces(traj, traj.response_ids[start:end])
    out = Text()
    for k, piece in enumerate(pieces):
        pos = start + k
        base = "black on #9be59b" if traj.spans[pos] == SpanKind.ASSISTANT else "#303030 on #d0d0d0"
        if diverged_from is not None and pos >= diverged_from:
            base += " underline" if pos > diverged_from else " bold reverse"
        out.append(show_whitespace(piece).replace("\n", " "), style=base)
    return out


def pair_view(c: Comparison, i: int, text: TokenText) -> list:
    p = c.pairs[i]
    head = Text(f"episode {episode_cell(p)} (seed {p.a.seed}): A line {p.a.line} {outcome(p.a)} · B line {p.b.line} "
                f"{outcome(p.b)}", style="bold")
    if p.divergence is None:
        return [head, Text("identical token sequences", style="green")]
    d = p.divergence
    turn = p.traj_a.turn_ids[d] if d < len(p.traj_a.turn_ids) else p.traj_b.turn_ids[d]
    start = max(0, d - CONTEXT)
    parts = [head, Text(f"first divergence at response position {d} (turn {turn}); {plural(d, 'token')} in common",
                        style="yellow")]
    for name, traj in (("A", p.traj_a), ("B", p.traj_b)):
        line = Text(f"{name}: " + ("…" if start else ""))
        line.append_text(styled_tokens(text, traj, start, min(len(traj.response_ids), d + AFTER), d))
        if d >= len(traj.response_ids):
            line.append(" [ends here]", style="italic")
        parts.append(line)
    return parts


def render_terminal(c: Comparison, console: Console, tokenizer: str | None, show_all: bool, limit: int) -> None:
    console.print(summary_table(c, console.width))
    console.print(changes(c))
    rows = list(range(len(c.pairs)))[: limit if show_all else TABLE_ROWS]
    detail(c, rows)
    if c.pairs:
        console.print(pairs_table(c, rows, console.width))
        if len(rows) < len(c.pairs):
            console.print(unlisted(c, rows), style="dim")
    text = TokenText(tokenizer)
    for i in c.shown:
        console.rule()
        for part in pair_view(c, i, text):
            console.print(part)


# -- HTML --------------------------------------------------------------------------------------------

def render_html(c: Comparison, tokenizer: str | None, limit: int = 1000) -> str:
    esc = page_html.esc
    a, b = (stats(r) for r in c.summaries)
    summary = ('<table class="runs"><tr><th></th><th>A</th><th>B</th></tr>'
               + "".join(f'<tr><td class="l">{esc(k)}</td><td>{a[k]}</td><td>{b[k]}</td></tr>' for k in a)
               + f'<tr><td class="l">matched by {esc(MATCHES[c.match])}</td><td>{len(c.pairs)}</td><td>{len(c.pairs)}</td></tr>'
               + f'<tr><td class="l">without a match</td><td>{len(c.only[0])}</td><td>{len(c.only[1])}</td></tr></table>')
    detail(c, list(range(min(limit, len(c.pairs)))))
    rows = "".join(
        f'<tr class="pair" data-ep="{p.a.index}"><td>{"<a href=#pair-%d>%d</a>" % (p.a.index, p.a.index) if i in c.shown else p.a.index}'
        f"</td><td>{esc(p.a.seed)}</td><td class=\"{'' if p.a.success else 'err'}\">{esc(outcome(p.a))}</td>"
        f"<td class=\"{'' if p.b.success else 'err'}\">{esc(outcome(p.b))}</td><td class=\"l\">{esc(tokens_state(p))}</td></tr>"
        for i, p in enumerate(c.pairs[:limit]))
    more = (f'<p class="err">{esc(unlisted(c, list(range(limit))))}</p>' if len(c.pairs) > limit else "")
    pairs = more + ('<table class="pairs"><tr><th>episode</th><th>seed</th><th>A</th><th>B</th><th class="l">what differs</th></tr>'
             + rows + "</table>")
    text = TokenText(tokenizer)
    sections = []
    for i in c.shown:
        p = c.pairs[i]
        view = SimpleNamespace(trajectories=[p.traj_a, p.traj_b],
                               pieces=[text.pieces(p.traj_a, p.traj_a.response_ids),
                                       text.pieces(p.traj_b, p.traj_b.response_ids)])
        d = p.divergence
        note = ("identical token sequences" if d is None else
                f"first divergence at response position {d}: {plural(d, 'token')} in common (outlined in red from there)")
        blocks = '<div class="runs">' + "".join(
            f'<div><h3>{name}: line {brief.line} · {esc(outcome(brief))} · finish {esc(brief.finish)}</h3>'
            f'<div class="tokens run-{name}">{page_html.token_html(view, k, 0, len(traj.response_ids), d)}</div></div>'
            for k, (name, brief, traj) in enumerate((("A", p.a, p.traj_a), ("B", p.b, p.traj_b)))) + "</div>"
        sections.append(f'<section class="card pair-view" id="pair-{p.a.index}" data-divergence="{"" if d is None else d}">'
                        f"<h2>episode {p.a.index} (seed {esc(p.a.seed)})</h2><p>{note}</p>{blocks}</section>")
    warnings = "".join(f'<div class="card warn">warning: {esc(m)}</div>' for m in c.problems)
    body = (f'{warnings}<section class="card"><h2>two runs</h2>{summary}<h2>matched episodes</h2>{pairs}</section>'
            + "".join(sections))
    header = f"<h1>agent-loop inspect · A = {esc(c.paths[0])} · B = {esc(c.paths[1])}</h1>"
    return page_html.page(f"agent-loop inspect: {c.paths[0]} vs {c.paths[1]}", header, body,
                          {"compare": False, "names": page_html.NAMES, "rows": []})
