"""The environment-driven turn (agent_loop.episode.contracts.TurnEnvironment) on the tiny agent's real tokenizer
and chat template, with scripted replies: observations as OBSERVATION spans, per-turn rewards, done/truncated,
metadata, token-in/token-out exactness, and every way an environment can fail (raises, hangs, wrong type)."""

import asyncio
import threading
import time

import pytest
import torch

from agent_loop.backends.scripted import ScriptedBackend, scripted_logprob
from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.contracts import AssistantTurn, StepLimits, StepResult, Task, TurnEnvironment
from agent_loop.episode.loop import run_episode, with_step_rewards
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tools import ToolEnvironment
from agent_loop.tasks.registry import get_task
from agent_loop.types import Episode, Trajectory
from masking import SpanKind
from masking.rewards import place_rewards

A, O = SpanKind.ASSISTANT, SpanKind.OBSERVATION


class GuessEnv(TurnEnvironment):
    """Guess a number: each wrong guess is told "higher"/"lower" (a user message) with reward -0.1; the right
    one ends the episode with reward 1. Records every turn it was given, and whether it was closed."""

    def __init__(self, secret: int, max_guesses: int = 10):
        self.secret, self.max_guesses, self.turns, self.closed = secret, max_guesses, [], 0

    def step(self, turn: AssistantTurn, limits: StepLimits) -> StepResult:
        self.turns.append(turn)
        guess = int(turn.text.split()[-1])
        if guess == self.secret:
            return StepResult(reward=1.0, done=True, metadata={"guess": guess})
        if len(self.turns) >= self.max_guesses:
            return StepResult(reward=-0.1, truncated=True, metadata={"guess": guess})
        hint = "higher" if guess < self.secret else "lower"
        return StepResult([{"role": "user", "content": f"{hint} than {guess}"}], reward=-0.1, metadata={"guess": guess})

    def close(self) -> None:
        self.closed += 1


class EnvTask(Task):
    """Episodes answered by ``make_env()``; the task's own outcome reward is ``bonus``."""

    name = "env-task"

    def __init__(self, make_env, bonus: float = 0.0):
        self.make_env, self.bonus, self.envs = make_env, bonus, []

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        self.envs.append(self.make_env())
        return Episode(messages=[{"role": "user", "content": "Guess my number."}], tools=[], environment=self.envs[-1])

    def reward(self, episode, messages, tool_calls) -> float:
        return self.bonus


def play(tokenizer, task, replies, **config):
    def script(prompt_ids):
        turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return tokenizer.encode(replies[min(turn, len(replies) - 1)])

    config = LoopConfig(**{"tool_timeout_s": 0.5, "max_turns": 6, **config})
    return asyncio.run(run_episode(task, 0, ScriptedBackend(script), tokenizer, config))


def runs(trajectory):
    out = []
    for span, turn in zip(trajectory.spans, trajectory.turn_ids):
        if not out or out[-1][:2] != [span, turn]:
            out.append([span, turn, 0])
        out[-1][2] += 1
    return out


def test_environment_turns_rewards_spans_and_exact_tokens(tiny_tokenizer):
    task = EnvTask(lambda: GuessEnv(7), bonus=0.25)
    traj = play(tiny_tokenizer, task, ["I guess 3", "I guess 9", "I guess 7"])
    env = task.envs[0]
    assert traj.finish_reason == "stop" and env.closed == 1
    assert [t.text for t in env.turns] == ["I guess 3", "I guess 9", "I guess 7"]
    assert [t.final for t in env.turns] == [False, False, False] and env.turns[0].calls == []
    # the observations are the environment's messages, rendered by the template, as OBSERVATION spans
    assert [(s, t) for s, t, _ in runs(traj)] == [(A, 0), (O, 0), (A, 1), (O, 1), (A, 2)]
    first_obs = runs(traj)[1]
    start = runs(traj)[0][2]
    assert tiny_tokenizer.decode(traj.response_ids[start:start + first_obs[2]]) == \
        "\n<|im_start|>user\nhigher than 3<|im_end|>\n<|im_start|>assistant\n"
    assert [m["content"] for m in traj.messages if m["role"] == "user"][1:] == ["higher than 3", "lower than 9"]
    # token-in/token-out: prompt + response are the template's one-go render of the recorded chat
    render = ChatFormatter(tiny_tokenizer).render(traj.messages)
    ids = traj.prompt_ids + traj.response_ids
    assert render[: len(ids)] == ids and tiny_tokenizer.decode(render[len(ids):]).strip() == ""
    assert traj.metrics["template_exact"] and traj.metrics["template_mismatch"] == 0
    assert all(lp == (scripted_logprob(t) if s == A else 0.0) for t, s, lp in zip(traj.response_ids, traj.spans, traj.logprobs))
    # per-turn rewards: earlier steps are turn rewards, the last step joins the task's outcome reward
    assert traj.turn_rewards == [-0.1, -0.1, 0.0] and traj.reward == pytest.approx(1.25) and traj.info["success"]
    assert [s["metadata"]["guess"] for s in traj.info["steps"]] == [3, 9, 7]
    assert [s["done"] for s in traj.info["steps"]] == [False, False, True]
    traj.check()
    assert Trajectory.from_json(traj.to_json()) == traj


def test_step_rewards_land_where_each_step_would_put_them(tiny_tokenizer):
    """Serial reference: each step's reward on its own turn's last ASSISTANT token, the task's on the last one."""
    traj = play(tiny_tokenizer, EnvTask(lambda: GuessEnv(7), bonus=0.25), ["I guess 3", "I guess 9", "I guess 7"])
    spans, turns = torch.tensor([traj.spans]), torch.tensor([traj.turn_ids])
    placed = place_rewards(spans, torch.tensor([traj.reward]), turns, torch.tensor([traj.turn_rewards]))[0]
    expected = [0.0] * len(traj.spans)
    for step in traj.info["steps"]:
        last = max(i for i, (s, t) in enumerate(zip(traj.spans, traj.turn_ids)) if s == A and t == step["turn"])
        expected[last] += step["reward"]
    expected[max(i for i, s in enumerate(traj.spans) if s == A)] += 0.25
    assert placed.tolist() == pytest.approx(expected)


def test_with_step_rewards_rule():
    assert with_step_rewards(0.5, None, [None, None]) == (0.5, None)  # the tool environment changes nothing
    assert with_step_rewards(0.5, [1.0, 2.0], [None, None]) == (0.5, [1.0, 2.0])
    assert with_step_rewards(0.5, None, [0.1, None, 0.3]) == (pytest.approx(0.8), [0.1, 0.0, 0.0])
    assert with_step_rewards(0.0, [1.0, 1.0], [0.5, 2.0]) == (2.0, [1.5, 1.0])


def test_truncated_and_the_loops_last_turn(tiny_tokenizer):
    task = EnvTask(lambda: GuessEnv(7, max_guesses=2))
    traj = play(tiny_tokenizer, task, ["I guess 1", "I guess 2"])
    assert traj.finish_reason == "max_turns" and traj.info["steps"][-1]["truncated"]
    assert traj.turn_rewards == [-0.1, 0.0] and traj.reward == pytest.approx(-0.1)
    # the loop's own max_turns: the last turn is stepped with final=True, its observation is not appended
    task = EnvTask(lambda: GuessEnv(7))
    traj = play(tiny_tokenizer, task, ["I guess 1"], max_turns=2)
    assert traj.finish_reason == "max_turns" and [t.final for t in task.envs[0].turns] == [False, True]
    assert [(s, t) for s, t, _ in runs(traj)] == [(A, 0), (O, 0), (A, 1)]


def test_a_turn_cut_by_its_token_budget_is_stepped_as_final(tiny_tokenizer):
    class Recorder(GuessEnv):
        def step(self, turn, limits):
            self.turns.append(turn)
            return StepResult([{"role": "user", "content": "go on"}], reward=0.5)

    task = EnvTask(lambda: Recorder(7))
    traj = play(tiny_tokenizer, task, ["I guess " + "1" * 40], max_tokens=4)
    assert traj.finish_reason == "length" and traj.reward == 0.5  # its step's reward counts
    assert [(t.final, t.finish_reason) for t in task.envs[0].turns] == [(True, "length")]


class Broken(TurnEnvironment):
    def __init__(self, how):
        self.how, self.closed = how, 0

    def step(self, turn, limits):
        if self.how == "raises":
            raise KeyError("no such state")
        if self.how == "hangs":
            threading.Event().wait(60)
        return {"none": None, "dict": {"observations": [], "reward": 1.0, "done": True},
                "bad_observation": StepResult([{"role": "user", "content": 5}]),
                "nan": StepResult(reward=float("nan"), done=True),
                "done_str": StepResult(done="yes"),
                "silent": StepResult(reward=0.0)}[self.how]

    def close(self):
        self.closed += 1


class AsyncHang(TurnEnvironment):
    closed = 0

    async def step(self, turn, limits):
        await asyncio.sleep(60)

    async def close(self):
        AsyncHang.closed += 1


@pytest.mark.parametrize("how, reason", [
    ("raises", "step failed: KeyError: 'no such state'"),
    ("hangs", "step took longer than 0.5 s (tool_timeout_s)"),
    ("none", "step returned NoneType None, not a StepResult"),
    ("dict", "step returned dict"),
    ("bad_observation", "observations must be a list of messages with a string role and content"),
    ("nan", "returned nan, not a finite number"),
    ("done_str", "done and .truncated must be bools"),
    ("silent", "neither ended the episode (done) nor gave an observation"),
])
def test_a_failing_environment_ends_the_episode_as_an_error(tiny_tokenizer, how, reason):
    task = EnvTask(lambda: Broken(how))
    started = time.perf_counter()
    traj = play(tiny_tokenizer, task, ["I guess 1"])
    assert time.perf_counter() - started < 20  # a hung step costs its timeout, not the hang
    assert traj.finish_reason == "error" and reason in traj.metrics["error"]
    assert traj.metrics["error"].startswith(("EnvironmentError: turn 0: Broken", "EnvironmentTimeout: turn 0: Broken"))
    assert "backend_error" not in traj.metrics and task.envs[0].closed == 1
    assert traj.spans == [A] * len(traj.spans)  # the turn's tokens are kept, no observation
    traj.check()


def test_an_async_step_that_hangs_is_bounded(tiny_tokenizer):
    traj = play(tiny_tokenizer, EnvTask(AsyncHang), ["I guess 1"])
    assert traj.finish_reason == "error" and "took longer than 0.5 s" in traj.metrics["error"] and AsyncHang.closed == 1


def test_close_that_raises_is_recorded_not_raised(tiny_tokenizer):
    class BadClose(GuessEnv):
        def close(self):
            raise OSError("disk gone")

    traj = play(tiny_tokenizer, EnvTask(lambda: BadClose(1)), ["I guess 1"])
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    assert traj.info["environment_close_error"] == "OSError: disk gone"


def test_an_episode_has_tools_or_an_environment(tiny_tokenizer):
    class Both(EnvTask):
        def make_episode(self, index, seed=0):
            episode = super().make_episode(index, seed)
            episode.tools = [get_task("arithmetic").make_episode(0).tools[0]]
            return episode

    with pytest.raises(ValueError, match="tools or an environment, not both"):
        play(tiny_tokenizer, Both(lambda: GuessEnv(1)), ["I guess 1"])
    with pytest.raises(TypeError, match="must be a TurnEnvironment"):
        play(tiny_tokenizer, EnvTask(lambda: object()), ["I guess 1"])


def test_tool_environment_is_the_tool_executor(tiny_tokenizer):
    """The default environment: calls run as tools and answer as tool messages; none ends the episode; a final
    turn's calls are not run."""
    calculator = get_task("arithmetic").make_episode(0).tools[0]
    env = ToolEnvironment([calculator])
    limits = StepLimits(timeout_s=2.0, max_parallel=2, max_result_chars=100)
    from agent_loop.episode.parsers import ParsedCall

    turn = AssistantTurn(0, "", "", [ParsedCall("calculator", {"expression": "6*7"})], ["call_0"], False, "stop")
    result = asyncio.run(env.step(turn, limits))
    assert result.observations == [{"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": "42"}]
    assert result.reward is None and not result.done and result.tool_calls[0].call_id == "call_0"
    assert asyncio.run(env.step(AssistantTurn(1, "42", "42", [], [], False, "stop"), limits)).done
    final = asyncio.run(env.step(AssistantTurn(1, "", "", turn.calls, ["call_1"], True, "stop"), limits))
    assert final.tool_calls == [] and final.observations == [] and not final.done
    closed = []
    asyncio.run(ToolEnvironment([calculator], on_close=[lambda: closed.append(1)]).close())
    assert closed == [1] and env.tool_schemas[0]["function"]["name"] == "calculator"
