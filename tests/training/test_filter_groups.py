"""Dynamic sampling (``train --filter-groups``, agent_loop/runners/group_filter.py; issue 57 item 1).

The selection on its own: a group is judged on its sessions' raw outcomes (``Trajectory.success``), never on
the shaped reward: equal shaped rewards with mixed outcomes are kept, equal outcomes with different shaped
rewards are dropped; a session split into segments counts once; ``GroupSelection`` against a plain serial
account of random groups (kept, set aside, rounds, the bound). Bad flag values are refused in one line.

The real thing, on the tiny agent with a task whose reward is shaped apart from its outcome: synchronous steps
train on exactly the first ``prompts_per_step`` mixed groups of whole rounds of fresh questions (the batch
held; the question stream goes on without a question twice, across a resume too); a run whose every group
fails reports the bound (``filter_groups/bound_hit``) and skips the step; ``--agent`` sessions split into two
segments are judged as one member each; asynchronous steps (``--max-staleness 1``) keep only mixed groups, hold
the batch, lose no episode, and report the bound the same way.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict

import pytest

from agent_loop import Trainer
from agent_loop.cli import main
from agent_loop.cli.flags import UsageError
from agent_loop.cli.train import options_from
from agent_loop.episode.contracts import Task
from agent_loop.runners.group_filter import GroupSelection, outcome_kind, session_outcomes
from agent_loop.runners.local import read_trajectories
from agent_loop.runners.producer import oldest_version
from agent_loop.tasks.registry import get_task
from agent_loop.training.checkpoint import load_state, step_folder
from agent_loop.training.rollout_files import step_file
from agent_loop.types import Trajectory
from masking import SpanKind
from tests.helpers.async_training import small_config

A = int(SpanKind.ASSISTANT)


def record(index: int, *, success: bool, reward: float, group: int = 0, session: str | None = None,
           segment: int = 0, finish: str = "stop") -> Trajectory:
    """One row of a group: a one-token response, its shaped ``reward`` and the task's judgement ``success``."""
    info = {"task": "t", "seed": 0, "index": index, "group": group, "success": success, "segment": segment}
    if session is not None:
        info["session_id"] = session
    return Trajectory(prompt_ids=[1], response_ids=[2], spans=[A], turn_ids=[0], logprobs=[-0.5], messages=[],
                      reward=reward, finish_reason=finish, info=info)


# -- the selection on its own ------------------------------------------------------------------------------------


def test_equal_shaped_rewards_with_mixed_outcomes_are_kept():
    group = [record(0, success=True, reward=0.5), record(1, success=False, reward=0.5),
             record(2, success=False, reward=0.5)]
    assert outcome_kind(group) == "mixed"
    selection = GroupSelection(wanted=1, max_rounds=0)
    assert selection.offer(group) and selection.kept == [group] and selection.done
    assert selection.metrics()["filter_groups/bound_hit"] == 0.0


@pytest.mark.parametrize("success, kind", [(True, "all_success"), (False, "all_failed")])
def test_equal_outcomes_with_different_shaped_rewards_are_dropped(success, kind):
    group = [record(i, success=success, reward=r) for i, r in enumerate((0.1, 0.9, -0.3))]
    assert len({t.reward for t in group}) == 3 and outcome_kind(group) == kind
    selection = GroupSelection(wanted=1, max_rounds=0)
    assert not selection.offer(group)
    assert selection.kept == [] and selection.set_aside == group
    assert {t.info["filtered"] for t in group} == {kind}
    assert selection.metrics()["filter_groups/bound_hit"] == 1.0  # one group examined: the bound of 0 rounds


def test_a_session_split_into_segments_counts_once():
    # session a: 3 segments (the agent rewrote its history), a success; session b: one segment, a failure
    two_sessions = [record(0, success=True, reward=1.0, session="a", segment=s) for s in (2, 0, 1)]
    two_sessions.append(record(1, success=False, reward=0.0, session="b"))
    assert session_outcomes(two_sessions) == [True, False] and outcome_kind(two_sessions) == "mixed"
    # one session in three rows is one member: no variance to learn from, whatever a per-row count would say
    one_session = [record(0, success=s == 2, reward=1.0, session="a", segment=s) for s in range(3)]
    assert session_outcomes(one_session) == [True] and outcome_kind(one_session) == "too_few"
    # a failed session has no outcome: the survivor alone is too few
    failed = [record(0, success=True, reward=1.0), record(1, success=False, reward=0.0, finish="error")]
    assert session_outcomes(failed) == [True] and outcome_kind(failed) == "too_few"
    # kept groups come back in episode order, segments in order
    selection = GroupSelection(wanted=1, max_rounds=0)
    assert selection.offer(two_sessions)
    assert [(t.info["index"], t.segment) for t in selection.trajectories()] == [(0, 0), (0, 1), (0, 2), (1, 0)]


def serial_selection(groups: list[list[Trajectory]], wanted: int, max_rounds: int) -> dict:
    """The plain account: examine groups one by one while fewer than ``wanted`` are kept and fewer than
    ``(1 + max_rounds) x wanted`` were examined; a group is kept if its members' successes differ."""
    kept, reasons, examined = [], [], 0
    for group in groups:
        if len(kept) == wanted or examined == (1 + max_rounds) * wanted:
            break
        examined += 1
        outcomes = [t.success for t in group]
        if len(set(outcomes)) == 2:
            kept.append(group)
        else:
            reasons.append("all_success" if all(outcomes) else "all_failed")
    return {"kept": kept, "reasons": reasons, "examined": examined,
            "extra_rounds": max(math.ceil(examined / wanted) - 1, 0), "bound_hit": len(kept) < wanted}


@pytest.mark.parametrize("seed", range(20))
def test_the_selection_matches_a_serial_account(seed):
    rng = random.Random(seed)
    wanted, max_rounds, size = rng.randint(1, 4), rng.randint(0, 3), rng.randint(2, 4)
    p = rng.choice([0.05, 0.5, 0.95])  # mostly all-fail, mixed, mostly all-success
    groups = [[record(g * size + i, group=g, success=rng.random() < p, reward=rng.random()) for i in range(size)]
              for g in range(60)]
    expected = serial_selection(groups, wanted, max_rounds)
    selection = GroupSelection(wanted, max_rounds)
    for group in groups:
        if selection.done:
            break
        selection.offer(group)
    metrics = selection.metrics()
    assert selection.kept == expected["kept"]
    assert [group[0].info["filtered"] for group in groups[:expected["examined"]] if group not in selection.kept] \
        == expected["reasons"]
    assert metrics["filter_groups/examined"] == expected["examined"]
    assert metrics["filter_groups/kept"] == len(expected["kept"])
    assert metrics["filter_groups/filtered"] == len(expected["reasons"])
    assert metrics["filter_groups/share_filtered"] == len(expected["reasons"]) / expected["examined"]
    assert metrics["filter_groups/extra_rounds"] == expected["extra_rounds"] <= max_rounds
    assert metrics["filter_groups/bound_hit"] == float(expected["bound_hit"])


def test_a_full_batch_sets_further_mixed_groups_aside_as_surplus():
    mixed = [[record(2 * g, group=g, success=True, reward=0.0), record(2 * g + 1, group=g, success=False, reward=0.0)]
             for g in range(3)]
    selection = GroupSelection(wanted=2, max_rounds=0)
    assert [selection.offer(group) for group in mixed] == [True, True, False]
    assert mixed[2][0].info["filtered"] == "surplus"
    metrics = selection.metrics()
    assert metrics["filter_groups/surplus"] == 1.0 and metrics["filter_groups/filtered"] == 0.0
    assert metrics["filter_groups/bound_hit"] == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--filter-groups", "--group-size", "1"], "--filter-groups: compares the outcomes of a question's samples; "
                                               "needs --group-size 2 or more (got 1"),
    (["--filter-groups-max-rounds", "-1"], "--filter-groups-max-rounds -1: must be an integer >= 0"),
    (["--filter-groups-max-rounds", "two"], "--filter-groups-max-rounds two: must be an integer >= 0"),
])
def test_bad_filter_flags_are_refused_in_one_line(capsys, argv, message):
    started = time.perf_counter()
    try:
        code = main(["train", *argv])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and time.perf_counter() - started < 30
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_the_options_reach_the_config_and_a_config_file_is_checked_the_same():
    config = options_from({"filter_groups": True, "filter_groups_max_rounds": 3, "group_size": 2}, keys=True)
    assert config.rollout.filter_groups and config.rollout.filter_groups_max_rounds == 3
    defaults = options_from({}, keys=True).rollout
    assert defaults.filter_groups is False and defaults.filter_groups_max_rounds == 9
    with pytest.raises(UsageError, match=r"^filter_groups: compares the outcomes .* needs group_size 2 or more"):
        options_from({"filter_groups": True}, keys=True)


# -- the real thing: the tiny agent ----------------------------------------------------------------------------


class ShapedOutcome(Task):
    """The arithmetic task with its reward shaped apart from its outcome: even questions pay 1.0 whatever happened
    (a group's shaped rewards are equal, its outcomes may differ), odd questions 0.5 + 0.25 x (episode index % 2)
    (a group's two shaped rewards always differ). Success is the arithmetic task's own judgement, or never
    (``never``: every group fails)."""

    name = "shaped_arithmetic"

    def __init__(self, never: bool = False):
        self.task, self.never = get_task("arithmetic"), never

    def make_episode(self, index, seed=0):
        return self.task.make_episode(index, seed)

    def reward(self, episode, messages, tool_calls):
        episode.info["solved"] = not self.never and self.task.reward(episode, messages, tool_calls) > 0
        return 1.0 if episode.info["group"] % 2 == 0 else 0.5 + 0.25 * (episode.info["index"] % 2)

    def success(self, episode, reward):
        return episode.info.get("solved", False)


def filter_config(tiny_mid, out, **overrides):
    """4 questions x 2 samples per step, GRPO, dynamic sampling with room for many rounds."""
    return small_config(tiny_mid, out, **{"estimator": "grpo", "filter_groups": True, "filter_groups_max_rounds": 20,
                                          **overrides})


def groups_in(path) -> dict[int, list[Trajectory]]:
    groups = defaultdict(list)
    for trajectory in read_trajectories(path):
        groups[trajectory.info["group"]].append(trajectory)
    return dict(groups)


def check_kept_and_set_aside(groups: dict[int, list[Trajectory]], metrics: dict, wanted: int) -> list[int]:
    """Every trained group is mixed and whole, every set-aside one marked (uniform outcomes, or surplus); the
    batch holds ``wanted`` groups; returns the trained groups."""
    trained = sorted(g for g, members in groups.items() if members[0].info["trained"])
    assert len(trained) == wanted == metrics["filter_groups/kept"] and metrics["filter_groups/bound_hit"] == 0.0
    for group, members in groups.items():
        assert len(members) == 2 and len({t.info["trained"] for t in members}) == 1
        outcomes = {t.success for t in members}
        if group in trained:
            assert outcomes == {True, False} and all("filtered" not in t.info for t in members)
        else:
            assert {t.info["filtered"] for t in members} == ({"surplus"} if len(outcomes) == 2 else
                                                             {"all_success" if True in outcomes else "all_failed"})
    return trained


@pytest.mark.slow
def test_synchronous_steps_hold_their_batch_of_mixed_groups_and_the_stream_goes_on(tiny_mid, tmp_path):
    trainer = Trainer(filter_config(tiny_mid, tmp_path), task=ShapedOutcome())
    history = trainer.train()
    played, shaped_cases = [], set()
    for step, metrics in enumerate(history, 1):
        groups = groups_in(step_file(tmp_path, step))
        trained = check_kept_and_set_aside(groups, metrics, wanted=4)
        order = sorted(groups)
        # whole rounds of 4 fresh questions, the first 4 mixed ones (in question order) trained: a serial account
        assert len(order) % 4 == 0 and order == list(range(order[0], order[0] + len(order)))
        assert trained == [g for g in order if len({t.success for t in groups[g]}) == 2][:4]
        assert metrics["filter_groups/examined"] == len(order)
        assert metrics["filter_groups/extra_rounds"] == len(order) // 4 - 1
        episodes = [t for g in order for t in groups[g]]
        assert metrics["success"] == sum(t.success for t in episodes) / len(episodes)  # over every episode played
        played += order
        for group, members in groups.items():
            same_reward = len({t.reward for t in members}) == 1
            shaped_cases.add((group in trained, same_reward))
    # both cases happened: a trained group whose shaped rewards are equal, a dropped one whose shaped rewards differ
    assert (True, True) in shaped_cases and (False, False) in shaped_cases
    assert played == list(range(len(played))) and trainer.rollouts.next_group == len(played) > 8  # extra rounds were played
    assert load_state(step_folder(trainer.output_dir, 2))["next_group"] == len(played)

    resumed = Trainer(filter_config(tiny_mid, tmp_path, steps=3, resume=str(tmp_path)), task=ShapedOutcome())
    assert resumed.rollouts.next_group == len(played)
    resumed.train()
    assert min(groups_in(step_file(tmp_path, 3))) == len(played)  # no question twice


@pytest.mark.slow
def test_a_step_whose_groups_all_fail_reports_the_bound_and_trains_on_nothing(tiny_mid, tmp_path):
    trainer = Trainer(filter_config(tiny_mid, tmp_path, steps=1, filter_groups_max_rounds=1), task=ShapedOutcome(never=True))
    with pytest.warns(UserWarning, match="16 set aside by --filter-groups"):
        [metrics] = trainer.train()
    assert metrics["filter_groups/bound_hit"] == 1.0 and metrics["filter_groups/extra_rounds"] == 1.0
    assert metrics["filter_groups/examined"] == 8.0 and metrics["filter_groups/kept"] == 0.0
    assert metrics["filter_groups/all_failed"] == 8.0 and metrics["filter_groups/share_filtered"] == 1.0
    assert metrics["skipped_steps"] == 1.0
    rows = read_trajectories(step_file(tmp_path, 1))
    assert len(rows) == 16 and {t.info["filtered"] for t in rows} == {"all_failed"}
    assert not any(t.info["trained"] for t in rows)
    logged = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "filter_groups" in line]
    assert len(logged) == 1 and '"filter_groups/bound_hit": 1.0' in logged[0]


class ThresholdSuccess(Task):
    """The arithmetic task whose success is a reward above 0.3 (the summarising agent's rewards, 0.1 + 0.077 x
    index, split only question 1: episode 2 fails with 0.254, episode 3 succeeds with 0.331)."""

    name = "arithmetic"

    def __init__(self):
        self.task = get_task("arithmetic")

    def make_episode(self, index, seed=0):
        return self.task.make_episode(index, seed)

    def reward(self, episode, messages, tool_calls):
        return self.task.reward(episode, messages, tool_calls)

    def success(self, episode, reward):
        return reward > 0.3


@pytest.mark.slow
def test_agent_sessions_of_two_segments_are_one_member_each(tiny_mid, tmp_path):
    config = filter_config(tiny_mid, tmp_path, steps=2, prompts_per_step=1, mini_batches=1, concurrency=2,
                           filter_groups_max_rounds=1, agent="tests/helpers/summarising_agent.py:agent")
    trainer = Trainer(config, task=ThresholdSuccess())
    with pytest.warns(UserWarning, match="set aside by --filter-groups"):
        first, second = trainer.train()
    groups = groups_in(step_file(tmp_path, 1))
    # question 0: sessions 0 (two segments, 0.1) and 1 (0.177) both fail, their rewards differ: set aside;
    # question 1: sessions 2 (two segments, 0.254: fails) and 3 (0.331: succeeds): kept, one extra round
    assert sorted(groups) == [0, 1] and [len(groups[g]) for g in (0, 1)] == [3, 3]
    assert [len({t.session_id for t in groups[g]}) for g in (0, 1)] == [2, 2]
    assert {t.info["filtered"] for t in groups[0]} == {"all_failed"} and not any(t.info["trained"] for t in groups[0])
    assert all(t.info["trained"] for t in groups[1])
    assert first["filter_groups/kept"] == 1.0 and first["filter_groups/examined"] == 2.0
    assert first["filter_groups/extra_rounds"] == 1.0 and first["filter_groups/bound_hit"] == 0.0
    # questions 2 and 3 both succeed: the bound (1 extra round) ends step 2 with nothing kept
    assert sorted(groups_in(step_file(tmp_path, 2))) == [2, 3]
    assert second["filter_groups/all_success"] == 2.0 and second["filter_groups/bound_hit"] == 1.0
    assert second["skipped_steps"] == 1.0


@pytest.mark.slow
def test_asynchronous_steps_keep_only_mixed_groups_hold_their_batch_and_lose_nothing(tiny_mid, tmp_path):
    trainer = Trainer(filter_config(tiny_mid, tmp_path, steps=3, max_staleness=1), task=ShapedOutcome())
    history = trainer.train()
    seen = []
    for step, metrics in enumerate(history, 1):
        groups = groups_in(step_file(tmp_path, step))
        stale = {g for g, members in groups.items() if "stale" in members[0].info}
        trained = check_kept_and_set_aside({g: m for g, m in groups.items() if g not in stale}, metrics, wanted=4)
        assert metrics["filter_groups/surplus"] == 0.0  # a take stops examining when its batch is full
        assert metrics["filter_groups/examined"] == len(groups) - len(stale)
        assert metrics["filter_groups/extra_rounds"] == math.ceil((len(groups) - len(stale)) / 4) - 1
        assert metrics["staleness/max"] <= 1
        assert all(oldest_version(t, step - 1) >= step - 2 for g in trained for t in groups[g])  # K = 1
        seen += list(groups)
    assert len(seen) == len(set(seen))  # every group trained on, set aside or dropped once
    counts, producer = trainer.producer.counts, trainer.producer
    waiting = sum(len(members) for members in producer.groups.finished.values())
    assert counts["finished"] == counts["taken"] + counts["dropped_stale"] + counts["filtered"] + waiting
    assert counts["taken"] == 3 * 4 * 2 and counts["filtered"] == 2 * sum(h["filter_groups/filtered"] for h in history)


@pytest.mark.slow
def test_an_asynchronous_step_whose_groups_all_fail_reports_the_bound_and_the_next_goes_on(tiny_mid, tmp_path):
    trainer = Trainer(filter_config(tiny_mid, tmp_path, steps=2, max_staleness=1, filter_groups_max_rounds=1),
                      task=ShapedOutcome(never=True))
    with pytest.warns(UserWarning, match="set aside by --filter-groups"):
        history = trainer.train()
    for metrics in history:  # the producer kept playing: each step examined its bound of 8 groups
        assert metrics["filter_groups/bound_hit"] == 1.0 and metrics["filter_groups/examined"] == 8.0
        assert metrics["filter_groups/extra_rounds"] == 1.0 and metrics["skipped_steps"] == 1.0
