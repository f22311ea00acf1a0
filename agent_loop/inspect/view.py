"""One streaming pass over a rollouts file: the summary of every episode, and the few episodes kept
to be shown (memory grows with those, not with the file). Then what every renderer gets: the kept
episodes with their per-token values (whitened with the whole file's statistics) and text.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

from agent_loop.inspect.choices import INFORMATIVE, LABEL
from agent_loop.inspect.load import Problems, Record, iter_records
from agent_loop.inspect.tokens import TokenText
from agent_loop.inspect.values import BatchValues, FileStats, compute_values, has_recorded_values
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


def has_tool_error(traj: Trajectory) -> bool:
    return any(c.error_kind for c in traj.tool_calls)


@dataclass
class Selection:
    """Which episodes to keep. ``mode``: ``informative`` (a few, chosen for what they show), ``all``
    (in file order, at most ``limit``), ``worst`` (the ``limit`` lowest rewards) or ``ids`` (the
    episodes whose number is in ``ids``). ``failed`` keeps only failures."""

    mode: str = "informative"
    limit: int = INFORMATIVE
    ids: list[int] = field(default_factory=list)
    failed: bool = False
    keep_first: int = 0  # informative mode: also keep the first N matching episodes (for the HTML page)

    def matches(self, traj: Trajectory, eid: int) -> bool:
        if self.failed and traj.success and traj.finish_reason != "error":
            return False
        return self.mode != "ids" or eid in self.ids


class Keeper:
    """Keeps the episodes a :class:`Selection` asks for while the file streams by."""

    def __init__(self, selection: Selection):
        self.selection = selection
        self.kept: list[tuple[Record, int]] = []  # (record, episode id), all/ids modes
        self.heap: list[tuple[float, int, int, Record]] = []  # worst mode: (-reward, -seq, id, record)
        self.picks: dict[str, tuple[tuple, Record, int]] = {}  # informative mode: why -> (rank key, record, id)
        self.seq = 0
        self.first: list[tuple[Record, int]] = []  # informative mode: fill-ins when the picks coincide

    def offer(self, record: Record, eid: int) -> None:
        sel, traj = self.selection, record.trajectory
        self.seq += 1
        if sel.mode in ("all", "ids") or len(self.kept) < sel.keep_first:
            if sel.mode == "informative" or len(self.kept) < sel.limit:
                self.kept.append((record, eid))
        if sel.mode in ("all", "ids"):
            return
        if sel.mode == "worst":
            item = (-traj.reward, -self.seq, eid, record)
            if len(self.heap) < sel.limit:
                heapq.heappush(self.heap, item)
            elif item > self.heap[0]:
                heapq.heapreplace(self.heap, item)
        else:
            if len(self.first) < sel.limit:
                self.first.append((record, eid))
            turns = len(set(traj.turn_ids))
            candidates = {
                "the lowest-reward failure": ((traj.reward, self.seq),) if not traj.success else None,
                "a tool error": ((self.seq,),) if has_tool_error(traj) else None,
                "an unusual finish": ((self.seq,),) if traj.finish_reason != "stop" else None,
                "the success with the most turns": ((-turns, -traj.reward, self.seq),) if traj.success else None,
                "the shortest success": ((len(traj.response_ids), self.seq),) if traj.success else None,
            }
            for why, key in candidates.items():
                if key is not None and (why not in self.picks or key < self.picks[why][0]):
                    self.picks[why] = (key, record, eid)

    def result(self) -> tuple[list[tuple[Record, int, str]], list[int]]:
        """The kept (record, episode id, why shown) in display order, and the indices of those to show
        in the terminal and the PNG (informative mode: the picks; else all)."""
        mode = self.selection.mode
        if mode in ("all", "ids"):
            return [(r, e, "") for r, e in self.kept], list(range(len(self.kept)))
        if mode == "worst":
            kept = [(r, e, "") for _, _, e, r in sorted(self.heap, key=lambda i: (-i[0], -i[1]))]
            return kept, list(range(len(kept)))
        kept = [(r, e, "") for r, e in self.kept]  # keep_first: the page's episodes, in file order
        at = {r.line: i for i, (r, _, _) in enumerate(kept)}
        shown: list[int] = []
        fill = [(None, record, eid) for record, eid in self.first]
        for why, (_, record, eid) in [(w, self.picks[w]) for w in WHY if w in self.picks] + [
                ("one more, from the start of the file", f) for f in fill]:
            if record.line not in at:
                at[record.line] = len(kept)
                kept.append((record, eid, ""))
            i = at[record.line]
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
    kept: list[tuple[Record, int, str]]  # (record, episode id, why shown)
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
        self.episodes += 1
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
    recorded = Recorded()
    for ordinal, record in enumerate(iter_records(path, problems)):
        traj = record.trajectory
        if stats is None:
            resolved, note = resolve_gamma(gamma, traj)
            name, how = resolve_estimator(estimator, traj)
            stats = FileStats(resolved, compare, name)
        trained.add(traj)
        recorded.add(traj)
        eid = episode_id(traj, ordinal)
        summary.add(traj, index=eid)
        if selection.matches(traj, eid):
            matching += 1
            seen_ids.add(eid)
            keeper.offer(record, eid)
        chunk.append(traj)
        if len(chunk) == CHUNK:
            stats.add(chunk)
            chunk = []
    if stats is None:
        stats = FileStats(1.0 if gamma is None else gamma, compare, LABEL.get(estimator, estimator or "carry-through"))
    if chunk:
        stats.add(chunk)
    missing = [i for i in selection.ids if i not in seen_ids] if selection.mode == "ids" else []
    kept, shown = keeper.result()
    note, how = recorded.mixed(note, recorded.gammas, "gamma"), recorded.mixed(how, recorded.estimators, "estimator")
    return Scan(path, summary, matching, stats, kept, shown, problems, note, missing, how,
                trained if trained.episodes else None)


@dataclass
class InspectView:
    """The kept episodes with their values and text; ``selected`` are the rows the terminal and PNG show."""

    source: str
    trajectories: list[Trajectory]
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


def row_values_note(view: InspectView, row: int) -> str:
    """Where one row's returns and advantages come from: the training step's record, or computed here."""
    info = view.trajectories[row].info
    if view.values is not None and view.values.recorded and view.values.recorded[row]:
        lam = f", lam {info['lam']:g}" if isinstance(info.get("lam"), (int, float)) else ""
        return f"as trained at step {info.get('step', '?')}, estimator {info.get('estimator', 'not recorded')}{lam}"
    return f"computed: {view.stats.estimator}, gamma {view.stats.gamma:g}"


def build_view(source, gamma: float = 1.0, tokenizer_dir: str | None = None, selected: list[int] | None = None,
               ids: list[int] | None = None, lines: list[int] | None = None, scanned: Scan | None = None,
               reasons: list[str] | None = None) -> InspectView:
    """Values and token text for ``source``: a :class:`Scan` (its kept episodes) or a list of trajectories."""
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
        trajectories = list(source)
        name, problems = "(trajectories)", []
        summary, stats = RolloutStats(), FileStats(gamma, compare=True)
        for t in trajectories:
            summary.add(t)
        if trajectories:
            stats.add(trajectories)
        trained = Trained()
        for t in trajectories:
            trained.add(t)
        scanned = Scan(Path(name), summary, len(trajectories), stats, [], [], Problems(), "given", [], "given",
                       trained if trained.episodes else None)
    lines = lines or list(range(1, len(trajectories) + 1))
    ids = ids or [episode_id(t, i) for i, t in enumerate(trajectories)]
    text = TokenText(tokenizer_dir)
    return InspectView(
        source=name,
        trajectories=trajectories,
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
