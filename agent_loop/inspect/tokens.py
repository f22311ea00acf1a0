"""Token text and the turn layout of an episode, shared by the terminal, HTML and PNG views."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby
from pathlib import Path

from transformers import AutoTokenizer

from agent_loop.types import Trajectory
from masking.spans import SpanKind

SPAN_NAMES = {SpanKind.PAD: "padding", SpanKind.ASSISTANT: "assistant", SpanKind.OBSERVATION: "observation"}


@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """A local tokenizer (``AutoTokenizer.from_pretrained``; never downloads). Raises OSError/ValueError on failure."""
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tokenizer_problem(path: str, error: BaseException, given: bool = False) -> str:
    """The one-line warning when the tokenizer at ``path`` (``given`` by --tokenizer, else the record's
    ``info["model_path"]``) cannot load: what failed, and that ``--tokenizer DIR`` names another."""
    where = "--tokenizer" if given else "the file's info['model_path']"
    relative = "" if given or Path(path).expanduser().is_absolute() else (
        f", a relative path, read from this working directory ({Path.cwd()})")
    return (f"cannot load tokenizer {path} ({type(error).__name__}; {where}{relative}); showing token ids: "
            "give --tokenizer DIR, a local tokenizer folder")


class TokenText:
    """Turns token ids into display text with the tokenizer of each trajectory, or ``[id]`` without one.

    The tokenizer is ``tokenizer_dir`` when given, else ``traj.info["model_path"]``. A tokenizer
    that cannot be loaded adds one message to ``problems`` and its tokens show as ids.
    """

    def __init__(self, tokenizer_dir: str | None = None):
        self.tokenizer_dir = tokenizer_dir
        self.problems: list[str] = []
        self._failed: set[str] = set()

    def tokenizer_for(self, traj: Trajectory):
        path = self.tokenizer_dir or traj.info.get("model_path")
        if not path or path in self._failed:
            return None
        try:
            return load_tokenizer(str(path))
        except (OSError, ValueError) as exc:
            self._failed.add(path)
            self.problems.append(tokenizer_problem(str(path), exc, given=bool(self.tokenizer_dir)))
            return None

    def pieces(self, traj: Trajectory, ids: list[int]) -> list[str]:
        """One display string per id (each token decoded on its own, special tokens kept)."""
        tokenizer = self.tokenizer_for(traj)
        if tokenizer is None:
            return [f"[{i}]" for i in ids]
        return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)

    def text(self, traj: Trajectory, ids: list[int]) -> str:
        """The ids decoded together (for prompts), or the ids themselves without a tokenizer."""
        tokenizer = self.tokenizer_for(traj)
        if tokenizer is None:
            return " ".join(str(i) for i in ids)
        return tokenizer.decode(ids, skip_special_tokens=False)


def versions_note(traj: Trajectory) -> str:
    """The policy versions that sampled the episode's ASSISTANT tokens (``Trajectory.policy_versions``, in the
    trainer's step files): "" when none are recorded, "policy version 3", or "policy versions 3-4 (partial
    rollout: 12 tokens of version 3, 20 of 4)" for an episode that ran across a weight update."""
    counts: dict[int, int] = {}
    for version in traj.policy_versions or ():
        if version >= 0:
            counts[version] = counts.get(version, 0) + 1
    if len(counts) <= 1:
        return "".join(f"policy version {v}" for v in counts)
    parts = [f"{n} tokens of version {v}" if k == 0 else f"{n} of {v}" for k, (v, n) in enumerate(sorted(counts.items()))]
    return f"policy versions {min(counts)}-{max(counts)} (partial rollout: {', '.join(parts)})"


@dataclass
class Segment:
    """A run of consecutive response tokens of one turn and one span kind: positions [start, end)."""

    turn: int
    span: int
    start: int
    end: int

    @property
    def span_name(self) -> str:
        return SPAN_NAMES[SpanKind(self.span)]


def segments(traj: Trajectory) -> list[Segment]:
    """Split the response into runs of equal (turn, span), in order."""
    out, pos = [], 0
    for (turn, span), run in groupby(zip(traj.turn_ids, traj.spans)):
        n = len(list(run))
        out.append(Segment(turn, span, pos, pos + n))
        pos += n
    return out


def turns(traj: Trajectory) -> list[tuple[int, list[Segment]]]:
    """The segments grouped by turn, in order of appearance."""
    return [(turn, list(segs)) for turn, segs in groupby(segments(traj), key=lambda s: s.turn)]


def show_whitespace(text: str) -> str:
    """Make newlines inside a token visible (↵) while keeping the line break."""
    return text.replace("\n", "↵\n")
