"""What ``agent-loop train`` says about its output folder and its results: a folder in use is reported before
anything else about it (issue 40 item 9)."""

from __future__ import annotations

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
