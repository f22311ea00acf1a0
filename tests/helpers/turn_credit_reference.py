"""Serial float64 references for the turn-level estimators (advantages/turn_credit.py) and a
builder of span batches from per-turn episode descriptions (issue 47).

An episode is a :class:`Episode`: its group, and per turn the ASSISTANT token ids, the
OBSERVATION token ids before it (empty before turn 0), the turn's reward and its anchor state;
plus an outcome reward (added to the last ASSISTANT token) and trailing PAD. The references work
on the per-turn lists with plain Python loops, written from the formulas in docs/design.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PAD, ASSISTANT, OBSERVATION = 0, 1, 2
WHITEN_EPS = 1e-8


@dataclass
class Episode:
    group: int
    assistant: list[list[int]]  # per turn: its ASSISTANT token ids (at least one)
    observations: list[list[int]]  # per turn: the OBSERVATION token ids before it
    turn_rewards: list[float]
    outcome: float = 0.0
    pad: int = 0
    values: list[float] = field(default_factory=list)  # per turn: V at its first ASSISTANT token
    states: list = field(default_factory=list)  # per turn: the anchor state key (default: the observation)

    def rewards(self) -> list[float]:
        """r_k: the turn's reward, plus the outcome on the last turn."""
        out = list(self.turn_rewards)
        out[-1] += self.outcome
        return out

    def state_keys(self) -> list:
        return self.states or [("prompt",) if k == 0 else tuple(o) for k, o in enumerate(self.observations)]


def build_batch(episodes: list[Episode], width: int | None = None, dtype=torch.float64, noise_values: bool = True):
    """Episodes -> dict of (b, t) tensors: token_level_rewards, response_mask, spans (int8), turn_ids
    (int16, as the loop records them), responses (long), values (V on each turn's first ASSISTANT
    token, noise elsewhere), and index (b,)."""
    rows = []
    for e in episodes:
        spans, turns, tokens, rewards, values = [], [], [], [], []
        for k, (obs, asst) in enumerate(zip(e.observations, e.assistant)):
            spans += [OBSERVATION] * len(obs)
            turns += [k - 1] * len(obs)
            tokens += list(obs)
            rewards += [0.0] * len(obs)
            values += [7.0] * len(obs)
            spans += [ASSISTANT] * len(asst)
            turns += [k] * len(asst)
            tokens += list(asst)
            rewards += [0.0] * (len(asst) - 1) + [e.turn_rewards[k]]
            v = e.values[k] if e.values else 0.0
            values += [v] + [v + 3.0 if noise_values else v] * (len(asst) - 1)
        rewards[max(i for i, s in enumerate(spans) if s == ASSISTANT)] += e.outcome
        spans += [PAD] * e.pad
        turns += [-1] * e.pad
        tokens += [0] * e.pad
        rewards += [0.0] * e.pad
        values += [-5.0] * e.pad
        rows.append((spans, turns, tokens, rewards, values))
    t = max(len(r[0]) for r in rows) if width is None else width
    out = {k: [] for k in ("spans", "turn_ids", "responses", "token_level_rewards", "values")}
    for spans, turns, tokens, rewards, values in rows:
        extra = t - len(spans)
        out["spans"].append(spans + [PAD] * extra)
        out["turn_ids"].append(turns + [-1] * extra)
        out["responses"].append(tokens + [0] * extra)
        out["token_level_rewards"].append(rewards + [0.0] * extra)
        out["values"].append(values + [-5.0] * extra)
    batch = {
        "spans": torch.tensor(out["spans"], dtype=torch.int8),
        "turn_ids": torch.tensor(out["turn_ids"], dtype=torch.int16),
        "responses": torch.tensor(out["responses"], dtype=torch.long),
        "token_level_rewards": torch.tensor(out["token_level_rewards"], dtype=dtype),
        "values": torch.tensor(out["values"], dtype=dtype),
        "index": torch.tensor([e.group for e in episodes]),
    }
    batch["response_mask"] = (batch["spans"] == ASSISTANT).to(dtype)
    return batch


def per_turn(advantages: torch.Tensor, batch: dict, episodes: list[Episode]) -> list[list[float]]:
    """Each turn's advantage read back from the (b, t) tensor, checking it is the same on every
    ASSISTANT token of the turn."""
    out = []
    for row, e in enumerate(episodes):
        turns = []
        for k in range(len(e.assistant)):
            on = (batch["turn_ids"][row].long() == k) & (batch["spans"][row] == ASSISTANT)
            values = advantages[row][on]
            assert torch.all(values == values[0]), (row, k, values)
            turns.append(float(values[0]))
        out.append(turns)
    return out


def ref_returns(rewards: list[float], gamma: float) -> list[float]:
    out, running = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def ref_turn_returns(episodes, gamma, whiten):
    G = [ref_returns(e.rewards(), gamma) for e in episodes]
    if not whiten:
        return G
    tokens = [(g, len(a)) for e, gs in zip(episodes, G) for g, a in zip(gs, e.assistant)]
    n = sum(c for _, c in tokens)
    mean = sum(g * c for g, c in tokens) / n
    var = sum((g - mean) ** 2 * c for g, c in tokens) / (n - 1)
    return [[(g - mean) / math.sqrt(var + WHITEN_EPS) for g in gs] for gs in G]


def ref_turn_rloo(episodes, gamma):
    G = [ref_returns(e.rewards(), gamma) for e in episodes]
    out = []
    for i, e in enumerate(episodes):
        row = []
        for k, g in enumerate(G[i]):
            others = [G[j][k] for j, f in enumerate(episodes) if j != i and f.group == e.group and len(G[j]) > k]
            row.append(g - (sum(others) / len(others) if others else 0.0))
        out.append(row)
    return out


def _grpo_stats(values):
    if len(values) < 2:
        return 0.0, 1.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def ref_turn_index_normalized(episodes, gamma, epsilon=1e-6):
    R = [e.rewards() for e in episodes]
    out = []
    for i, e in enumerate(episodes):
        normalized = []
        for k, r in enumerate(R[i]):
            mean, std = _grpo_stats([R[j][k] for j, f in enumerate(episodes) if f.group == e.group and len(R[j]) > k])
            normalized.append((r - mean) / (std + epsilon))
        out.append(ref_returns(normalized, gamma))
    return out


def ref_gigpo(episodes, w=1.0, mode="mean_norm", gamma=1.0, epsilon=1e-6):
    G = [ref_returns(e.rewards(), gamma) for e in episodes]
    states = [e.state_keys() for e in episodes]
    scores = [sum(e.rewards()) for e in episodes]
    out = []
    for i, e in enumerate(episodes):
        mean, std = _grpo_stats([scores[j] for j, f in enumerate(episodes) if f.group == e.group])
        episode = scores[i] - mean
        if mode == "mean_std_norm":
            episode /= std + epsilon
        row = []
        for k, g in enumerate(G[i]):
            members = [(j, m) for j, f in enumerate(episodes) if f.group == e.group for m in range(len(G[j]))
                       if states[j][m] == states[i][k]]
            others = [G[j][m] for j, m in members if j != i]
            if others:
                baseline, pool = sum(others) / len(others), [G[j][m] for j, m in members]
            else:
                same_turn = [G[j][k] for j, f in enumerate(episodes) if f.group == e.group and len(G[j]) > k]
                rest = [G[j][k] for j, f in enumerate(episodes) if j != i and f.group == e.group and len(G[j]) > k]
                baseline, pool = (sum(rest) / len(rest) if rest else 0.0), same_turn
            step = g - baseline
            if mode == "mean_std_norm":
                if len(pool) < 2:
                    std_step = 1.0
                else:
                    m = sum(pool) / len(pool)
                    std_step = math.sqrt(sum((v - m) ** 2 for v in pool) / (len(pool) - 1))
                step /= std_step + epsilon
            row.append(episode + w * step)
        out.append(row)
    return out


def ref_turn_gae(episodes, gamma, lam):
    out = []
    for e in episodes:
        r, v = e.rewards(), e.values
        adv, running = [0.0] * len(r), 0.0
        for k in reversed(range(len(r))):
            v_next = v[k + 1] if k + 1 < len(r) else 0.0
            running = r[k] + gamma * v_next - v[k] + gamma * lam * running
            adv[k] = running
        out.append(adv)
    return out


def random_episodes(generator, n_groups, group_size, max_turns=4, vocab=6, singleton_group=True):
    """Random episodes: 1..max_turns turns, 1-3 ASSISTANT tokens, 1-3 OBSERVATION tokens drawn from a
    small vocabulary (so observations recur across and within episodes), rewards, values, 0-3 PAD."""
    def rand(n):
        return [int(x) for x in torch.randint(0, n, (1,), generator=generator)][0]

    episodes = []
    sizes = [group_size] * n_groups + ([1] if singleton_group else [])
    for group, size in enumerate(sizes):
        for _ in range(size):
            turns = 1 + rand(max_turns)
            obs = [[]] + [[3 + rand(2)] * (1 + rand(2)) for _ in range(turns - 1)]
            episodes.append(Episode(
                group=group,
                assistant=[[10 + rand(vocab)] * (1 + rand(3)) for _ in range(turns)],
                observations=obs,
                turn_rewards=[float(torch.randn(1, generator=generator).round(decimals=2)) for _ in range(turns)],
                outcome=float(rand(2)),
                pad=rand(4),
                values=[float(torch.randn(1, generator=generator)) for _ in range(turns)],
            ))
    return episodes
