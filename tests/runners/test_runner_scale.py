"""The runner at scale (issue 15): O(1) running statistics equal to a serial recount of the file, bounded
in-flight work, trajectories kept only when asked, errors and cancellation still propagate."""

from __future__ import annotations

import asyncio

import pytest

from agent_loop.backends.base import Backend
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.cli.tables import failure_summary
from agent_loop.runners.local import read_trajectories, run_rollouts, stream_rollouts
from agent_loop.runners.spec import RunSpec
from agent_loop.runners.stats import RolloutStats
from agent_loop.tasks.registry import get_task
from tests.helpers.scripted_turns import call, turn_script


def recount(trajectories) -> dict:
    """The statistics recomputed over the whole list, the plain way."""
    from collections import Counter

    errors = Counter()
    for t in trajectories:
        errors.update(t.metrics["tool_errors"])
    return {
        "episodes": len(trajectories),
        "successes": sum(t.success for t in trajectories),
        "reward_sum": sum(t.reward for t in trajectories),
        "turns": sum(t.metrics["turns"] for t in trajectories),
        "assistant_tokens": sum(t.metrics["assistant_tokens"] for t in trajectories),
        "observation_tokens": sum(t.metrics["observation_tokens"] for t in trajectories),
        "tool_calls": sum(t.metrics["tool_calls"] for t in trajectories),
        "finish_reasons": Counter(t.finish_reason for t in trajectories),
        "tool_errors": errors,
    }


class CountingBackend(Backend):
    """Wraps a backend; records the most requests in flight at once."""

    def __init__(self, inner, delay_s: float = 0.002):
        self.inner, self.delay_s, self.now, self.peak = inner, delay_s, 0, 0

    async def generate(self, prompt_ids, sampling, session_id=None):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.delay_s)
            return await self.inner.generate(prompt_ids, sampling, session_id=session_id)
        finally:
            self.now -= 1


def mixed_script(tokenizer):
    """Episodes succeed or fail depending on the question: a calculator call, then an answer of 7."""
    return turn_script(tokenizer, [call("calculator", expression="3+4"), "The answer is 7."])


def test_streamed_stats_match_a_recount_of_the_file_and_keep_nothing(tmp_path, qwen_tokenizer):
    out = tmp_path / "r.jsonl"
    task = get_task("arithmetic")
    backend = CountingBackend(ScriptedBackend(mixed_script(qwen_tokenizer)))
    spec = RunSpec(task, qwen_tokenizer, range(40), output_path=out, progress=False)
    stats, kept = asyncio.run(stream_rollouts(spec, backend, concurrency=6, sample_size=5))
    assert kept is None
    written = read_trajectories(out)
    expected = recount(written)
    assert {name: getattr(stats, name) for name in expected} == expected
    assert stats.success_rate == expected["successes"] / 40
    assert sorted(t.info["index"] for t in written) == list(range(40))
    assert sorted(t.info["index"] for t in stats.sample) == [0, 1, 2, 3, 4]
    assert backend.peak == 6  # exactly `concurrency` episodes in flight, never more


def test_run_rollouts_still_returns_every_trajectory_in_index_order(qwen_tokenizer):
    task = get_task("arithmetic")
    order = [5, 3, 9, 0, 1, 7]
    got = asyncio.run(run_rollouts(task, ScriptedBackend(mixed_script(qwen_tokenizer)), qwen_tokenizer, order,
                                   concurrency=4, progress=False))
    assert [t.info["index"] for t in got] == order


def test_lazy_episodes_with_total_and_more_workers_than_episodes(qwen_tokenizer):
    task = get_task("arithmetic")
    backend = CountingBackend(ScriptedBackend(mixed_script(qwen_tokenizer)))
    stats, _ = asyncio.run(stream_rollouts(RunSpec(task, qwen_tokenizer, iter(range(3)), progress=False), backend,
                                           concurrency=64, total=3))
    assert stats.episodes == 3 and backend.peak <= 3


def test_concurrency_below_one_is_refused_not_hung(qwen_tokenizer):
    with pytest.raises(ValueError, match="concurrency must be at least 1, got 0"):
        asyncio.run(stream_rollouts(RunSpec(get_task("arithmetic"), qwen_tokenizer, range(4), progress=False),
                                    ScriptedBackend(mixed_script(qwen_tokenizer)), concurrency=0))


class BrokenAt:
    """The arithmetic task, except that making episode ``bad`` raises (a task plug-in with a bug)."""

    def __init__(self, bad: int):
        self.inner, self.bad, self.made = get_task("arithmetic"), bad, 0
        self.name = self.inner.name

    def make_episode(self, index, seed=0):
        if index == self.bad:
            raise RuntimeError(f"cannot make episode {index}")
        self.made += 1
        return self.inner.make_episode(index, seed)

    def reward(self, *args):
        return self.inner.reward(*args)


def test_an_episode_that_raises_is_counted_as_an_error_and_the_run_goes_on(qwen_tokenizer):
    task = BrokenAt(bad=3)
    backend = CountingBackend(ScriptedBackend(mixed_script(qwen_tokenizer)), delay_s=0.01)
    stats, _ = asyncio.run(stream_rollouts(RunSpec(task, qwen_tokenizer, range(200), progress=False), backend,
                                           concurrency=4))
    assert stats.episodes == 200 and task.made == 199
    assert stats.finish_reasons["error"] == 1 and stats.first_errors == [(3, "RuntimeError: cannot make episode 3")]


def test_failure_summary_names_the_first_errors():
    from agent_loop.types import Trajectory

    stats = RolloutStats()
    for i in range(5):
        stats.add(Trajectory(prompt_ids=[1], response_ids=[], spans=[], turn_ids=[], logprobs=[], messages=[],
                             finish_reason="error", metrics={"backend_error": f"HTTPBackendError: HTTP 404 ({i})"},
                             info={"index": i}))
    text = failure_summary(stats)
    assert text.startswith("every episode (5) ended in an error; first: episode 0: HTTPBackendError: HTTP 404 (0)")
    assert "(3)" not in text  # only the first three are kept
    assert len(stats.first_errors) == 3


def test_the_summary_counts_turns_and_tokens_from_the_records_themselves(qwen_tokenizer):
    """RolloutStats reads each record's own token lists and tool calls (an inspect of any file summarises
    the same way), per turn too; on the loop's trajectories that equals their metrics."""
    got = asyncio.run(run_rollouts(get_task("arithmetic"), ScriptedBackend(mixed_script(qwen_tokenizer)), qwen_tokenizer,
                                   range(6), progress=False))
    stats = RolloutStats()
    for t in got:
        stats.add(t)
    per_turn = {}
    for t in got:
        for turn, counts in enumerate(t.metrics["turn_tokens"]):
            totals = per_turn.setdefault(turn, [0, 0, 0])
            totals[0] += 1
            totals[1] += counts["assistant"]
            totals[2] += counts["observation"]
    assert stats.per_turn == per_turn
    assert stats.turns == sum(t.metrics["turns"] for t in got)
    assert (stats.first_index, stats.last_index) == (0, 5)


class SwallowsOneCancel(Backend):
    """A careless plug-in: its request catches the first cancel and goes on waiting."""

    def __init__(self):
        self.waiting = 0

    async def generate(self, prompt_ids, sampling, session_id=None):
        self.waiting += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(3600)


def test_a_cancelled_run_ends_even_when_an_episode_swallows_one_cancel(qwen_tokenizer):
    """Cancelling a run cancels its episodes until they end (the producer's close once hung on one that
    Python 3.11's wait_for let go on)."""
    backend = SwallowsOneCancel()

    async def main():
        run = asyncio.ensure_future(stream_rollouts(
            RunSpec(get_task("arithmetic"), qwen_tokenizer, range(4), progress=False), backend, concurrency=2))
        while backend.waiting < 2:
            await asyncio.sleep(0.01)
        run.cancel()
        await asyncio.wait({run}, timeout=60)  # a wait that does not cancel again on its timeout
        assert run.cancelled()

    asyncio.run(main())
