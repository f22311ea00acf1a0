"""``train --agent`` with an agent that rewrites its history (issue 54): a session of two segments is one sample.

Each session's reward is fixed by the agent, so the session-level values are known: under RLOO with groups of
two, every ASSISTANT token of every segment of session i gets R_i - R_j (j: the other session of its group), and
under GRPO (R_i - mean) / (std + eps) of the group's two sessions (Bessel-corrected, as verl); and the step counts
sessions (episodes) with their segments beside them.
"""

import json
import statistics

import pytest

from advantages.estimators import GRPO_EPS
from agent_loop import Trainer
from agent_loop.episode.contracts import TaskWrapper
from agent_loop.tasks.registry import get_task
from tests.helpers.summarising_agent import session_reward
from tests.helpers.trainer_config import small_config

pytestmark = pytest.mark.slow

ASSISTANT = 1


def session_value(estimator: str, own: float, other: float) -> float:
    """The session-level advantage of a group of two sessions, serially."""
    if estimator == "rloo":
        return own - other
    return (own - statistics.mean([own, other])) / (statistics.stdev([own, other]) + GRPO_EPS)


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_every_segment_gets_its_sessions_advantage(tiny_mid, tmp_path, estimator):
    config = small_config(tiny_mid, tmp_path, steps=1, estimator=estimator, kl_coef=0.0, group_size=2,
                          prompts_per_step=4, agent="tests/helpers/summarising_agent.py:agent", concurrency=4)
    trainer = Trainer(config)
    metrics = trainer.train_step()
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]

    sessions = {}
    for row in rows:
        sessions.setdefault(row["info"]["session_id"], []).append(row)
    assert len(sessions) == 8 and len(rows) == 12  # 4 of the 8 sessions summarised: two segments each
    assert metrics["segments"] == pytest.approx(12 / 8)
    for segments in sessions.values():
        index = segments[0]["info"]["index"]
        partner = index + 1 if index % 2 == 0 else index - 1  # GroupedTask: episodes 2g and 2g+1 share question g
        expected = session_value(estimator, session_reward(index), session_reward(partner))
        assert [s["info"]["segment"] for s in segments] == list(range(len(segments)))
        assert len(segments) == (2 if index % 2 == 0 else 1)
        for segment in segments:
            assert segment["reward"] == pytest.approx(session_reward(index))
            values = [a for a, span in zip(segment["advantages"], segment["spans"]) if span == ASSISTANT]
            assert values and all(v == pytest.approx(expected, abs=1e-6) for v in values), (index, values[:3], expected)
    assert metrics["reward"] == pytest.approx(sum(session_reward(i) for i in range(8)) / 8)


def test_segment_credit_is_the_row_per_segment_ablation(tiny_mid, tmp_path):
    """``session_credit="segment"`` (``train --session-credit segment``): every segment its own sample carrying its
    session's reward, so RLOO's baseline of a summarised session's segment holds its own other segment (the bias
    of docs/design.md section 3: (R_i - R_j) / 2 where the session-level value is R_i - R_j)."""
    config = small_config(tiny_mid, tmp_path, steps=1, estimator="rloo", kl_coef=0.0, group_size=2,
                          prompts_per_step=4, agent="tests/helpers/summarising_agent.py:agent", concurrency=4,
                          session_credit="segment")
    metrics = Trainer(config).train_step()
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and metrics["segments"] == pytest.approx(12 / 8)  # still counted by session
    groups = {}
    for row in rows:
        groups.setdefault(row["info"]["index"] // 2, []).append(row)
    for members in groups.values():  # serially: each row against the mean of the other rows of its question
        rewards = [session_reward(m["info"]["index"]) for m in members]
        assert len(members) == 3  # session 2g's two segments and session 2g+1's one
        for row, own in zip(members, rewards):
            others = list(rewards)
            others.remove(own)
            expected = own - statistics.mean(others)
            values = [a for a, span in zip(row["advantages"], row["spans"]) if span == ASSISTANT]
            assert values and all(v == pytest.approx(expected, abs=1e-6) for v in values), (values[:3], expected)
            assert row["info"]["session_credit"] == "segment"
        # the bias, in closed form: the summarised session (even index) gets half its session-level value
        split = [row for row in members if row["info"]["index"] % 2 == 0]
        own, other = (session_reward(members[0]["info"]["index"] // 2 * 2 + k) for k in (0, 1))
        assert len(split) == 2 and own != other
        for row in split:
            value = next(a for a, span in zip(row["advantages"], row["spans"]) if span == ASSISTANT)
            assert value == pytest.approx((own - other) / 2, abs=1e-6)


class LookupPaidByIndex(TaskWrapper):
    """``lookup``, each episode paid ``session_reward(index)`` whatever it does: RLOO's values known in advance."""

    def __init__(self):
        super().__init__(get_task("lookup"))

    def reward(self, episode, messages, tool_calls):
        return session_reward(episode.info["index"])


def test_asynchronous_steps_take_a_windowed_session_whole_and_count_sessions(tiny_agent_dir, tmp_path):
    """``--max-staleness 1`` with ``--context window``: the producer files a session of several segments as one
    member of its group, a step takes whole sessions (every segment gets its session's RLOO value, serially), and
    the staleness and episode counts count sessions."""
    config = small_config(str(tiny_agent_dir), tmp_path, steps=3, max_staleness=1, task="lookup", context="window",
                          context_window=1, estimator="rloo", kl_coef=0.0, group_size=2, prompts_per_step=4)
    trainer = Trainer(config, task=LookupPaidByIndex())
    history = trainer.train()
    several = 0
    for step, metrics in enumerate(history, 1):
        rows = [json.loads(line) for line in
                (tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        sessions = {}
        for row in rows:
            if "stale" not in row["info"]:  # a dropped group is written to the file, never trained on
                sessions.setdefault(row["info"]["session_id"], []).append(row)
        assert len(sessions) == 8 and metrics["staleness/k0"] + metrics["staleness/k1"] == 8
        assert metrics["segments"] == pytest.approx(sum(map(len, sessions.values())) / 8)
        groups = {}
        for segments in sessions.values():
            assert sorted(s["info"]["segment"] for s in segments) == list(range(len(segments)))
            index = segments[0]["info"]["index"]
            assert {(s["info"]["index"], s["reward"]) for s in segments} == {(index, session_reward(index))}
            groups.setdefault(segments[0]["info"]["index"] // 2, []).append(segments)
            several += len(segments) > 1
        assert len(groups) == 4 and all(len(members) == 2 for members in groups.values())  # whole groups
        for own, other in (pair for members in groups.values() for pair in (members, members[::-1])):
            expected = own[0]["reward"] - other[0]["reward"]
            for segment in own:
                values = [a for a, span in zip(segment["advantages"], segment["spans"]) if span == ASSISTANT]
                assert values and all(v == pytest.approx(expected, abs=1e-6) for v in values)
    assert several > 0, "no session was rewritten: the window never started a second segment"
    counts = trainer.producer.counts
    waiting = sum(len({t.session_id for t in members}) for members in trainer.producer.groups.finished.values())
    assert counts["taken"] == 3 * 8
    assert counts["finished"] == counts["taken"] + counts["dropped_stale"] + counts["filtered"] + waiting
