"""Per-token values for the views: returns under a named estimator, and REINFORCE++ advantages
whitened with statistics gathered over the whole file in one streaming pass.

The one function the views need from the estimators is :func:`token_values` ``(batch, name, gamma)
-> (b, t)``; ``COMPARED`` names what ``--compare`` puts side by side (docs/design.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import advantages
from agent_loop.inspect.choices import COMPARED, REGISTERED
from agent_loop.inspect.sessions import value_rows
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.types import Trajectory
from masking.batch import collate_rewards
from masking.spans import SpanKind, response_mask_from_spans

DIFFERS = 1e-6  # a return further than this from carry-through counts as different (float noise below)


def token_values(batch, name: str, gamma: float) -> torch.Tensor:
    """(b, t) discounted returns of ``batch["token_level_rewards"]`` under estimator ``name`` (a key
    of COMPARED), with ``batch["spans"]`` telling ASSISTANT from OBSERVATION tokens. A batch with
    ``session``/``segment`` (rows that are segments of sessions) gets each session's returns running across
    its segments (the estimator joins them: ``advantages.sessions``)."""
    if name not in REGISTERED:
        raise ValueError(f"unknown estimator {name!r}; expected one of {sorted(COMPARED)}")
    rewards, spans = batch["token_level_rewards"], batch["spans"]
    mask = response_mask_from_spans(spans, rewards.dtype)
    sessions = {"session": batch["session"], "segment": batch["segment"]} if batch.get("session") is not None else {}
    return advantages.get_estimator(REGISTERED[name])(rewards, mask, spans=spans, gamma=gamma, whiten=False,
                                                      **sessions)[1]


@dataclass
class Moments:
    """Count, mean and sum of squared deviations of a stream of numbers (Chan et al.'s parallel merge, float64)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, values: torch.Tensor) -> None:
        n = values.numel()
        if n == 0:
            return
        values = values.double()
        mean = float(values.mean())
        m2 = float((values - mean).square().sum())
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def var(self) -> float:
        """Bessel-corrected variance (NaN below 2 values), as advantages.masked_var."""
        return self.m2 / (self.count - 1) if self.count > 1 else float("nan")


@dataclass
class EstimatorSummary:
    """How one estimator's returns on a file's ASSISTANT tokens compare with carry-through."""

    name: str
    description: str
    mean_return: float
    differing_tokens: int
    assistant_tokens: int
    mean_abs_diff: float


def reward_tensors(trajectories: list[Trajectory]) -> dict[str, torch.Tensor | list]:
    """Just the (b, t) ``spans`` and ``token_level_rewards`` of :func:`trajectories_to_batch` (the same
    padding and reward placement, ``masking.collate_rewards``, without the prompt and id tensors), and where
    a session has several segments its rows' ``session`` ids and ``segment`` numbers (``trajectories`` as
    :func:`~agent_loop.inspect.sessions.value_rows` gives them)."""
    sessions = ({"sessions": [t.session_id for t in trajectories], "segments": [t.segment for t in trajectories]}
                if any(t.segment for t in trajectories) else {})
    spans, _, rewards = collate_rewards([t.spans for t in trajectories], [t.turn_ids for t in trajectories],
                                        [t.reward for t in trajectories], [t.turn_rewards for t in trajectories],
                                        **sessions)
    return {"spans": spans, "token_level_rewards": rewards,
            **({"session": sessions["sessions"], "segment": sessions["segments"]} if sessions else {})}


@dataclass
class FileStats:
    """What the values of a whole file add up to, gathered chunk by chunk (:meth:`add`)."""

    gamma: float
    compare: bool = False
    estimator: str = "carry-through"  # the COMPARED name whose returns are shown and whitened
    returns: Moments = field(default_factory=Moments)  # ``estimator``'s returns on ASSISTANT tokens
    sums: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum of returns, differing, sum |diff|]

    def add(self, trajectories: list[Trajectory]) -> None:
        """Add whole sessions (every segment of each; a session cut in two would be two)."""
        batch = reward_tensors(value_rows(trajectories))
        assistant = batch["spans"] == SpanKind.ASSISTANT
        compared = COMPARED if self.compare else (self.estimator,)
        returns = {name: token_values(batch, name, self.gamma) for name in {"carry-through", *compared}}
        self.returns.add(returns[self.estimator][assistant])
        if not self.compare:
            return
        carry = returns["carry-through"]
        for name in COMPARED:
            diff = (returns[name] - carry)[assistant]
            acc = self.sums.setdefault(name, [0.0, 0, 0.0])
            acc[0] += float((carry[assistant] + diff).double().sum())
            acc[1] += int((diff.abs() > DIFFERS).sum())
            acc[2] += float(diff.double().abs().sum())

    def summaries(self) -> list[EstimatorSummary]:
        """One summary per estimator of COMPARED (needs ``compare``)."""
        n = self.returns.count
        return [EstimatorSummary(name, description, self.sums[name][0] / n if n else 0.0, self.sums[name][1], n,
                                 self.sums[name][2] / n if n else 0.0)
                for name, description in COMPARED.items()]


@dataclass
class BatchValues:
    """The values of the rows a view shows, as (b, t) CPU tensors (t = longest shown response)."""

    batch: dict[str, torch.Tensor]  # trajectories_to_batch output: responses, spans, turn_ids, old_logprobs, ...
    returns: torch.Tensor  # discounted returns of the shown estimator (carry-through unless --estimator)
    advantages: torch.Tensor  # those returns whitened with the whole file's statistics (REINFORCE++)
    compare: dict[str, torch.Tensor]  # COMPARED name -> discounted returns under that estimator
    gamma: float
    recorded: list[bool] = field(default_factory=list)  # per row: returns/advantages as the trainer recorded them
    # per row: the return at the first ASSISTANT token of the next segment of its session, which the row's end
    # continues from (None: the session's last segment, or the next is not among the rows)
    carried_on: list[float | None] = field(default_factory=list)

    @property
    def token_level_rewards(self) -> torch.Tensor:
        return self.batch["token_level_rewards"]

    def differs(self, name: str) -> torch.Tensor:
        """(b, t) bool: where estimator ``name`` gives another return than carry-through."""
        return (self.compare[name] - self.compare["carry-through"]).abs() > DIFFERS


def compute_values(trajectories: list[Trajectory], gamma: float = 1.0, returns_moments: Moments | None = None,
                   pad_token_id: int = 0, estimator: str = "carry-through") -> BatchValues:
    """Rewards, returns (every estimator) and advantages of ``trajectories``.

    The rows of a session whose agent rewrote its history are its segments: their returns run across
    them (each segment's end continues from the next one's first ASSISTANT token, ``carried_on``), computed
    on the joined session (:func:`~agent_loop.inspect.sessions.value_rows`, ``advantages.sessions``).
    Advantages are ``estimator``'s returns whitened over ASSISTANT tokens, ``(R - mean) /
    sqrt(var + eps)`` as ``advantages.reinforce_plus_plus``; ``returns_moments`` gives the mean and
    variance of the whole file (default: of these trajectories). Too few ASSISTANT tokens in all to
    whiten (``advantages.whitenable``): the advantages are the raw returns.
    """
    rows = value_rows(trajectories)
    batch = trajectories_to_batch(rows, pad_token_id=pad_token_id)
    assistant = batch["spans"] == SpanKind.ASSISTANT
    compare = {name: token_values(batch, name, gamma) for name in COMPARED}
    returns = compare[estimator]
    if returns_moments is None:
        returns_moments = Moments()
        returns_moments.add(returns[assistant])
    if advantages.whitenable(returns_moments.count):
        scale = (returns_moments.var + advantages.WHITEN_EPS) ** -0.5
        advantage = torch.where(assistant, (returns.double() - returns_moments.mean) * scale, 0.0).to(returns.dtype)
    else:
        advantage = returns.clone()
    returns, recorded = returns.clone(), [has_recorded_values(t) for t in trajectories]
    for row, t in enumerate(trajectories):  # one copy per recorded row, not per token
        if recorded[row]:
            n = len(t.response_ids)
            returns[row, :n] = torch.tensor(t.returns, dtype=returns.dtype)
            advantage[row, :n] = torch.tensor(t.advantages, dtype=advantage.dtype)
    return BatchValues(batch, returns, advantage, compare, gamma, recorded, continued_from(rows, returns))


def continued_from(rows: list[Trajectory], returns: torch.Tensor) -> list[float | None]:
    """Per row of :func:`~agent_loop.inspect.sessions.value_rows`: the return at the first ASSISTANT token of
    the next segment of its session (None where there is none among the rows, or it has no ASSISTANT token)."""
    at = {(t.session_id, t.segment): row for row, t in enumerate(rows)}
    out: list[float | None] = []
    for t in rows:
        after = at.get((t.session_id, t.segment + 1))
        first = None if after is None else next(
            (p for p, s in enumerate(rows[after].spans) if s == SpanKind.ASSISTANT), None)
        out.append(None if first is None else float(returns[after, first]))
    return out


def has_recorded_values(traj: Trajectory) -> bool:
    """Whether ``traj`` carries the returns and advantages a training step used on it."""
    return traj.returns is not None and traj.advantages is not None


def carried(values: torch.Tensor, spans: list[int], tail: float | None = None) -> list[tuple[int, int, float]]:
    """The running return held across each OBSERVATION run of one row: ``(start, end, R)`` per run
    [start, end), R being the value at the first ASSISTANT token after the run; after the last one, ``tail``
    (the value the row's session continues from, :attr:`BatchValues.carried_on`), else 0.

    ``values`` are one row's carry-through returns: this R is what the scan carries unchanged through
    the run (docs/design.md section 3). (Reset-at-observation carries 0 instead, by definition.)"""
    out, n, pos = [], len(spans), 0
    while pos < n:
        if spans[pos] != SpanKind.OBSERVATION:
            pos += 1
            continue
        end = pos
        while end < n and spans[end] == SpanKind.OBSERVATION:
            end += 1
        after = next((p for p in range(end, n) if spans[p] == SpanKind.ASSISTANT), None)
        out.append((pos, end, float(values[after]) if after is not None else tail or 0.0))
        pos = end
    return out
