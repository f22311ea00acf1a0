"""``agent-loop train`` writes each step's episodes with the returns and advantages the step used
(``OUTPUT_DIR/rollouts/step_NNNNNN.jsonl``): checked against the values captured from the trainer, and
recomputed from the file alone with its recorded estimator and gamma (the advantages registry)."""

from __future__ import annotations

import json

import pytest
import torch

from advantages import get_estimator
from agent_loop.cli.train import main as train_main
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.tiny import tiny_agent_path
from agent_loop.training.ppo import PPO
from agent_loop.training.rollout_files import keeps, move_aside_after, step_file
from agent_loop.types import Trajectory


@pytest.mark.slow
def test_train_two_steps_leaves_one_file_per_step_with_the_advantages_used(tmp_path, monkeypatch):
    captured = []  # per step: the batch's (advantages, returns) right after scoring
    score = PPO.score

    def recording_score(self, batch, **kwargs):
        metrics = score(self, batch, **kwargs)
        captured.append((batch.advantages.detach().cpu().clone(), batch.returns.detach().cpu().clone()))
        return metrics

    monkeypatch.setattr(PPO, "score", recording_score)
    out = tmp_path / "run"
    status = train_main(["--model", str(tiny_agent_path(stage="mid")), "--steps", "2", "--prompts-per-step", "3",
                         "--group-size", "2", "--mini-batches", "1", "--gamma", "0.9", "--output-dir", str(out),
                         "--no-progress", "--no-tensorboard"])
    assert status == 0
    files = sorted((out / "rollouts").iterdir())
    assert [f.name for f in files] == ["step_000001.jsonl", "step_000002.jsonl"]
    assert len(captured) == 2
    for step, (path, (advantages, returns)) in enumerate(zip(files, captured), start=1):
        episodes = [Trajectory.from_json(line) for line in path.read_text().splitlines()]
        assert len(episodes) == 6 and all(t.info["step"] == step for t in episodes)
        assert {(t.info["gamma"], t.info["estimator"]) for t in episodes} == {(0.9, "reinforce_plus_plus")}
        trained = [t for t in episodes if t.info["trained"]]
        assert all(t.advantages is None and t.returns is None for t in episodes if not t.info["trained"])
        assert len(trained) == advantages.shape[0]
        for row, t in enumerate(trained):  # exact: float32 values written as JSON doubles
            n = len(t.response_ids)
            assert t.advantages == advantages[row, :n].tolist() and t.returns == returns[row, :n].tolist()
            assert not advantages[row, n:].any()  # nothing lost past the response
        # second check: the file alone, through the registry, with the estimator and gamma it records
        batch = trajectories_to_batch(trained)
        want_adv, want_ret = get_estimator(trained[0].info["estimator"])(
            batch.token_level_rewards, batch.response_mask, gamma=trained[0].info["gamma"], spans=batch.spans)
        for row, t in enumerate(trained):
            n = len(t.response_ids)
            torch.testing.assert_close(torch.tensor(t.advantages), want_adv[row, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.tensor(t.returns), want_ret[row, :n], atol=1e-6, rtol=1e-6)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["lr"] > 0 for m in metrics)


def test_keep_every_nth_step_or_none():
    assert [s for s in range(1, 7) if keeps(s, 2)] == [2, 4, 6]
    assert not any(keeps(s, 0) for s in range(1, 7)) and all(keeps(s, 1) for s in range(1, 7))


def test_resume_moves_later_step_files_aside_and_never_deletes_them(tmp_path):
    for step in (1, 2, 3):
        path = step_file(tmp_path, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"step {step}\n")
    step_file(tmp_path, 3).with_name("step_000003.jsonl.interrupted").write_text("older\n")
    with pytest.warns(UserWarning, match="moved 2 step file"):
        moved = move_aside_after(tmp_path, 1)
    assert [p.name for p in moved] == ["step_000002.jsonl.interrupted", "step_000003.jsonl.interrupted-2"]
    assert step_file(tmp_path, 1).read_text() == "step 1\n" and not step_file(tmp_path, 2).exists()
    assert moved[1].read_text() == "step 3\n"
    assert step_file(tmp_path, 3).with_name("step_000003.jsonl.interrupted").read_text() == "older\n"
