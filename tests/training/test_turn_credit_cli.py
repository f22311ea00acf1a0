"""The turn-level estimators from the command line on the tiny agent (issue 47 item 4): ``agent-loop train --estimator
gigpo`` records each turn's anchor-state group in its step file (checked against a serial grouping by the
observation tokens before each turn), ``agent-loop inspect`` shows the per-turn view of that file, and ``agent-loop
rollout --group-size 2 --estimator gigpo`` shows the estimator's values on the rollout's own groups."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from advantages import get_estimator
from agent_loop.cli import main
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.runners.local import read_trajectories
from masking import SpanKind

A, O = SpanKind.ASSISTANT, SpanKind.OBSERVATION
pytestmark = pytest.mark.slow


def anchor_keys(t) -> list[tuple]:
    """Serial: each assistant turn's anchor state, (question, the observation tokens just before the turn)."""
    turns = sorted({k for s, k in zip(t.spans, t.turn_ids) if s == A})
    before = {k: tuple(i for i, s, j in zip(t.response_ids, t.spans, t.turn_ids) if s == O and j == k - 1) for k in turns}
    return [(t.info["group"], before[k]) for k in turns]


def test_train_gigpo_records_the_anchor_groups_and_inspect_shows_the_turns(tiny_mid, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--model", tiny_mid, "--estimator", "gigpo", "--step-advantage-w", "0.5", "--steps", "1",
                 "--prompts-per-step", "3", "--group-size", "2", "--mini-batches", "1", "--output-dir", str(run),
                 "--no-progress", "--no-tensorboard", "--threads", "1"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    path = run / "rollouts" / "step_000001.jsonl"
    trained = [t for t in read_trajectories(path) if t.info["trained"]]
    assert trained and all(t.info["estimator"] == "gigpo" and t.info["step_advantage_w"] == 0.5 for t in trained)
    keys = [anchor_keys(t) for t in trained]
    visits = Counter((key, row) for row, ks in enumerate(keys) for key in ks)
    ids: dict = {}
    for row, (t, ks) in enumerate(zip(trained, keys)):
        assert len(t.info["anchor_groups"]) == len(ks) == len(t.info["anchor_others"])
        for k, key in enumerate(ks):
            others = sum(n for (key2, r), n in visits.items() if key2 == key and r != row)
            assert t.info["anchor_others"][k] == others, (row, k)
            assert ids.setdefault(key, t.info["anchor_groups"][k]) == t.info["anchor_groups"][k]  # one id per state
        for k in range(len(ks)):  # one advantage per turn
            values = {a for a, s, j in zip(t.advantages, t.spans, t.turn_ids) if s == A and j == k}
            assert len(values) == 1, (row, k, values)
    assert len(set(ids.values())) == len(ids)  # different states, different groups

    assert main(["inspect", str(path), "--all", "--width", "220"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "assistant tokens by their turn's advantage" in shown
    for t in trained:
        assert f"episode {t.info['index']}: per turn (as trained at step 1, estimator gigpo)" in shown
        for k, (group, others) in enumerate(zip(t.info["anchor_groups"], t.info["anchor_others"])):
            label = f"group {group} (alone: turn-index baseline)" if not others else f"group {group} ({others} other"
            advantage = next(a for a, s, j in zip(t.advantages, t.spans, t.turn_ids) if s == A and j == k)
            text = f"{advantage:+.3f}" if advantage else "0"
            assert re.search(rf"│ {k} │ \d+ │ [^│]+ │ [^│]+ │ {re.escape(text)} │ {re.escape(label)}", shown), (k, label)


def test_rollout_shows_a_group_estimator_on_its_own_groups(tiny_mid, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["rollout", "--model", tiny_mid, "--episodes", "6", "--group-size", "3", "--estimator", "gigpo",
                 "--gamma", "0.9", "--out", str(out), "--threads", "1"]) == 0, capsys.readouterr().err
    printed = " ".join(capsys.readouterr().out.split())
    assert "batch tensors and gigpo (gamma=0.9)" in printed
    episodes = sorted(read_trajectories(out), key=lambda t: t.info["index"])
    assert [t.info["group"] for t in episodes] == [0, 0, 0, 1, 1, 1]
    assert episodes[0].messages[0] == episodes[2].messages[0] != episodes[3].messages[0]  # one question per group
    batch = trajectories_to_batch(episodes)
    want, _ = get_estimator("gigpo")(batch.token_level_rewards, batch.response_mask, index=torch.tensor([0, 0, 0, 1, 1, 1]),
                                     spans=batch.spans, responses=batch.responses, gamma=0.9)
    turn0 = want[(batch.spans == A) & (batch.turn_ids == 0)].mean().item()
    shown = re.search(r"mean advantage by turn \(turns 0-\d+, ASSISTANT\) │ ([-\d.]+)", printed).group(1)
    assert float(shown) == pytest.approx(turn0, abs=1e-3)
