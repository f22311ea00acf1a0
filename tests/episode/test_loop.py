"""The agent loop's logic with scripted replies on a real tokenizer and chat template (Qwen2.5).

Each budget and each finish_reason of docs/design.md section 5, each kind of tool failure, and the
token-in/token-out invariant: prompt + response ids equal the template's full render of the chat.
"""

import asyncio
import time

import pytest

from agent_loop.backends.base import Backend, GenerationResult
from agent_loop.backends.scripted import ScriptedBackend, scripted_logprob
from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tools import TRUNCATION_MARK, ToolExecutor
from agent_loop.runners.local import read_trajectories, run_rollouts
from agent_loop.tasks.registry import get_task
from agent_loop.types import Episode, Trajectory
from masking import SpanKind
from tests.helpers.scripted_turns import call, turn_script

A, O = SpanKind.ASSISTANT, SpanKind.OBSERVATION


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer):
    return qwen_tokenizer


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: What to repeat.
    """
    return text


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"boom: {reason}")


async def hang(seconds: float) -> str:
    """Sleeps longer than any timeout.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke up"


def huge(n: int) -> str:
    """A very long result.

    Args:
        n: How many words.
    """
    return " ".join(f"word{i}" for i in range(n))


class ToolTroubleTask:
    """One question; the script decides which tools get called. Reward 1 if the last answer says 'done'."""

    name = "trouble"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": f"Episode {index}: use the tools."}],
                       tools=[echo, explode, hang, huge], answer="done")

    def reward(self, episode, messages, tool_calls):
        return float(messages[-1]["role"] == "assistant" and "done" in messages[-1]["content"])


def play(task, tokenizer, replies, config=None, index=0):
    backend = ScriptedBackend(turn_script(tokenizer, replies))
    return asyncio.run(run_episode(task, index, backend, tokenizer, config or LoopConfig(tool_timeout_s=0.5)))


def assert_token_in_token_out(trajectory: Trajectory, tokenizer, tools):
    """prompt + response ids equal the full render of the recorded chat; spans mark exactly the assistant tokens."""
    formatter = ChatFormatter(tokenizer, tools=ToolExecutor(tools).schemas)
    ids = trajectory.prompt_ids + trajectory.response_ids
    assert len(trajectory.spans) == len(trajectory.turn_ids) == len(trajectory.logprobs) == len(trajectory.response_ids)
    # assistant runs decode to the assistant text as sampled; everything else is template or tool text
    for token, span, logprob in zip(trajectory.response_ids, trajectory.spans, trajectory.logprobs):
        assert logprob == (scripted_logprob(token) if span == A else 0.0)
    if trajectory.finish_reason == "stop":
        render = formatter.render(trajectory.messages)
        # the full render ends with the template's trailer after the last <|im_end|>; the response stops at it
        assert render[: len(ids)] == ids
        assert tokenizer.decode(render[len(ids):]).strip() == ""


def test_calculator_episode_spans_turns_and_render(tokenizer):
    task = get_task("arithmetic")
    episode = task.make_episode(3, 0)
    question = episode.messages[-1]["content"].split("What is ")[1].rstrip("?")
    trajectory = play(task, tokenizer, [call("calculator", expression=question), f"The answer is {episode.answer}."],
                      index=3)
    assert trajectory.finish_reason == "stop" and trajectory.reward == 1.0 and trajectory.info["success"]
    assert trajectory.tool_calls[0].result == str(episode.answer) and trajectory.tool_calls[0].turn == 0
    # A-run, O-run, A-run; the observation belongs to turn 0 (whose call caused it)
    runs = []
    for span, turn in zip(trajectory.spans, trajectory.turn_ids):
        if not runs or tuple(runs[-1][:2]) != (span, turn):
            runs.append([span, turn, 0])
        runs[-1][2] += 1
    assert [(s, t) for s, t, _ in runs] == [(A, 0), (O, 0), (A, 1)]
    observation = tokenizer.decode(trajectory.response_ids[runs[0][2]: runs[0][2] + runs[1][2]])
    assert observation == f"\n<|im_start|>user\n<tool_response>\n{episode.answer}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    m = trajectory.metrics
    assert m["turn_tokens"] == [{"assistant": runs[0][2], "observation": runs[1][2]}, {"assistant": runs[2][2], "observation": 0}]
    assert m["assistant_tokens"] + m["observation_tokens"] == len(trajectory.response_ids)
    assert m["tool_errors"] == {} and m["tool_calls"] == 1
    assert_token_in_token_out(trajectory, tokenizer, episode.tools)
    assert Trajectory.from_json(trajectory.to_json()) == trajectory


def test_wrong_expression_gets_no_reward(tokenizer):
    task = get_task("arithmetic")
    trajectory = play(task, tokenizer, [call("calculator", expression="1+1"), "The answer is 2."])
    assert trajectory.finish_reason == "stop" and trajectory.reward == 0.0


@pytest.mark.parametrize(
    "reply, kind, message",
    [
        ('<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}\n</tool_call>', "malformed_json", "malformed JSON"),
        (call("nope", x=1), "unknown_tool", "unknown tool 'nope'"),
        (call("echo", text=3), "invalid_arguments", "echo"),
        (call("echo"), "invalid_arguments", "text"),
        (call("explode", reason="test"), "exception", "boom: test"),
        (call("hang", seconds=60), "timeout", "timed out"),
    ],
)
def test_tool_failures_become_error_observations(tokenizer, reply, kind, message):
    started = time.perf_counter()
    trajectory = play(ToolTroubleTask(), tokenizer, [reply, "done"])
    assert time.perf_counter() - started < 30  # a hanging tool never holds the episode past its timeout
    assert trajectory.finish_reason == "stop" and trajectory.reward == 1.0  # the episode goes on
    (record,) = trajectory.tool_calls
    assert record.error_kind == kind and message in record.error
    assert trajectory.metrics["tool_errors"] == {kind: 1}
    observation = tokenizer.decode([t for t, s in zip(trajectory.response_ids, trajectory.spans) if s == O])
    assert record.error in observation  # the model reads the error
    assert_token_in_token_out(trajectory, tokenizer, ToolTroubleTask().make_episode(0).tools)


def test_parallel_calls_in_one_turn_each_get_a_result(tokenizer):
    reply = call("echo", text="one") + "\n" + call("nope") + "\n" + call("echo", text="two")
    trajectory = play(ToolTroubleTask(), tokenizer, [reply, "done"])
    assert [(r.name, r.result, r.error_kind) for r in trajectory.tool_calls] == [
        ("echo", "one", None), ("nope", None, "unknown_tool"), ("echo", "two", None)]
    observation = tokenizer.decode([t for t, s in zip(trajectory.response_ids, trajectory.spans) if s == O])
    assert observation.index("one") < observation.index("unknown tool") < observation.index("two")
    assert_token_in_token_out(trajectory, tokenizer, ToolTroubleTask().make_episode(0).tools)


def test_huge_observation_is_truncated_and_marked(tokenizer):
    config = LoopConfig(max_observation_tokens=40, tool_timeout_s=0.5)
    trajectory = play(ToolTroubleTask(), tokenizer, [call("huge", n=5000), "done"], config)
    observation = [t for t, s in zip(trajectory.response_ids, trajectory.spans) if s == O]
    assert 0 < len(observation) <= 40
    text = tokenizer.decode(observation)
    assert TRUNCATION_MARK in text and text.endswith("<|im_start|>assistant\n")  # the template frame survives
    assert trajectory.metrics["observation_truncations"] == 1 and trajectory.finish_reason == "stop"
    assert trajectory.messages[2]["content"].endswith(TRUNCATION_MARK)
    assert trajectory.tool_calls[0].result.startswith("word0 word1")  # the record keeps the full result
    assert_token_in_token_out(trajectory, tokenizer, ToolTroubleTask().make_episode(0).tools)


def test_max_turns(tokenizer):
    trajectory = play(ToolTroubleTask(), tokenizer, [call("echo", text="again")], LoopConfig(max_turns=3))
    assert trajectory.finish_reason == "max_turns" and trajectory.metrics["turns"] == 3
    assert len(trajectory.tool_calls) == 2  # the last turn's call is not run: no turn is left to read it
    assert max(trajectory.turn_ids) == 2 and trajectory.reward == 0.0


def test_length_budget_mid_generation(tokenizer):
    trajectory = play(ToolTroubleTask(), tokenizer, ["done " * 100], LoopConfig(max_tokens=16))
    assert trajectory.finish_reason == "length" and trajectory.truncated
    assert trajectory.spans == [A] * 16


def test_response_budget_covers_observations(tokenizer):
    # the call takes 24 tokens and its observation 18: 42 leave no room in a budget of 40
    reply = call("echo", text="x " * 5)
    config = LoopConfig(max_response_tokens=40, max_observation_tokens=200)
    trajectory = play(ToolTroubleTask(), tokenizer, [reply, "done"], config)
    assert trajectory.finish_reason == "observation_overflow"
    assert all(s == A for s in trajectory.spans) and len(trajectory.response_ids) == 24
    # with more room the same episode finishes, and never exceeds the budget
    roomy = play(ToolTroubleTask(), tokenizer, [reply, "done"], LoopConfig(max_response_tokens=80))
    assert roomy.finish_reason == "stop" and len(roomy.response_ids) <= 80


class FlakyBackend(Backend):
    """Raises ``failures`` times, then answers; counts calls."""

    def __init__(self, failures, reply_ids):
        self.failures, self.reply_ids, self.calls = failures, reply_ids, 0

    async def generate(self, prompt_ids, sampling, session_id=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("backend down")
        return GenerationResult(self.reply_ids + sampling.stop_token_ids[:1], [-0.5] * (len(self.reply_ids) + 1), "stop")


def test_backend_errors_retry_then_finish_with_error(tokenizer):
    config = LoopConfig(backend_retries=2, retry_backoff_s=0.001)
    done = tokenizer.encode("done")
    recovered = asyncio.run(run_episode(ToolTroubleTask(), 0, FlakyBackend(2, done), tokenizer, config))
    assert recovered.finish_reason == "stop" and recovered.reward == 1.0
    backend = FlakyBackend(10, done)
    failed = asyncio.run(run_episode(ToolTroubleTask(), 0, backend, tokenizer, config))
    assert failed.finish_reason == "error" and backend.calls == 3
    assert "ConnectionError: backend down" in failed.metrics["backend_error"] and failed.response_ids == []


def arithmetic_script(tokenizer, task):
    """Calls the calculator on the episode's question, then answers; deterministic from the prompt alone."""

    def script(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        if "<tool_response>" not in text:
            question = text.split("What is ")[-1].split("?")[0]
            return tokenizer.encode(call("calculator", expression=question))
        return tokenizer.encode("The answer is " + text.split("<tool_response>\n")[-1].split("\n")[0] + ".")

    return script


def test_runner_concurrency_matches_serial_and_writes_jsonl(tokenizer, tmp_path):
    task = get_task("arithmetic")
    out = tmp_path / "rollouts.jsonl"
    backend = ScriptedBackend(arithmetic_script(tokenizer, task))
    concurrent = asyncio.run(run_rollouts(task, backend, tokenizer, range(12), concurrency=6, output_path=out,
                                          progress=False))
    serial = [asyncio.run(run_episode(task, i, backend, tokenizer)) for i in range(12)]

    def strip(t):
        return t.prompt_ids, t.response_ids, t.spans, t.turn_ids, t.logprobs, t.reward, t.messages

    assert [strip(t) for t in concurrent] == [strip(t) for t in serial]
    assert all(t.reward == 1.0 for t in concurrent)
    on_disk = sorted(read_trajectories(out), key=lambda t: t.info["index"])
    assert [strip(t) for t in on_disk] == [strip(t) for t in concurrent]


def test_each_episode_keeps_one_session_id(tokenizer):
    task = get_task("arithmetic")
    backend = ScriptedBackend(arithmetic_script(tokenizer, task))
    asyncio.run(run_rollouts(task, backend, tokenizer, range(4), concurrency=4, progress=False))
    sessions = {}
    for prompt, session in backend.calls:  # 2 turns per episode, interleaved across episodes
        sessions.setdefault(session, []).append(prompt)
    assert len(sessions) == 4 and all(len(prompts) == 2 for prompts in sessions.values())
    for first, second in sessions.values():  # the second turn extends the first turn's prompt
        assert second[: len(first)] == first


class StuckAfter(Backend):
    """Answers episodes below ``limit`` at once and never answers the rest."""

    def __init__(self, inner, tokenizer, limit):
        self.inner, self.tokenizer, self.limit = inner, tokenizer, limit

    async def generate(self, prompt_ids, sampling, session_id=None):
        index = int(self.tokenizer.decode(prompt_ids).split("Episode ")[1].split(":")[0])
        if index >= self.limit:
            await asyncio.Event().wait()
        return await self.inner.generate(prompt_ids, sampling, session_id)


def test_interrupted_run_keeps_finished_episodes(tokenizer, tmp_path):
    out = tmp_path / "partial.jsonl"
    backend = StuckAfter(ScriptedBackend(turn_script(tokenizer, [call("echo", text="a"), "done"])), tokenizer, 5)

    async def interrupted():
        run = asyncio.create_task(run_rollouts(ToolTroubleTask(), backend, tokenizer, range(8), concurrency=8,
                                               output_path=out, progress=False))
        for _ in range(200):
            await asyncio.sleep(0.05)
            if out.exists() and len(out.read_text().splitlines()) == 5:
                break
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(interrupted())
    kept = read_trajectories(out)
    assert sorted(t.info["index"] for t in kept) == [0, 1, 2, 3, 4]
    assert all(t.reward == 1.0 for t in kept)


def test_a_backend_must_subclass_the_backend_base(tokenizer):
    class DuckTyped:  # generate alone is not the whole lifecycle (retries_itself, end_run, close, ...)
        async def generate(self, prompt_ids, sampling, session_id=None):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="DuckTyped is not a backend"):
        asyncio.run(run_episode(get_task("arithmetic"), 0, DuckTyped(), tokenizer))
