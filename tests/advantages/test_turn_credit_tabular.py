"""examples/turn_credit_tabular.py (issue 47 item 5, the tabular case) at tiny sizes: its task, batches and policy
gradients against plain serial float64 references kept here, and its outputs.

The tiny task: 2 moves then STOP within 3 turns, 3 actions (STOP and 2 moves): 15 trajectories, so every ordered
group of G = 2 or 3 episodes can be enumerated and each estimator's expected gradient computed exactly.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.reference_returns import discounted_returns_ref, whiten_ref
from tests.helpers.turn_credit_reference import Episode, ref_gigpo, ref_turn_index_normalized, ref_turn_rloo

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-9


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("turn_credit_tabular", ROOT / "examples" / "turn_credit_tabular.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def task(example):
    return example.Task(moves=2, max_turns=3, actions=3, turn_reward=0.1)


def random_logits(task, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((1, task.states, task.actions), dtype=torch.float64, generator=gen)


def serial_value(task, logits, turn=0, progress=0):
    """(E[sum of rewards], P(solved)) from (turn, progress), by recursion over the actions, from the task's rules:
    the good move is code[progress] (STOP once progress == moves) and earns +r, any other action -r; STOP ends
    the episode (outcome 1 if the lock is open); the episode ends after max_turns turns."""
    if turn == task.max_turns:
        return 0.0, 0.0
    pi = torch.softmax(logits[0, turn * (task.moves + 1) + progress], -1)
    value, solved = 0.0, 0.0
    code = [int(c) for c in task.code]
    for a in range(task.actions):
        is_open = progress == task.moves
        good = a == 0 if is_open else a == code[progress]
        reward = task.turn_reward if good else -task.turn_reward
        if a == 0:
            value = value + pi[a] * (reward + float(is_open))
            solved = solved + pi[a] * float(is_open)
        else:
            v, s = serial_value(task, logits, turn + 1, progress + int(good))
            value, solved = value + pi[a] * (reward + v), solved + pi[a] * s
    return value, solved


def test_exact_values_and_gradient_match_the_serial_recursion(example, task):
    """The enumeration (every trajectory, vectorised log-probabilities) gives the recursion's J, success and grad J."""
    every = example.enumerate_trajectories(task)
    assert every.states.shape[0] == 1 + 2 + 2 * 2 * 3
    logits = random_logits(task, 0).requires_grad_(True)
    got = example.exact(task, logits, every)
    (grad,) = torch.autograd.grad(got["J"].sum(), logits)
    J, solved = serial_value(task, logits)
    (grad_ref,) = torch.autograd.grad(J, logits)
    assert float(got["J"][0].detach()) == pytest.approx(float(J.detach()), abs=TOL)
    assert float(got["success"][0].detach()) == pytest.approx(float(solved.detach()), abs=TOL)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=TOL)
    assert float(grad.abs().max()) > 0.01


def group_enumeration(example, task, logits, G: int):
    """Every ordered group of G trajectories as one batch, and each row's weight P(group) / G."""
    every = example.enumerate_trajectories(task)
    n = every.states.shape[0]
    members = torch.tensor(list(itertools.product(range(n), repeat=G)))
    p = example.log_probs(logits, every, torch.zeros(n, dtype=torch.long)).sum(1).exp()
    weight = p[members].prod(1).repeat_interleave(G) / G
    episodes = every[members.reshape(-1)]
    batch = example.build_batch(episodes, G, torch.Generator().manual_seed(G))
    return episodes, batch, weight


def expected_gradient(example, logits, episodes, advantages, weight):
    """sum_rows weight_row sum_turns A grad log pi, through the example's own policy_loss (it divides by the rows)."""
    leaf = logits.detach().clone().requires_grad_(True)
    scaled = advantages * weight.unsqueeze(1) * advantages.shape[0]
    (g,) = torch.autograd.grad(-example.policy_loss(leaf, episodes, scaled), leaf)
    return g


@pytest.mark.parametrize("G", [2, 3])
def test_expected_gradients_through_the_example_are_exact(example, task, G):
    """By enumeration of every group: turn_rloo's expected gradient is grad J, gigpo's (mean_norm, w = 1) is
    (2 - 1/G) grad J (docs/design.md's bias table), and RFC verl#7244's construction is off every multiple of it."""
    logits = random_logits(task, G)
    every = example.enumerate_trajectories(task)
    leaf = logits.clone().requires_grad_(True)
    (grad_J,) = torch.autograd.grad(example.exact(task, leaf, every)["J"].sum(), leaf)
    episodes, batch, weight = group_enumeration(example, task, logits, G)
    assert float(weight.sum()) == pytest.approx(1.0, abs=1e-12)

    def expected(variant):
        return expected_gradient(example, logits, episodes, example.per_turn_advantages(variant, batch, episodes.valid),
                                 weight)

    torch.testing.assert_close(expected("turn_rloo"), grad_J, rtol=0, atol=TOL)
    torch.testing.assert_close(expected("gigpo"), (2 - 1 / G) * grad_J, rtol=0, atol=TOL)
    biased = expected("turn_index_normalized")
    c = float((biased * grad_J).sum() / (grad_J * grad_J).sum())
    assert float((biased - c * grad_J).abs().max()) > 1e-3


def serial_episodes(task, ep, G: int) -> list[Episode]:
    """The example's episodes as the serial references' Episode descriptions (token layout does not matter to them)."""
    out = []
    for row in range(ep.states.shape[0]):
        L = int(ep.valid[row].sum())
        out.append(Episode(group=row // G, assistant=[[1]] * L, observations=[[]] + [[2]] * (L - 1),
                           turn_rewards=ep.rewards[row, :L].tolist(), outcome=float(ep.outcome[row]),
                           states=ep.states[row, :L].tolist()))
    return out


def serial_grpo(episodes: list[Episode], epsilon: float = 1e-6, by_std: bool = True) -> list[float]:
    """GRPO: (score - group mean) / (Bessel std + epsilon) (without ``by_std``: score - group mean), score = the
    episode's reward sum."""
    scores = [sum(e.rewards()) for e in episodes]
    out = []
    for e, score in zip(episodes, scores):
        group = [s for f, s in zip(episodes, scores) if f.group == e.group]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        out.append((score - mean) / (std + epsilon) if by_std else score - mean)
    return out


def test_one_batch_advantages_and_gradient_match_serial_references(example, task):
    """A sampled batch of two runs: each variant's per-turn advantages (estimated run by run) equal the serial
    references, and the REINFORCE gradient equals sum A (onehot(a) - pi(s)) / rows accumulated turn by turn."""
    G, rows, runs = 3, 9, 2
    gen = torch.Generator().manual_seed(7)
    logits = torch.cat([random_logits(task, 1), random_logits(task, 2)])
    ep = example.sample(task, logits, rows, gen)
    assert bool((ep.valid.sum(1) < task.max_turns).any()) and bool(ep.valid.all(1).any())  # lengths vary
    batch = example.build_batch(ep, G, gen)
    assert bool((batch["spans"] == 2).any()) and bool((batch["spans"][:, -1] == 0).any())  # observations, padding
    for r in range(runs):
        part = slice(r * rows, (r + 1) * rows)
        episodes = serial_episodes(task, ep[part], G)
        rtg = whiten_ref(discounted_returns_ref(batch["token_level_rewards"][part], batch["spans"][part], 1.0),
                         batch["spans"][part])
        references = {
            "turn_rloo": ref_turn_rloo(episodes, 1.0),
            "gigpo": ref_gigpo(episodes, 1.0, "mean_norm"),
            "gigpo_std": ref_gigpo(episodes, 1.0, "mean_std_norm"),
            "turn_index_normalized": ref_turn_index_normalized(episodes, 1.0),
            "grpo": [[a] * len(e.assistant) for a, e in zip(serial_grpo(episodes), episodes)],
            "grpo_mean": [[a] * len(e.assistant) for a, e in zip(serial_grpo(episodes, by_std=False), episodes)],
            "reinforce_plus_plus": [[float(rtg[i, batch["first"][r * rows + i, k]]) for k in range(len(e.assistant))]
                                    for i, e in enumerate(episodes)],
        }
        assert set(references) == set(example.VARIANTS)
        for variant, reference in references.items():
            got = example.run_batches(variant, batch, ep.valid, runs)[part]
            for i, turns in enumerate(reference):
                assert got[i, :len(turns)].tolist() == pytest.approx(turns, abs=TOL), (variant, r, i)
                assert bool((got[i, len(turns):] == 0).all())
    advantages = example.run_batches("gigpo", batch, ep.valid, runs)
    leaf = logits.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(-example.policy_loss(leaf, ep, advantages), leaf)
    serial = torch.zeros_like(logits)
    for row in range(runs * rows):
        for k in range(int(ep.valid[row].sum())):
            s, a, run = int(ep.states[row, k]), int(ep.actions[row, k]), row // rows
            score = -torch.softmax(logits[run, s], -1)
            score[a] += 1.0
            serial[run, s] += float(advantages[row, k]) * score / rows
    torch.testing.assert_close(g, serial, rtol=0, atol=TOL)


def test_the_example_writes_its_table_and_plot(example, tmp_path):
    """A tiny run of two scenarios: every variant's curves have one exact value per step and run, each scenario
    starts at its own start policy (uniform, or the partial warm start), and the page (its command, one table per
    scenario, the plot link) and the PNG are written."""
    argv = ["--moves", "2", "--max-turns", "3", "--actions", "3", "--seeds", "2", "--steps", "4", "--prompts", "2",
            "--group-size", "3", "--variance-batches", "16", "--scenarios", "keydoor", "outcome",
            "--output-dir", str(tmp_path)]
    results = example.main(argv)
    assert list(results) == ["keydoor", "outcome"]
    for scenario, by_variant in results.items():
        setting = example.SCENARIOS[scenario]
        task = example.Task(2, 3, 3, setting.turn_reward)
        every = example.enumerate_trajectories(task)
        start = float(example.exact(task, task.start_logits(1, setting.warm_start), every)["success"][0])
        assert list(by_variant) == list(example.VARIANTS)
        for r in by_variant.values():
            assert r["success"].shape == r["turn_reward"].shape == (5, 2)
            assert float(r["success"][0, 0]) == pytest.approx(start, abs=TOL)
            assert bool(((r["success"] >= 0) & (r["success"] <= 1 + 1e-12)).all())
            assert len(r["noise"]["by_turn"]) == 3 and all(v > 0 for v in r["noise"]["by_turn"])
    assert results["outcome"]["grpo"]["success"][0, 0] > results["keydoor"]["grpo"]["success"][0, 0]  # warm start
    page = (tmp_path / "turn_credit_tabular.md").read_text()
    assert "examples/turn_credit_tabular.py --moves 2" in page and "![curves](turn_credit_tabular.png)" in page
    assert "### keydoor:" in page and "### outcome:" in page and "### dense:" not in page
    assert page.count("| `turn_rloo` | 2/2 |") + page.count("| `turn_rloo` | 1/2 |") + page.count("| `turn_rloo` | 0/2 |") == 2
    assert all(f"| `{variant}` |" in page for variant in example.VARIANTS)
    png = (tmp_path / "turn_credit_tabular.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
