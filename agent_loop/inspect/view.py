"""One streaming pass over a rollouts file: the summary of every episode, and the few episodes kept
to be shown (memory grows with those, not with the file). Then what every renderer gets: the kept
episodes with their per-token values (whitened with the whole file's statistics) and text.

An episode is a session (:mod:`~agent_loop.inspect.sessions`): a session whose agent rewrote its history is
chosen, kept and shown whole, its segments in order, one row each, with returns running across them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

from agent_loop.inspect.choices import INFORMATIVE, LABEL
from agent_loop.inspect.load import Problems, Record, iter_records
from agent_loop.inspect.sessions import Session, SessionGrouper, sessions_of
from agent_loop.inspect.tokens import TokenText
from agent_loop.inspect.values import BatchValues, FileStats, compute_values, has_recorded_values
from agent_loop.options import plural
from agent_loop.runners.stats import RolloutStats
from agent_loop.types import Trajectory

CHUNK = 256  # episodes per chunk of the values pass
# what makes an episode worth showing by default, most telling first
WHY = ("the lowest-reward failure", "a tool error", "an unusual finish", "the success with the most turns",
       "the shortest success")


def episode_id(traj: Trajectory, ordinal: int) -> int:
    """An episode's number: ``info["index"]`` as the runner records it, else its order among the good lines."""
    index = traj.info.get("index")
    return index if isinstance(index, int) else ordinal


def has_tool_error(session: Session) -> bool:
    return any(c.error_kind for t in session.trajectories for c in t.tool_calls)


@dataclass
class Selection:
    """Which episodes (sessions, every segment of each) to keep. ``mode``: ``informative`` (a few, chosen
    for what they show), ``all`` (in file order, at most ``limit``), ``worst`` (the ``limit`` lowest
    rewards) or ``ids`` (the episodes whose number is in ``ids``). ``failed`` keeps only failures."""

    mode: str = "informative"
    limit: int = INFORMATIVE
    ids: list[int] = field(default_factory=list)
    failed: bool = False
    keep_first: int = 0  # informative mode: also keep the first N matching episodes (for the HTML page)

    def matches(self, session: Session, eid: int) -> bool:
        if self.failed and session.first.success and session.last.finish_reason != "error":
            return False
        return self.mode != "ids" or eid in self.ids


class Keeper:
    """Keeps the episodes (sessions) a :class:`Selection` asks for while the file streams by."""

    def __init__(self, selection: Selection):
        self.selection = selection
        self.kept: list[tuple[Session, int]] = []  # (session, episode id), all/ids modes
        self.heap: list[tuple[float, int, int, Session]] = []  # worst mode: (-reward, -seq, id, session)
        self.picks: dict[str, tuple[tuple, Session, int]] = {}  # informative mode: why -> (rank key, session, id)
        self.seq = 0
        self.first: list[tuple[Session, int]] = []  # informative mode: fill-ins when the picks coincide

    def offer(self, session: Session, eid: int) -> None:
        sel, traj = self.selection, session.first
        self.seq += 1
        if sel.mode in ("all", "ids") or len(self.kept) < sel.keep_first:
            if sel.mode == "informative" or len(self.kept) < sel.limit:
                self.kept.append((session, eid))
        if sel.mode in ("all", "ids"):
            return
        if sel.mode == "worst":
            item = (-traj.reward, -self.seq, eid, session)
            if len(self.heap) < sel.limit:
                heapq.heappush(self.heap, item)
            elif item > self.heap[0]:
                heapq.heapreplace(self.heap, item)
        else:
            if len(self.first) < sel.limit:
                self.first.append((session, eid))
            turns = session.turns
            candidates = {
                "the lowest-reward failure": ((traj.reward, self.seq),) if not traj.success else None,
                "a tool error": ((self.seq,),) if has_tool_error(session) else None,
                "an unusual finish": ((self.seq,),) if session.last.finish_reason != "stop" else None,
                "the success with the most turns": ((-turns, -traj.reward, self.seq),) if traj.success else None,
                "the shortest success": ((session.tokens, self.seq),) if traj.success else None,
            }
            for why, key in candidates.items():
                if key is not None and (why not in self.picks or key < self.picks[why][0]):
                    self.picks[why] = (key, session, eid)

    def result(self) -> tuple[list[tuple[Session, int, str]], list[int]]:
        """The kept (session, episode id, why shown) in display order, and the indices of those to show
        in the terminal and the PNG (informative mode: the picks; else all)."""
        mode = self.selection.mode
        if mode in ("all", "ids"):  # in file order (a session completes at its last segment)
            kept = sorted(self.kept, key=lambda k: k[0].records[0].line)
            return [(r, e, "") for r, e in kept], list(range(len(kept)))
        if mode == "worst":
            kept = [(r, e, "") for _, _, e, r in sorted(self.heap, key=lambda i: (-i[0], -i[1]))]
            return kept, list(range(len(kept)))
        kept = [(r, e, "") for r, e in self.kept]  # keep_first: the page's episodes, in file order
        at = {r.records[0].line: i for i, (r, _, _) in enumerate(kept)}
        shown: list[int] = []
        fill = [(None, session, eid) for session, eid in self.first]
        for why, (_, session, eid) in [(w, self.picks[w]) for w in WHY if w in self.picks] + [
                ("one more, from the start of the file", f) for f in fill]:
            if session.records[0].line not in at:
                at[session.records[0].line] = len(kept)
                kept.append((session, eid, ""))
            i = at[session.records[0].line]
            if i in shown:
                kept[i] = (kept[i][0], kept[i][1], kept[i][2] + " · " + why)
            elif len(shown) < self.selection.limit:
                shown.append(i)
                kept[i] = (kept[i][0], kept[i][1], why)
        keep = sorted(set(range(len(self.kept))) | set(shown))  # drop picks that lost their place
        renumber = {old: new for new, old in enumerate(keep)}
        return [kept[i] for i in keep], [renumber[i] for i in shown]


@dataclass
class Scan:
    """The outcome of one pass: the summary, the file's value statistics, and the kept episodes."""

    path: Path
    summary: RolloutStats  # every good line of the file
    matching: int  # episodes that pass the selection's filters
    stats: FileStats
    kept: list[tuple[Record, int, str]]  # (record, episode id, why shown): a session's segments in order
    shown: list[int]  # indices into kept for the terminal and the PNG
    problems: Problems
    gamma_note: str  # where the gamma came from
    wanted_ids_missing: list[int]
    estimator_note: str = "default"  # where the estimator of the computed values came from
    trained: "Trained | None" = None  # the episodes that carry a training step's own values


@dataclass
class Trained:
    """What a trainer's step file says about the values it used: how many episodes carry them, at which
    steps, under which estimators (``info["step"]``, ``info["estimator"]``, ``info["lam"]``)."""

    episodes: int = 0
    steps: set = field(default_factory=set)
    estimators: set = field(default_factory=set)
    lams: set = field(default_factory=set)

    def add(self, traj: Trajectory) -> None:
        if not has_recorded_values(traj):
            return
        self.episodes += traj.segment == 0  # a session counts once
        for name, into in (("step", self.steps), ("estimator", self.estimators), ("lam", self.lams)):
            if traj.info.get(name) is not None:
                into.add(traj.info[name])

    def line(self, total: int) -> str:
        """e.g. "as trained at step 2, estimator reinforce_plus_plus (3 of 4 episodes; ...)"."""
        def join(values):
            return ", ".join(map(str, sorted(values, key=str))) or "not recorded"
        step = "step" + ("s" if len(self.steps) > 1 else "")
        lam = f", lam {join(self.lams)}" if self.lams else ""
        rest = "" if self.episodes == total else "; the others were not trained on: their values are computed"
        return (f"as trained at {step} {join(self.steps)}, estimator {join(self.estimators)}{lam} "
                f"({self.episodes} of {total} episodes carry the step's returns and advantages{rest})")


def recorded_gamma(traj: Trajectory) -> float | None:
    """The ``info["gamma"]`` an episode records (``agent-loop rollout``, a trainer's step file), when valid."""
    value = traj.info.get("gamma")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1 else None


def resolve_gamma(given: float | None, first: Trajectory) -> tuple[float, str]:
    """--gamma when given (saying what the file records, when it differs); else the ``info["gamma"]`` the
    file records; else 1.0 (the rollout default)."""
    recorded = recorded_gamma(first)
    if given is not None:
        if recorded is None or recorded == given:
            return given, "--gamma" if recorded is None else "--gamma, as the file records"
        return given, f"--gamma; the file records {recorded:g}"
    if recorded is not None:
        return recorded, "recorded in the file"
    return 1.0, "default; the file records none, set --gamma"


def resolve_estimator(given: str | None, first: Trajectory) -> tuple[str, str]:
    """The COMPARED name of the computed returns: --estimator (a registry name) when given (saying what the
    file records, when it differs); else the ``info["estimator"]`` the file records, when the views can
    compute it; else carry-through."""
    recorded = first.info.get("estimator")
    lam = f", lam {first.info['lam']:g}" if isinstance(first.info.get("lam"), (int, float)) else ""
    if given is not None:
        name = LABEL.get(given, given)
        same = recorded is None or LABEL.get(recorded, recorded) == name
        return name, "--estimator" if same else f"--estimator; the file records {recorded}{lam}"
    if recorded in LABEL:
        return LABEL[recorded], f"recorded in the file{lam}"
    if recorded is not None:
        return "carry-through", (f"the file records {recorded}{lam}, which the views do not compute; "
                                 "carry-through computed, set --estimator")
    return "carry-through", "default; the file records none"


@dataclass
class Recorded:
    """The distinct gammas and estimators the episodes of a file record (a file appended to by runs with
    other settings mixes them; the views compute with one and say so)."""

    gammas: set = field(default_factory=set)
    estimators: set = field(default_factory=set)
    limit: int = 4  # distinct values kept of each

    def add(self, traj: Trajectory) -> None:
        for value, into in ((recorded_gamma(traj), self.gammas), (traj.info.get("estimator"), self.estimators)):
            if value is not None and len(into) < self.limit:
                into.add(value)

    def mixed(self, note: str, values: set, what: str) -> str:
        """``note``, plus what the file mixes when its episodes record more than one value."""
        if len(values) < 2:
            return note
        listed = ", ".join(sorted(f"{v:g}" if isinstance(v, float) else str(v) for v in values))
        more = " ..." if len(values) >= self.limit else ""
        return f"{note}; its episodes record {listed}{more}: one {what} used for all"


def scan(path: str | Path, selection: Selection | None = None, gamma: float | None = None, compare: bool = False,
         problems: Problems | None = None, estimator: str | None = "carry-through") -> Scan:
    """Read ``path`` once: summarise every episode, gather value statistics, keep what ``selection`` asks for.

    ``gamma``/``estimator`` (a COMPARED or registry name) None: what the file's first episode records.
    Raises load.InputError when the file is not JSON Lines (nothing is read past that point).
    """
    path = Path(path)
    selection = selection or Selection()
    problems = problems if problems is not None else Problems()
    summary, keeper, matching = RolloutStats(), Keeper(selection), 0
    stats, note, chunk, seen_ids, trained, how = None, "", [], set(), Trained(), "default"
    recorded, grouper, ordinal = Recorded(), SessionGrouper(), 0

    def take(sessions: list[Session]) -> None:  # each session once it is whole
        nonlocal chunk, matching, ordinal
        for session in sessions:
            if session.problem:
                problems.add(f"{path}:{session.records[0].line}: {session.problem}; its segments' values are "
                             "computed each on its own")
            eid = episode_id(session.first, ordinal)
            ordinal += 1
            for traj in session.counted():
                summary.add(traj, index=eid)
            if selection.matches(session, eid):
                matching += 1
                seen_ids.add(eid)
                keeper.offer(session, eid)
            chunk += session.trajectories
            if len(chunk) >= CHUNK:
                stats.add(chunk)
                chunk = []

    for record in iter_records(path, problems):
        traj = record.trajectory
        if stats is None:
            resolved, note = resolve_gamma(gamma, traj)
            name, how = resolve_estimator(estimator, traj)
            stats = FileStats(resolved, compare, name)
        trained.add(traj)
        recorded.add(traj)
        take(grouper.add(record))
    if stats is None:
        stats = FileStats(1.0 if gamma is None else gamma, compare, LABEL.get(estimator, estimator or "carry-through"))
    take(grouper.flush())
    if chunk:
        stats.add(chunk)
    missing = [i for i in selection.ids if i not in seen_ids] if selection.mode == "ids" else []
    kept, shown = rows_of(*keeper.result())
    note, how = recorded.mixed(note, recorded.gammas, "gamma"), recorded.mixed(how, recorded.estimators, "estimator")
    return Scan(path, summary, matching, stats, kept, shown, problems, note, missing, how,
                trained if trained.episodes else None)


def rows_of(sessions: list[tuple[Session, int, str]], shown: list[int]) -> tuple[list[tuple[Record, int, str]], list[int]]:
    """Kept sessions -> kept rows: every segment of each, in order, with its session's id and reason; the
    shown sessions -> the indices of all their rows."""
    rows, first = [], []
    for session, eid, why in sessions:
        first.append(len(rows))
        rows += [(record, eid, why) for record in session.records]
    return rows, [first[i] + k for i in shown for k in range(len(sessions[i][0].records))]


@dataclass
class InspectView:
    """The kept episodes with their values and text; ``selected`` are the rows the terminal and PNG show."""

    source: str
    trajectories: list[Trajectory]  # a session's segments are consecutive rows, in segment order
    segments: list[int]  # the segments of each row's session (1: an episode of one record)
    lines: list[int]  # 1-based line of each trajectory in the source file
    ids: list[int]  # each trajectory's episode number (info["index"])
    reasons: list[str]  # why each was kept (informative mode), else ""
    values: BatchValues | None  # None when no episode is kept
    pieces: list[list[str]]  # display text of each response token
    prompts: list[str]  # decoded prompt of each trajectory
    selected: list[int]  # row indices to render, in order
    problems: list[str]  # load and tokenizer messages, shown with the view
    summary: RolloutStats
    matching: int
    stats: FileStats
    gamma_note: str = ""
    estimator_note: str = ""
    trained_note: str = ""  # "as trained at step N, estimator E (...)" when episodes carry a step's values

    def episode_count(self, rows: list[int] | None = None) -> int:
        """The episodes (sessions) among ``rows`` (default: all rows)."""
        starts = session_starts(self.trajectories)
        return len(starts) if rows is None else len(set(starts) & set(rows))


def row_values_note(view: InspectView, row: int) -> str:
    """Where one row's returns and advantages come from: the training step's record, or computed here."""
    info = view.trajectories[row].info
    if view.values is not None and view.values.recorded and view.values.recorded[row]:
        lam = f", lam {info['lam']:g}" if isinstance(info.get("lam"), (int, float)) else ""
        return f"as trained at step {info.get('step', '?')}, estimator {info.get('estimator', 'not recorded')}{lam}"
    return f"computed: {view.stats.estimator}, gamma {view.stats.gamma:g}"


def session_starts(trajectories: list[Trajectory]) -> list[int]:
    """The rows where a session starts (a session's segments are consecutive rows, in segment order)."""
    return [k for k, t in enumerate(trajectories) if k == 0 or t.session_id != trajectories[k - 1].session_id
            or t.segment <= trajectories[k - 1].segment]


def session_sizes(trajectories: list[Trajectory]) -> list[int]:
    """Per row: how many rows its session has."""
    starts = session_starts(trajectories)
    return [end - start for start, end in zip(starts, starts[1:] + [len(trajectories)]) for _ in range(start, end)]


def episodes_text(summary: RolloutStats) -> str:
    """``"3 episodes"``, or ``"1 episode (2 segments)"`` where sessions have several segments."""
    segments = f" ({plural(summary.segments, 'segment')})" if summary.segments != summary.episodes else ""
    return plural(summary.episodes, "episode") + segments


def segment_note(view: "InspectView", row: int) -> str:
    """``"segment 1 of 2"`` for a row of a session of several segments, else ""."""
    n = view.segments[row]
    return f"segment {view.trajectories[row].segment} of {n}" if n > 1 else ""


def episode_label(view: "InspectView", row: int) -> str:
    """``"episode 7"``, or ``"episode 7 · segment 1 of 2"`` for a row of a session of several segments."""
    segment = segment_note(view, row)
    return f"episode {view.ids[row]}" + (f" · {segment}" if segment else "")


def carried_on(view: "InspectView", row: int) -> float | None:
    """The return the end of a row continues from (the next segment's first ASSISTANT token's), or None."""
    return view.values.carried_on[row] if view.values is not None and view.values.carried_on else None


def continues_note(view: "InspectView", row: int) -> str:
    """What the end of a segment's returns continues from: the next segment's first ASSISTANT return, or ""."""
    after = carried_on(view, row)
    if after is None:
        return ""
    return (f"returns continue into segment {view.trajectories[row].segment + 1}: "
            f"R = {after:.4g} at its first assistant token")


def build_view(source, gamma: float = 1.0, tokenizer_dir: str | None = None, selected: list[int] | None = None,
               ids: list[int] | None = None, lines: list[int] | None = None, scanned: Scan | None = None,
               reasons: list[str] | None = None) -> InspectView:
    """Values and token text for ``source``: a :class:`Scan` (its kept episodes) or a list of trajectories (each
    session's segments then put together, in segment order: ``ids``/``lines`` given are of that order)."""
    if isinstance(source, Scan):
        scanned = source
        trajectories = [r.trajectory for r, _, _ in source.kept]
        lines = [r.line for r, _, _ in source.kept]
        ids = [e for _, e, _ in source.kept]
        reasons = [w for _, _, w in source.kept]
        gamma = source.stats.gamma
        name, problems = str(source.path), source.problems.lines()
        selected = source.shown if selected is None else selected
    else:
        sessions = sessions_of(source)
        trajectories = [t for session in sessions for t in session.trajectories]
        ids = ids or [episode_id(session.first, k) for k, session in enumerate(sessions) for _ in session.records]
        name, problems = "(trajectories)", [session.problem for session in sessions if session.problem]
        summary, stats = RolloutStats(), FileStats(gamma, compare=True)
        for session in sessions:
            for t in session.counted():
                summary.add(t)
        if trajectories:
            stats.add(trajectories)
        trained = Trained()
        for t in trajectories:
            trained.add(t)
        scanned = Scan(Path(name), summary, len(sessions), stats, [], [], Problems(), "given", [], "given",
                       trained if trained.episodes else None)
    lines = lines or list(range(1, len(trajectories) + 1))
    text = TokenText(tokenizer_dir)
    return InspectView(
        source=name,
        trajectories=trajectories,
        segments=session_sizes(trajectories),
        lines=lines,
        ids=ids,
        reasons=reasons or [""] * len(trajectories),
        values=compute_values(trajectories, gamma, scanned.stats.returns, estimator=scanned.stats.estimator)
        if trajectories else None,
        pieces=[text.pieces(t, t.response_ids) for t in trajectories],
        prompts=[text.text(t, t.prompt_ids) for t in trajectories],
        selected=list(range(len(trajectories))) if selected is None else selected,
        problems=problems + text.problems,
        summary=scanned.summary,
        matching=scanned.matching,
        stats=scanned.stats,
        gamma_note=scanned.gamma_note,
        estimator_note=scanned.estimator_note,
        trained_note=scanned.trained.line(scanned.summary.episodes) if scanned.trained else "",
    )
