"""Counted by session (issue 54 item 4): a session of several segments (an agent that rewrote its history) is one
episode in the rollout summary and in a step's dropped counts, its segments shown beside."""

from rich.console import Console

from agent_loop.cli.tables import summary_table
from agent_loop.recipes.train import usable_episodes
from agent_loop.runners.stats import RolloutStats
from agent_loop.types import Trajectory

A, O = 1, 2


def record(index: int, segment: int, reward: float, finish: str = "stop", turns: int = 1) -> Trajectory:
    spans = [A, A, O] * turns
    turn_ids = [t for t in range(turns) for _ in range(3)]
    return Trajectory(prompt_ids=[1], response_ids=[5] * len(spans), spans=spans, turn_ids=turn_ids,
                      logprobs=[0.0] * len(spans), messages=[], reward=reward, finish_reason=finish,
                      info={"task": "t", "index": index, "seed": 0, "session_id": f"s{index}", "segment": segment,
                            "success": reward > 0})


def test_the_summary_counts_sessions_and_shows_segments():
    records = [record(0, 0, 1.0, "history_rewrite"), record(0, 1, 1.0, turns=2), record(1, 0, 0.0)]
    stats = RolloutStats()
    for r in records:
        stats.add(r)
    assert (stats.episodes, stats.segments, stats.successes) == (2, 3, 1)
    assert stats.success_rate == 0.5 and stats.mean("reward_sum") == 0.5
    assert stats.mean("turns") == 2.0  # session 0: 1 + 2 turns, session 1: 1 turn
    console = Console(width=100, record=True)
    console.print(summary_table(stats, "rollouts"))
    assert "2 (3 segments)" in console.export_text()


def test_failed_and_lone_episodes_are_counted_by_session():
    # group 0: sessions 0 (2 segments) and 1; group 1: session 2 (2 segments) and session 3, which failed
    records = [record(0, 0, 1.0), record(0, 1, 1.0), record(1, 0, 0.0),
               record(2, 0, 1.0), record(2, 1, 1.0), record(3, 0, 0.0, finish="error")]
    kept, dropped = usable_episodes(records, group_size=2, grouped=True)
    assert dropped == {"episodes/dropped_failed": 1.0, "episodes/dropped_lone": 1.0}  # session 2 is left alone
    assert [(t.info["index"], t.segment) for t in kept] == [(0, 0), (0, 1), (1, 0)]
    # a session's own segments never make a group of two: one session of two segments is still alone
    kept, dropped = usable_episodes(records[:2], group_size=2, grouped=True)
    assert kept == [] and dropped["episodes/dropped_lone"] == 1.0
