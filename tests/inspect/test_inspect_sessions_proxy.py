"""agent-loop inspect on sessions the proxy really recorded (issue 54 item 4): ``rollout --agent`` with an agent that
rewrites its history on even episodes (tests/helpers/summarising_agent.py) on the tiny model, then ``inspect``: one
episode per session, its segments shown in order, its carry-through returns those of the joined session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent_loop.cli.inspect import main
from agent_loop.inspect.values import compute_values
from agent_loop.inspect.view import Selection, build_view, scan
from tests.helpers.summarising_agent import session_reward
from tests.inspect.test_inspect_sessions import GAMMA, serial_session_returns

pytestmark = [pytest.mark.slow, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recorded(tiny_agent_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("proxy_sessions") / "rollouts.jsonl"
    done = subprocess.run([sys.executable, "-m", "agent_loop.cli", "rollout", "--agent",
                           "tests/helpers/summarising_agent.py:agent", "--task", "arithmetic", "--episodes", "4",
                           "--concurrency", "4", "--model", str(tiny_agent_dir), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={
                              "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_inspect_shows_each_recorded_session_whole_with_its_returns_across_segments(recorded, capsys):
    view = build_view(scan(recorded, Selection("all", 100), gamma=GAMMA))
    assert (view.summary.episodes, view.summary.segments) == (4, 6)
    by_episode: dict[int, list] = {}
    for row in view.selected:
        by_episode.setdefault(view.ids[row], []).append(row)
    assert sorted(by_episode) == [0, 1, 2, 3]
    for index, rows in by_episode.items():
        segments = [view.trajectories[r] for r in rows]
        assert rows == list(range(rows[0], rows[0] + len(rows)))  # consecutive, in segment order
        assert [t.segment for t in segments] == list(range(2 if index % 2 == 0 else 1))
        assert all(t.reward == pytest.approx(session_reward(index)) for t in segments)
        reference = serial_session_returns(segments, GAMMA)
        for row, traj, ref in zip(rows, segments, reference):
            assert view.values.returns[row, :len(ref)].tolist() == pytest.approx(ref, abs=1e-6)
        if len(segments) == 2:  # the check bites: segment 0 on its own ends on the reward, joined it is discounted
            alone = compute_values([segments[0]], gamma=GAMMA).returns[0, :len(reference[0])].tolist()
            assert alone != pytest.approx(reference[0], abs=1e-6)
            assert segments[0].finish_reason == "history_rewrite"
    assert main([str(recorded), "--all", "--gamma", "0.9", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert f"{recorded}: 4 episodes (6 segments)" in out
    for index in (0, 2):
        assert (out.index(f"episode {index}: one session of 2 segments") < out.index(f"episode {index} · segment 0 of 2")
                < out.index(f"episode {index} · segment 1 of 2"))
