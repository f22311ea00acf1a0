"""What ``agent-loop train`` says about its output folder and its results: a folder in use is reported before
anything else about it (issue 40 item 9); every success figure names its sampling and episode count, and the
closing line reports the held-out evaluation (issue 40 item 2)."""

from __future__ import annotations

import json

import pytest

from agent_loop.cli import main
from agent_loop.runners.outputs import FOLDER_LOCK, RunLock


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("agent-loop train: error: "), err
    return err[0]


@pytest.mark.parametrize("flags", [["--resume", "{run}"], ["--output-dir", "{run}", "--overwrite"],
                                   ["--output-dir", "{run}"]])
def test_a_folder_whose_run_is_still_going_is_reported_in_use_first(tmp_path, capsys, flags):
    """The first run has written its config and metrics but no checkpoint yet: whatever the second passes
    (--resume, --overwrite or neither), it is told the folder is in use, not advised a flag the lock refuses."""
    run = tmp_path / "R"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 30\n")
    (run / "metrics.jsonl").write_text("")
    with RunLock(run, folder=True):
        assert main(["train", "--steps", "1", *(f.format(run=run) for f in flags)]) == 2
        line = error_line(capsys)
        assert "is in use by another run: pid " in line and "--resume" not in line, line
        assert "not a checkpoint" not in line
        assert sorted(p.name for p in run.iterdir()) == [FOLDER_LOCK, "config.yaml", "metrics.jsonl"]  # untouched
    assert main(["train", "--resume", str(run)]) == 2  # ended: now the true reason
    assert "not a checkpoint" in error_line(capsys)


def test_checking_a_lock_creates_nothing(tmp_path):
    RunLock(tmp_path / "none", folder=True).check_free()
    assert not (tmp_path / "none").exists()
    (tmp_path / "free").mkdir()
    RunLock(tmp_path / "free", folder=True).check_free()
    assert list((tmp_path / "free").iterdir()) == []


def test_train_claims_its_folder_through_the_one_claim(tmp_path, monkeypatch):
    """agent_loop.cli.output_claim (issue 37 item 2): the refusal names the folder as given, braces and all, and
    --overwrite deletes the run's own outputs only."""
    from agent_loop.cli.flags import UsageError
    from agent_loop.cli.train import RUN_OUTPUTS, claim_output
    from agent_loop.recipes.train_options import TrainConfig
    from agent_loop.runners.outputs import HELD_ENV

    monkeypatch.delenv(HELD_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "R{x}"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(UsageError) as refused:
        claim_output(TrainConfig.from_flat(output_dir=str(run)))
    assert str(refused.value) == (f"--output-dir {run}: holds an earlier run (checkpoints, metrics.jsonl, notes.txt); "
                                  f"pass --resume {run} to continue it, --overwrite to replace it, or another --output-dir")
    lock = claim_output(TrainConfig.from_flat(output_dir=str(run), overwrite=True))
    try:
        assert sorted(p.name for p in run.iterdir()) == [FOLDER_LOCK, "notes.txt"] and "checkpoints" in RUN_OUTPUTS
    finally:
        lock.release()
    monkeypatch.setenv("RANK", "1")
    assert claim_output(TrainConfig.from_flat(output_dir=str(run))) is None  # rank 0 holds it


def _record(temperature, success, index=0):
    from agent_loop.types import Trajectory

    info = {"index": index, "success": success, **({} if temperature is None else {"options": {"temperature": temperature}})}
    return Trajectory(prompt_ids=[1], response_ids=[2], spans=[1], turn_ids=[0], logprobs=[-0.1],
                      messages=[], reward=float(success), info=info)


def test_the_rollout_summary_names_the_sampling_and_the_episode_count():
    from rich.console import Console

    from agent_loop.cli.tables import summary_table
    from agent_loop.runners.stats import RolloutStats

    def success_row(records) -> str:
        stats = RolloutStats()
        for record in records:
            stats.add(record)
        console = Console(width=200, record=True)
        console.print(summary_table(stats, "t"))
        return next(line for line in console.export_text().splitlines() if "success rate" in line)

    assert "success rate (sampled at T=0.7, 3 episodes)" in success_row([_record(0.7, i < 2, i) for i in range(3)])
    assert "0.667" in success_row([_record(0.7, i < 2, i) for i in range(3)])
    assert "success rate (greedy, 1 episode)" in success_row([_record(0.0, True)])
    assert "(mixed: greedy 1, sampled at T=1 2, 3 episodes)" in success_row([_record(0.0, 1), _record(1.0, 0), _record(1.0, 1)])
    assert "(sampling not recorded, 1 episode)" in success_row([_record(None, True)])


@pytest.mark.slow
def test_train_names_its_figures_and_closes_with_the_held_out_evaluation(tmp_path, capsys):
    from agent_loop.tiny import tiny_agent_path

    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_agent_path(stage="mid")), "--steps", "2", "--prompts-per-step", "2",
                 "--group-size", "2", "--mini-batches", "1", "--eval-every", "2", "--eval-episodes", "3",
                 "--temperature", "0.9", "--output-dir", str(out), "--no-progress", "--no-tensorboard"]) == 0
    stdout = capsys.readouterr().out
    assert "success: the step's 4 episodes, sampled at T=0.9; eval: 3 held-out episodes, greedy" in stdout
    closing = next(line for line in stdout.splitlines() if line.startswith("trained steps 1-2"))
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before, after = evals[0]["eval/success"], evals[-1]["eval/success"]  # step 0 and step 2, as logged
    assert "success (sampled at T=0.9, 4 episodes a step) " in closing
    assert closing.endswith(f"; held-out success (greedy, 3 episodes) {before:.3f} (step 0) -> {after:.3f} (step 2)")
