"""Proof by exact enumeration (issue 47 item 2): the expected policy gradient of every turn-level
estimator, summed over every trajectory and every group of G = 2 and G = 3 episodes, against the
exact grad J (autograd of J = sum over trajectories of P(tau) R(tau)), in float64 to 1e-9.

The environment: a tabular softmax policy over a tree of depth K (2 to 4 turns). At each turn the
policy picks one of 3 actions, STOP (0) or 1 or 2, from logits of its whole history (a tree
node), so the policy controls the episode's length; after K turns the episode ends anyway. Each
(node, action) has a per-turn reward and every trajectory an outcome reward. Turn k's ASSISTANT
tokens depend on its action (1 to 3 tokens); the OBSERVATION before turn k depends on the previous
action only (random lengths 1 to 3), so anchor states recur across histories, across turn indices
and within one episode; rows end in 1 or 2 PAD tokens and are padded to one width.

For a group (tau_1, .., tau_G) with probability prod P(tau_i), the estimate of grad J is
(1/G) sum_i sum_k A_{i,k} grad log pi(a_{i,k} | h_{i,k}); with tabular softmax logits
grad_theta[h] log pi(a | h) = onehot(a) - pi(. | h). Its expectation is summed exactly.
"""

import itertools

import pytest
import torch

from advantages import gigpo, grpo, rloo, turn_gae, turn_index_normalized, turn_returns, turn_rloo

PAD, ASSISTANT, OBSERVATION = 0, 1, 2
STOP, ACTIONS = 0, 3
TOL = 1e-9


class Tree:
    """Tabular softmax policy over histories of a depth-``turns`` tree, with rewards and token layouts."""

    def __init__(self, turns: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.turns = turns
        # nodes: histories of non-STOP actions, length 0..turns-1
        self.nodes = [h for d in range(turns) for h in itertools.product((1, 2), repeat=d)]
        self.node_id = {h: i for i, h in enumerate(self.nodes)}
        self.logits = torch.randn(len(self.nodes), ACTIONS, dtype=torch.float64, generator=gen)
        self.turn_reward = torch.randn(len(self.nodes), ACTIONS, dtype=torch.float64, generator=gen).round(decimals=2)
        self.values = torch.randn(len(self.nodes), dtype=torch.float64, generator=gen)  # an arbitrary critic
        self.assistant_len = torch.randint(1, 4, (ACTIONS,), generator=gen).tolist()
        self.observation_len = torch.randint(1, 4, (ACTIONS,), generator=gen).tolist()
        # STOP before the last turn, or any action at the last turn (the episode ends there anyway)
        self.trajectories = [h + (STOP,) for length in range(1, turns) for h in itertools.product((1, 2), repeat=length - 1)]
        self.trajectories += [h + (a,) for h in itertools.product((1, 2), repeat=turns - 1) for a in range(ACTIONS)]
        self.outcome = torch.randint(0, 3, (len(self.trajectories),), generator=gen).double()
        self.pad = torch.randint(1, 3, (len(self.trajectories),), generator=gen).tolist()

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """P(tau) of every trajectory (differentiable in ``logits``)."""
        log_pi = torch.log_softmax(logits, -1)
        return torch.stack([
            sum(log_pi[self.node_id[t[:k]], a] for k, a in enumerate(t)).exp() for t in self.trajectories])

    def returns(self) -> torch.Tensor:
        """R(tau): the per-turn rewards plus the outcome."""
        return torch.stack([
            sum(self.turn_reward[self.node_id[t[:k]], a] for k, a in enumerate(t)) + self.outcome[i]
            for i, t in enumerate(self.trajectories)])

    def exact_values(self) -> torch.Tensor:
        """V^pi(h) = E[sum of the rewards from h on | h] (serial, over the trajectories through h)."""
        P = self.probabilities(self.logits).detach()
        num = torch.zeros(len(self.nodes), dtype=torch.float64)
        den = torch.zeros(len(self.nodes), dtype=torch.float64)
        for i, t in enumerate(self.trajectories):
            rewards = [float(self.turn_reward[self.node_id[t[:k]], a]) for k, a in enumerate(t)]
            rewards[-1] += float(self.outcome[i])
            for k in range(len(t)):
                node = self.node_id[t[:k]]
                num[node] += P[i] * sum(rewards[k:])
                den[node] += P[i]
        return num / den

    def rows(self, values: torch.Tensor):
        """Per trajectory: one padded row of every batch field, and per turn its node, action and first token."""
        rows = []
        for i, t in enumerate(self.trajectories):
            spans, turn_ids, tokens, rewards, vals, first = [], [], [], [], [], []
            for k, a in enumerate(t):
                node = self.node_id[t[:k]]
                if k:
                    n = self.observation_len[t[k - 1]]
                    spans += [OBSERVATION] * n
                    turn_ids += [k - 1] * n
                    tokens += [20 + t[k - 1]] * n
                    rewards += [0.0] * n
                    vals += [9.0] * n
                first.append(len(spans))
                n = self.assistant_len[a]
                spans += [ASSISTANT] * n
                turn_ids += [k] * n
                tokens += [10 + a] * n
                rewards += [0.0] * (n - 1) + [float(self.turn_reward[node, a])]
                vals += [float(values[node])] + [-3.0] * (n - 1)  # only the first token's value is read
            rewards[-1] += float(self.outcome[i])
            spans += [PAD] * self.pad[i]
            turn_ids += [-1] * self.pad[i]
            tokens += [0] * self.pad[i]
            rewards += [0.0] * self.pad[i]
            vals += [0.0] * self.pad[i]
            rows.append((spans, turn_ids, tokens, rewards, vals, first))
        width = max(len(r[0]) for r in rows)

        def padded(j, dtype):
            return torch.tensor([r[j] + [0] * (width - len(r[j])) for r in rows], dtype=dtype)

        fields = {
            "spans": padded(0, torch.int8),
            "turn_ids": torch.tensor([r[1] + [-1] * (width - len(r[1])) for r in rows], dtype=torch.int16),
            "responses": padded(2, torch.long),
            "token_level_rewards": padded(3, torch.float64),
            "values": padded(4, torch.float64),
        }
        fields["response_mask"] = (fields["spans"] == ASSISTANT).double()
        K = self.turns
        node = torch.tensor([[self.node_id[t[:k]] if k < len(t) else 0 for k in range(K)] for t in self.trajectories])
        action = torch.tensor([[t[k] if k < len(t) else 0 for k in range(K)] for t in self.trajectories])
        first = torch.tensor([r[5] + [0] * (K - len(r[5])) for r in rows])
        valid = torch.tensor([[k < len(t) for k in range(K)] for t in self.trajectories])
        return fields, node, action, first, valid


class Enumeration:
    """Every ordered group of ``group_size`` trajectories, as one batch (row = group * G + member)."""

    def __init__(self, turns: int, group_size: int, seed: int = 0, values: str = "arbitrary"):
        self.tree = tree = Tree(turns, seed)
        logits = tree.logits.clone().requires_grad_(True)
        P = tree.probabilities(logits)
        (self.grad_J,) = torch.autograd.grad((P * tree.returns()).sum(), logits)
        self.pi = torch.softmax(tree.logits, -1)
        P = P.detach()
        self.G = group_size
        n = len(tree.trajectories)
        members = torch.tensor(list(itertools.product(range(n), repeat=group_size)))  # (groups, G)
        self.weight = P[members].prod(1).repeat_interleave(group_size) / group_size  # P(group) / G per row
        self.traj = members.reshape(-1)
        self.index = torch.arange(members.shape[0]).repeat_interleave(group_size)
        self.values_table = {"arbitrary": tree.values, "exact": tree.exact_values()}
        fields, self.node, self.action, self.first, self.valid = tree.rows(self.values_table[values])
        self.batch = {k: v[self.traj] for k, v in fields.items()}
        self.turn_states = torch.where(self.valid, self.node, -1)[self.traj]  # the exact history as the state

    def expected_gradient(self, advantages: torch.Tensor) -> torch.Tensor:
        """sum over groups of P(group) (1/G) sum_i sum_k A_{i,k} (onehot(a_{i,k}) - pi(. | h_{i,k}))."""
        rows = torch.arange(advantages.shape[0]).unsqueeze(1)
        first, valid = self.first[self.traj], self.valid[self.traj]
        A = torch.where(valid, advantages[rows, first], 0.0)
        spans, turn_ids = self.batch["spans"], self.batch["turn_ids"].long()
        # every ASSISTANT token of a turn carries the turn's advantage (the loss sums their log-probs)
        on = spans == ASSISTANT
        assert torch.equal(advantages[on], A.gather(1, turn_ids.clamp(min=0))[on])
        assert bool((advantages[~on] == 0).all())
        node, action = self.node[self.traj], self.action[self.traj]
        score = torch.nn.functional.one_hot(action, ACTIONS).double() - self.pi[node]
        contribution = (self.weight.unsqueeze(1) * A).unsqueeze(-1) * score
        return torch.zeros_like(self.pi).index_add_(0, node.reshape(-1), contribution.reshape(-1, ACTIONS))

    def call(self, fn, *args, **kwargs):
        b = self.batch
        return fn(b["token_level_rewards"], b["response_mask"], *args, spans=b["spans"], turn_ids=b["turn_ids"], **kwargs)[0]


CASES = [(2, 2), (2, 3), (3, 2), (3, 3), (4, 2), (4, 3)]


@pytest.fixture(scope="module", params=CASES, ids=[f"K{k}-G{g}" for k, g in CASES])
def enumeration(request):
    return Enumeration(*request.param, seed=sum(request.param))


def _assert_scaled(expected, grad_J, scale):
    torch.testing.assert_close(expected, scale * grad_J, rtol=0, atol=TOL)


def test_the_enumeration_is_exact_and_nontrivial(enumeration):
    """The harness itself: RLOO (outcome) is unbiased; grad J is not ~0; groups and lengths vary."""
    e = enumeration
    assert float(e.weight.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float(e.grad_J.abs().max()) > 0.05
    _assert_scaled(e.expected_gradient(rloo(e.batch["token_level_rewards"], e.batch["response_mask"], e.index,
                                            spans=e.batch["spans"])[0]), e.grad_J, 1.0)
    assert len({len(t) for t in e.tree.trajectories}) == e.tree.turns


def test_unbiased_turn_estimators(enumeration):
    """turn_rloo and per-turn REINFORCE (turn_returns unwhitened) are exactly unbiased; mean-only GRPO
    (the mean includes the episode itself) is unbiased up to exactly (1 - 1/G)."""
    e = enumeration
    _assert_scaled(e.expected_gradient(e.call(turn_rloo, e.index)), e.grad_J, 1.0)
    _assert_scaled(e.expected_gradient(e.call(turn_returns, whiten=False)), e.grad_J, 1.0)
    mean_only = grpo(e.batch["token_level_rewards"], e.batch["response_mask"], e.index,
                     norm_adv_by_std_in_grpo=False, spans=e.batch["spans"])[0]
    _assert_scaled(e.expected_gradient(mean_only), e.grad_J, 1.0 - 1.0 / e.G)


@pytest.mark.parametrize("w", [0.0, 1.0, 0.5])
def test_gigpo_mean_norm_is_unbiased_up_to_its_constant(enumeration, w):
    """gigpo (mean_norm) = mean-only GRPO + w * a step part with a leave-one-out anchor baseline:
    expected gradient (1 - 1/G + w) grad J, with the observations as the anchor states (shared
    across histories and turn indices, revisited within episodes) and with the exact histories."""
    e = enumeration
    b = e.batch
    by_observation = e.call(gigpo, e.index, w, responses=b["responses"])
    _assert_scaled(e.expected_gradient(by_observation), e.grad_J, 1.0 - 1.0 / e.G + w)
    by_history = e.call(gigpo, e.index, w, turn_states=e.turn_states)
    _assert_scaled(e.expected_gradient(by_history), e.grad_J, 1.0 - 1.0 / e.G + w)


def test_gigpo_baseline_including_own_revisits_would_be_biased(enumeration):
    """Why the step baseline excludes the episode's own turns: verl-agent's construction (the set's
    mean, the turn itself and its own revisits included) does not give c * grad J for any c."""
    e = enumeration
    b = e.batch
    own = e.call(gigpo, e.index, 1.0, responses=b["responses"])
    step = own - e.call(gigpo, e.index, 0.0, responses=b["responses"])
    # rebuild verl-agent's step part from the same sets: G - mean over the whole (group, state) set
    from advantages.turn_credit import gigpo_anchor_groups
    sets, _ = gigpo_anchor_groups(b["response_mask"], e.index, spans=b["spans"], turn_ids=b["turn_ids"], responses=b["responses"])
    G = e.call(turn_returns, whiten=False)
    rows = torch.arange(G.shape[0]).unsqueeze(1)
    first, valid = e.first[e.traj], e.valid[e.traj]
    g = torch.where(valid, G[rows, first], 0.0).reshape(-1)
    ids = torch.where(valid.reshape(-1), sets.reshape(-1), sets.max() + 1)
    w = valid.reshape(-1).double()
    total = torch.zeros(int(ids.max()) + 1, dtype=torch.float64).index_add_(0, ids, g * w)
    count = torch.zeros_like(total).index_add_(0, ids, w)
    verl_agent = (g - (total / count.clamp(min=1))[ids]).reshape(valid.shape)
    tokens = torch.where(b["spans"] == ASSISTANT, verl_agent.gather(1, b["turn_ids"].long().clamp(min=0)), 0.0)
    biased = e.expected_gradient(tokens)
    unbiased = e.expected_gradient(step)
    _assert_scaled(unbiased, e.grad_J, 1.0)
    c = float((biased * e.grad_J).sum() / (e.grad_J * e.grad_J).sum())
    assert float((biased - c * e.grad_J).abs().max()) > 1e-3


def test_turn_gae_unbiased_with_lam_one_or_the_true_values():
    """lam = 1: A_k = G_k - V(h_k), a state baseline: unbiased for any critic. lam < 1: unbiased with
    the true values V^pi, biased with an arbitrary critic."""
    for turns, G in ((3, 2), (4, 2)):
        arbitrary = Enumeration(turns, G, seed=turns, values="arbitrary")
        exact = Enumeration(turns, G, seed=turns, values="exact")
        for e, lam, unbiased in ((arbitrary, 1.0, True), (exact, 0.5, True), (exact, 0.0, True), (arbitrary, 0.5, False)):
            got = e.expected_gradient(turn_gae(e.batch["token_level_rewards"], e.batch["values"], e.batch["response_mask"],
                                               1.0, lam, spans=e.batch["spans"], turn_ids=e.batch["turn_ids"])[0])
            if unbiased:
                _assert_scaled(got, e.grad_J, 1.0)
            else:
                assert float((got - e.grad_J).abs().max()) > 1e-3


def test_turn_index_normalization_is_biased_on_the_stop_logits(enumeration):
    """RFC verl#7244: normalising per turn index and summing subtracts as many means as the episode
    has turns, a baseline that depends on the action STOP. No scale c makes its expected gradient
    c * grad J, and the error sits on the STOP decisions: at the root, the STOP logit's component
    is off, while turn_rloo (the fix) is exact there."""
    e = enumeration
    got = e.expected_gradient(e.call(turn_index_normalized, e.index))
    c = float((got * e.grad_J).sum() / (e.grad_J * e.grad_J).sum())
    error = got - c * e.grad_J
    assert float(error.abs().max()) > 1e-3
    root = e.tree.node_id[()]
    assert abs(float(error[root, STOP])) > 1e-4
    fixed = e.expected_gradient(e.call(turn_rloo, e.index))
    assert abs(float(fixed[root, STOP] - e.grad_J[root, STOP])) < TOL


def test_mean_std_norm_variants_are_not_unbiased(enumeration):
    """Dividing by a group std (GRPO, gigpo mean_std_norm) gives no constant multiple of grad J:
    the documented bias of std normalisation (Dr. GRPO, arXiv:2503.20783)."""
    e = enumeration
    got = e.expected_gradient(e.call(gigpo, e.index, 1.0, "mean_std_norm", responses=e.batch["responses"]))
    c = float((got * e.grad_J).sum() / (e.grad_J * e.grad_J).sum())
    assert float((got - c * e.grad_J).abs().max()) > 1e-4
