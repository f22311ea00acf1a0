"""The loop under faults (issue 30): scoring that hangs or raises ends one episode (with
its tokens kept), never the run; what any backend returns is checked in one place; a prompt that does not
fit the model's context is an error before generation, and a 2 MB prompt does not grow memory to GBs.

Scripted replies on the real Qwen2.5 tokenizer and chat template (loop logic), and the real transformers
backend over a random Qwen2 model (the context check).
"""

import asyncio
import json
import resource
import threading
import time

import pytest

from agent_loop.backends.base import GenerationResult
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop import call_bounded, model_limits, run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import read_trajectories, run_rollouts
from agent_loop.tasks.dataset import DatasetTask
from agent_loop.tasks.registry import get_task
from agent_loop.types import Episode

ANSWER = "The answer is 4."


def answering(tokenizer):
    return ScriptedBackend(lambda prompt: tokenizer.encode(ANSWER, add_special_tokens=False))


class Scored:
    """One question; scoring episode ``bad`` hangs (``how="hang"``) or raises in ``hook``."""

    name = "scored"

    def __init__(self, bad: int, how: str = "hang", hook: str = "reward"):
        self.bad, self.how, self.hook = bad, how, hook

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "What is 2 + 2?"}], tools=[], answer="4", info={"i": index})

    def _maybe_fail(self, episode, hook):
        if episode.info["i"] == self.bad and hook == self.hook:
            if self.how == "hang":
                time.sleep(3600)  # never returns (its daemon thread does not keep the process alive)
            raise ValueError(f"{hook} broke")

    def reward(self, episode, messages, tool_calls):
        self._maybe_fail(episode, "reward")
        return 1.0

    def success(self, episode, reward):
        self._maybe_fail(episode, "success")
        return reward > 0


def test_a_reward_that_never_returns_ends_its_episode_at_the_timeout_and_the_run_goes_on(qwen_tokenizer, tmp_path):
    out = tmp_path / "run.jsonl"
    started = time.monotonic()
    got = asyncio.run(run_rollouts(Scored(bad=1), answering(qwen_tokenizer), qwen_tokenizer, range(6),
                                   LoopConfig(reward_timeout_s=1.0), concurrency=2, output_path=out, progress=False))
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + 3.0, elapsed  # the bound plus a little: the hung thread holds nothing up
    assert [t.finish_reason for t in got] == ["stop", "error", "stop", "stop", "stop", "stop"]
    hung = got[1]
    assert hung.reward == 0.0 and hung.info["success"] is False
    assert hung.info["reward_error"] == hung.metrics["error"] == (
        "RewardTimeout: scoring scored episode took longer than 1 s (reward_timeout_s); reward 0")
    assert qwen_tokenizer.decode(hung.response_ids).startswith(ANSWER)  # the played turn is kept
    assert all(t.reward == 1.0 and t.info["success"] for i, t in enumerate(got) if i != 1)
    assert sorted(t.info["index"] for t in read_trajectories(out)) == list(range(6))


def test_a_dataset_reward_function_that_hangs_is_bounded_too(qwen_tokenizer):
    def slow(completion, answer):
        if answer == "b":
            time.sleep(3600)
        return 1.0

    task = DatasetTask([{"prompt": "a", "answer": "a"}, {"prompt": "b", "answer": "b"}], reward=slow)
    started = time.monotonic()
    got = asyncio.run(run_rollouts(task, answering(qwen_tokenizer), qwen_tokenizer, range(2),
                                   LoopConfig(reward_timeout_s=0.5), progress=False))
    assert time.monotonic() - started < 0.5 + 3.0
    assert [t.finish_reason for t in got] == ["stop", "error"] and [t.reward for t in got] == [1.0, 0.0]
    assert got[1].info["reward_error"].startswith("RewardTimeout: scoring dataset episode took longer than 0.5 s")


def test_a_reward_still_running_after_a_few_seconds_is_announced_naming_the_episode_and_its_end(
        qwen_tokenizer, monkeypatch):
    """Issue 49: a reward that never returned left the user 60 s with no line and no episode written. "A few
    seconds" is made 0.3 s here; the rule is the same at its 5 s."""
    import agent_loop.episode.loop as loop

    monkeypatch.setattr(loop, "SLOW_NOTICE_S", 0.3)
    with pytest.warns(UserWarning) as caught:
        got = asyncio.run(run_rollouts(Scored(bad=1), answering(qwen_tokenizer), qwen_tokenizer, range(3),
                                       LoopConfig(reward_timeout_s=2.0), seed=5, progress=False))
    lines = [str(w.message) for w in caught if "reward has not returned" in str(w.message)]
    assert lines == ["episode 1 of scored (seed 5): its reward has not returned after 0.3 s; at 2 s "
                     "(--reward-timeout-s), 1.7 s from now, the episode ends with an error and reward 0"]
    assert [t.finish_reason for t in got] == ["stop", "error", "stop"]  # the others: no line


def test_a_bound_no_longer_than_the_notice_delay_is_not_announced(qwen_tokenizer, monkeypatch, recwarn):
    import agent_loop.episode.loop as loop

    monkeypatch.setattr(loop, "SLOW_NOTICE_S", 0.3)
    got = asyncio.run(run_rollouts(Scored(bad=0), answering(qwen_tokenizer), qwen_tokenizer, range(1),
                                   LoopConfig(reward_timeout_s=0.3), progress=False))
    assert got[0].finish_reason == "error" and not [w for w in recwarn if "reward has not" in str(w.message)]


@pytest.mark.parametrize("hook", ["reward", "success"])
def test_a_scoring_hook_that_raises_is_an_error_episode_with_its_tokens(qwen_tokenizer, hook):
    got = asyncio.run(run_rollouts(Scored(bad=0, how="raise", hook=hook), answering(qwen_tokenizer), qwen_tokenizer,
                                   range(2), progress=False))
    assert [t.finish_reason for t in got] == ["error", "stop"]
    assert got[0].metrics["error"] == got[0].info["reward_error"] == f"ValueError: {hook} broke"
    assert got[0].reward == 0.0 and got[0].response_ids and got[1].reward == 1.0


def test_call_bounded_returns_raises_and_times_out():
    async def main():
        value = await call_bounded(lambda: 41 + 1, 1.0, "ok")
        with pytest.raises(KeyError):
            await call_bounded(lambda: {}["x"], 1.0, "raises")
        with pytest.raises(RuntimeError, match="SystemExit: 3"):  # user code's SystemExit ends the call only
            await call_bounded(lambda: exit(3), 1.0, "exits")
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await call_bounded(lambda: time.sleep(3600), 0.2, "hangs")
        return value, time.monotonic() - started

    value, waited = asyncio.run(main())
    assert value == 42 and 0.2 <= waited < 0.2 + 1.0


def test_call_bounded_reuses_idle_threads_but_never_a_hung_one(monkeypatch):
    """A finished call's thread runs the next call (no thread start, which blocks the event loop, per scored
    episode); a call that hangs keeps its thread, and later calls run on others."""
    import threading

    from agent_loop.episode import loop

    monkeypatch.setattr(loop, "_THREADS", loop._DaemonThreads())  # none idle yet (earlier tests leave several)

    async def until_idle():
        for _ in range(500):  # the thread counts itself idle just after it answers
            if loop._THREADS._idle:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no thread came back idle")

    async def main():
        first = await call_bounded(threading.current_thread, 1.0, "a")
        await until_idle()
        second = await call_bounded(threading.current_thread, 1.0, "b")
        await until_idle()
        hung = []
        with pytest.raises(asyncio.TimeoutError):
            await call_bounded(lambda: hung.append(threading.current_thread()) or time.sleep(3600), 0.2, "hangs")
        after = await call_bounded(threading.current_thread, 1.0, "c")
        return first, second, hung[0], after

    first, second, hung, after = asyncio.run(main())
    assert second is first and after is not hung  # Thread objects: never reused, unlike idents


# --- what comes back from a backend -------------------------------------------------------------------------


class Replies(ScriptedBackend):
    """Answers turn k with ``answers[k]`` (ids, logprobs, finish) as given, unchecked, like a faulty engine."""

    def __init__(self, answers):
        super().__init__(lambda prompt: [])
        self.answers = answers

    async def generate(self, prompt_ids, sampling, session_id=None):
        self.calls.append((list(prompt_ids), session_id))
        return GenerationResult(*self.answers[min(len(self.calls) - 1, len(self.answers) - 1)])


def play_answers(tokenizer, answers, **config):
    backend = Replies(answers)
    trajectory = asyncio.run(run_episode(get_task("lookup"), 0, backend, tokenizer, LoopConfig(**config)))
    return trajectory, backend


def call_ids(tokenizer):
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call><|im_end|>'
    return tokenizer.encode(call, add_special_tokens=False)


@pytest.mark.parametrize("bad, message", [
    (lambda ids: (ids, [float("nan")] * len(ids), "stop"), "returned logprob nan for token 0"),
    (lambda ids: (ids, [float("inf")] * len(ids), "stop"), "returned logprob inf for token 0"),
    (lambda ids: ([5, 10**6], [-0.1, -0.1], "length"), "returned token id 1000000, outside the vocabulary"),
    (lambda ids: ([5, -1], [-0.1, -0.1], "length"), "returned token id -1, outside the vocabulary"),
    (lambda ids: ([], [], "stop"), "returned 0 token ids for a request of at most"),
    (lambda ids: ([5, 6], [-0.1], "length"), "returned 1 logprobs for 2 token ids"),
    (lambda ids: ([5.0, 6], [-0.1, -0.1], "length"), "returned a token id that is not an integer: 5.0"),
    (lambda ids: (ids, [-0.1] * len(ids), "abort"), "returned finish_reason 'abort'"),
])
def test_a_bad_answer_at_any_turn_ends_the_episode_naming_the_backend_and_turn(qwen_tokenizer, bad, message):
    good = call_ids(qwen_tokenizer)
    trajectory, backend = play_answers(qwen_tokenizer, [(good, [-0.1] * len(good), "stop"), bad(good)], max_turns=3)
    assert trajectory.finish_reason == "error" and len(backend.calls) == 2  # not retried
    error = trajectory.metrics["backend_error"]
    assert error.startswith("BadOutputError: turn 1: Replies ") and message in error, error
    assert trajectory.response_ids[: len(good)] == good  # the good first turn is kept, the bad one is not
    json.dumps(trajectory.logprobs, allow_nan=False)


def test_vocabulary_and_context_come_from_the_model_folder(qwen_tokenizer, tmp_path):
    assert model_limits(qwen_tokenizer) == (len(qwen_tokenizer), None)  # a folder without config.json


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, qwen_dir):
    from agent_loop.model_folders import build_random_model

    folder = build_random_model(tmp_path_factory.mktemp("short") / "model", "qwen2", qwen_dir)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))  # a short context
    return folder


@pytest.mark.slow
def test_a_2mb_prompt_is_an_error_before_generation_in_bounded_memory(short_model):
    """The probe: 6,019 tokens for 1,024 positions played silently; a 2 MB prompt grew the process to 7 GB."""
    from transformers import AutoTokenizer

    from agent_loop.backends.hf import TransformersBackend

    tokenizer = AutoTokenizer.from_pretrained(short_model)
    assert model_limits(tokenizer)[1] == 256
    backend = TransformersBackend(str(short_model))
    huge = ("one two three four five six seven eight nine ten " * 41000)[:2_000_000]
    task = DatasetTask([{"prompt": huge, "answer": "x"}, {"prompt": "Say hi.", "answer": "hi"}], reward="contains")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    got = asyncio.run(run_rollouts(task, backend, tokenizer, range(2), LoopConfig(max_tokens=8, max_turns=1),
                                   progress=False))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert got[0].finish_reason == "error" and got[0].response_ids == [] and backend.batch_sizes == [1]
    assert got[0].metrics["backend_error"] == (f"ContextLengthError: turn 0: the prompt of {len(got[0].prompt_ids)} "
                                              "tokens leaves no room in the model's context of 256 tokens")
    assert len(got[0].prompt_ids) > 100_000 and grown_mib < 1024, grown_mib
    assert got[1].finish_reason == "length" and len(got[1].response_ids) == 8  # the next episode plays


def test_prompt_check_sees_the_rendered_prompt_and_can_refuse_it(qwen_tokenizer):
    """run_episode(prompt_check=) gets the first prompt as rendered (the trajectory's prompt_ids: the verl AgentLoop
    checks verl's prompt_length on it without rendering it again); what it raises ends the call before any
    generation."""
    task = DatasetTask([{"prompt": "What is 2+2?", "answer": "4"}], reward="contains")
    backend, seen = answering(qwen_tokenizer), []
    trajectory = asyncio.run(run_episode(task, 0, backend, qwen_tokenizer, LoopConfig(max_turns=1),
                                         prompt_check=seen.append))
    assert seen == [trajectory.prompt_ids] and trajectory.reward == 1.0

    def refuse(prompt_ids):
        raise ValueError(f"prompt of {len(prompt_ids)} tokens")

    calls = []
    backend = ScriptedBackend(lambda prompt: calls.append(prompt) or [])
    with pytest.raises(ValueError, match=f"prompt of {len(trajectory.prompt_ids)} tokens"):
        asyncio.run(run_episode(task, 0, backend, qwen_tokenizer, LoopConfig(max_turns=1), prompt_check=refuse))
    assert calls == []


def test_call_bounded_keeps_a_cancel_that_arrives_with_the_answer():
    """A cancel and the answer in the same loop iteration: the caller is cancelled (Python 3.11's
    ``asyncio.wait_for`` returned the answer instead, and a cancelled run's worker went on)."""
    async def main():
        release = threading.Event()
        caller = asyncio.ensure_future(call_bounded(release.wait, 30.0, "racy"))
        await asyncio.sleep(0.05)  # the call is on its thread
        release.set()
        time.sleep(0.2)  # its answer is queued on the loop before the cancel below
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller

    asyncio.run(main())
