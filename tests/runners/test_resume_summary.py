"""The summary a rollout prints says truly which episodes it covers: after ``--resume`` the ones played now,
labelled as the set they are, not as a range they do not fill (issue 40 item 11)."""

from __future__ import annotations

import json

import pytest

from agent_loop.cli import main
from agent_loop.cli.tables import episode_set


def test_episode_sets_are_labelled_as_the_set_they_are():
    assert episode_set(48, 0, 47) == "episodes 0-47"
    assert episode_set(3, 2, 6) == "3 of episodes 2-6"
    assert episode_set(1, 5, 5) == "episode 5"
    assert episode_set(0, None, None) == "0 episodes"


@pytest.mark.slow
def test_the_summary_after_resume_is_labelled_with_the_episodes_it_covers(tiny_agent_dir, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    base = ["rollout", "--model", str(tiny_agent_dir), "--episodes", "6", "--concurrency", "6", "--out", str(out)]
    assert main(base) == 0
    first = capsys.readouterr().out
    assert "rollout: episodes 0-5" in first and "tensors and reinforce_plus_plus (gamma=1.0), episodes 0-5" in first
    lines = out.read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["info"]["index"] not in (1, 4)]  # as if 1 and 4 were lost
    out.write_text("".join(line + "\n" for line in kept))
    assert main(base + ["--resume"]) == 0
    resumed = " ".join(capsys.readouterr().out.split())  # rich may wrap a title
    assert "rollout, played by --resume: 2 of episodes 1-4" in resumed, resumed
    assert "episodes 0-5" not in resumed and "(gamma=1.0), 2 of episodes 1-4" in resumed
    assert "success rate (sampled at T=1, 2 episodes)" in resumed
    assert sorted(json.loads(line)["info"]["index"] for line in out.read_text().splitlines()) == list(range(6))
