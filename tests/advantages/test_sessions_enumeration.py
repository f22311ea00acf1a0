"""Proof by exact enumeration for sessions (issue 54 item 2): the policy also decides when to rewrite its
history, and the session-aware estimators' expected gradient is still exactly grad J.

The tree of tests/advantages/test_turn_credit_enumeration.py (a tabular softmax policy, actions STOP, 1
and 2 at each of K turns, per-turn and outcome rewards, observations, padding), read one way more:
action 2 also *rewrites the history*, so the turn after it starts a new segment, a row of its own that
opens with a 1-2 token summary (OBSERVATION). With K = 3 a session has 1 to 3 segments, and how many is
the policy's choice. Every ordered group of G = 2 and 3 sessions is enumerated; the expected estimate
(1/G) sum_i sum_k A_{i,k} grad log pi(a_{i,k} | h_{i,k}) is summed exactly, in float64, against autograd's
grad J to 1e-9. The row-per-segment ablation (every segment its own episode with the session's outcome,
today's treatment) is shown biased.
"""

import pytest
import torch

from advantages import get_estimator
from tests.advantages.test_turn_credit_enumeration import ASSISTANT, OBSERVATION, TOL, Enumeration

REWRITE = 2  # the action after which the history is rewritten (a new segment starts with the next turn)


class Sessions:
    """An :class:`Enumeration`'s rows cut into segments at each rewrite, plus the way back."""

    def __init__(self, e: Enumeration):
        self.e = e
        b = e.batch["spans"].shape[0]
        fields = {k: v.tolist() for k, v in e.batch.items()}
        turn_ids = e.batch["turn_ids"].tolist()
        first = e.first[e.traj].tolist()
        rows, self.where, session, segment = [], [], [], []  # where: per row, its (row, col) in the segment batch
        for i in range(b):
            t = e.tree.trajectories[int(e.traj[i])]
            cuts = [first[i][k + 1] for k in range(len(t) - 1) if t[k] == REWRITE]
            bounds = [0, *cuts, len(fields["spans"][i])]
            turn_base = [0] + [k + 1 for k in range(len(t) - 1) if t[k] == REWRITE]
            place = []
            for j in range(len(bounds) - 1):
                a, z = bounds[j], bounds[j + 1]
                header = 0 if j == 0 else 1 + (i + j) % 2
                row = {name: [0] * header + values[i][a:z] for name, values in fields.items()}
                row["spans"][:header] = [OBSERVATION] * header
                row["responses"][:header] = [30] * header
                row["turn_ids"] = [-1] * header + [x - turn_base[j] if x >= 0 else -1 for x in turn_ids[i][a:z]]
                place += [(len(rows), header + c) for c in range(z - a)]
                rows.append(row)
                session.append(i)
                segment.append(j)
            self.where.append(place)
        width = max(len(r["spans"]) for r in rows)
        self.batch = {}
        for name, value in e.batch.items():
            fill = -1 if name == "turn_ids" else 0
            self.batch[name] = torch.tensor([r[name] + [fill] * (width - len(r[name])) for r in rows], dtype=value.dtype)
        self.session, self.segment = torch.tensor(session), torch.tensor(segment)
        self.index = e.index[self.session]
        self.turn_states = self._split_turn_states(e.turn_states, rows)

    def _split_turn_states(self, states: torch.Tensor, rows) -> torch.Tensor:
        out = torch.full((len(rows), states.shape[1]), -1, dtype=states.dtype)
        for r in range(len(rows)):
            turns = sorted({x for x in self.batch["turn_ids"][r].tolist() if x >= 0})
            base = int(self.segment_turn_base(r))
            for k in turns:
                out[r, k] = states[int(self.session[r]), base + k]
        return out

    def segment_turn_base(self, r: int) -> int:
        """Turns of the earlier segments of row r's session."""
        same = (self.session == self.session[r]) & (self.segment < self.segment[r])
        spans = self.batch["spans"][same]
        assistant = spans == ASSISTANT
        return int((assistant[:, 1:] & ~assistant[:, :-1]).sum() + assistant[:, :1].sum())

    def unsplit(self, advantages: torch.Tensor) -> torch.Tensor:
        """Segment-batch advantages read back into the enumeration's rows (0 on the summaries)."""
        out = torch.zeros_like(self.e.batch["token_level_rewards"])
        for i, place in enumerate(self.where):
            rows, cols = zip(*place)
            out[i, : len(place)] = advantages[list(rows), list(cols)]
        return out

    def call(self, name: str, sessions: bool = True, batch=None, **settings):
        batch = self.batch if batch is None else batch
        entry = get_estimator(name)
        given = {**batch, "index": self.index, "turn_states": self.turn_states}
        fields = {k: v for k, v in given.items() if k in entry.batch_arguments and k not in ("token_level_rewards",
                                                                                             "response_mask")}
        where = {"session": self.session, "segment": self.segment} if sessions else {}
        return entry(batch["token_level_rewards"], batch["response_mask"], **fields, **settings, **where)[0]

    def ablation_batch(self) -> dict:
        """Today's rows: every segment its own episode, carrying the session's outcome on its last ASSISTANT token."""
        batch = dict(self.batch)
        rewards = batch["token_level_rewards"].clone()
        outcome = self.e.tree.outcome[self.e.traj][self.session]
        last = torch.where(batch["spans"] == ASSISTANT, torch.arange(rewards.shape[1]), -1).amax(1)
        count = torch.zeros(int(self.session.max()) + 1, dtype=torch.long).index_add_(0, self.session, torch.ones_like(self.session))
        not_last = self.segment < count[self.session] - 1
        rewards[not_last, last[not_last]] += outcome[not_last]
        batch["token_level_rewards"] = rewards
        return batch


CASES = [(3, 2), (3, 3)]


@pytest.fixture(scope="module", params=CASES, ids=[f"K{k}-G{g}" for k, g in CASES])
def sessions(request):
    return Sessions(Enumeration(*request.param, seed=sum(request.param) + 1))


def _gradient(s: Sessions, advantages: torch.Tensor) -> torch.Tensor:
    return s.e.expected_gradient(s.unsplit(advantages))


def test_the_sessions_have_one_to_three_segments_chosen_by_the_policy(sessions):
    segments = torch.zeros(sessions.e.traj.shape[0], dtype=torch.long).index_add_(0, sessions.session,
                                                                                   torch.ones_like(sessions.session))
    assert set(segments.tolist()) == {1, 2, 3}
    assert float(sessions.e.grad_J[:, REWRITE].abs().max()) > 0.05  # the rewrite's own logit has a gradient


@pytest.mark.parametrize("name,settings,scale", [
    ("rloo", {}, lambda G: 1.0),
    ("turn_rloo", {}, lambda G: 1.0),
    ("turn_returns", {"whiten": False}, lambda G: 1.0),
    ("reinforce_plus_plus", {"whiten": False}, lambda G: 1.0),
    ("turn_gae", {"gamma": 1.0, "lam": 1.0}, lambda G: 1.0),
    ("grpo", {"norm_adv_by_std_in_grpo": False}, lambda G: 1.0 - 1.0 / G),
    ("gigpo", {"step_advantage_w": 0.5}, lambda G: 1.0 - 1.0 / G + 0.5),
])
def test_session_aware_estimators_are_exact(sessions, name, settings, scale):
    got = _gradient(sessions, sessions.call(name, **settings))
    torch.testing.assert_close(got, scale(sessions.e.G) * sessions.e.grad_J, rtol=0, atol=TOL)


@pytest.mark.parametrize("name,settings", [("rloo", {}), ("turn_rloo", {}), ("gigpo", {"step_advantage_w": 0.5})])
def test_the_row_per_segment_ablation_is_biased(sessions, name, settings):
    scale = {"rloo": 1.0, "turn_rloo": 1.0, "gigpo": 1.0 - 1.0 / sessions.e.G + 0.5}[name]
    got = _gradient(sessions, sessions.call(name, sessions=False, batch=sessions.ablation_batch(), **settings))
    assert float((got - scale * sessions.e.grad_J).abs().max()) > 1e-3
