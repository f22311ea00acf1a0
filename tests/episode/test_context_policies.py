"""Context policies in the loop (issue 54 item 3): ``window``, ``summarize`` and ``drop_reasoning`` rewrite an
episode's history, and each rewrite starts a new segment of the episode's session on a fresh render of the kept
messages; the session is scored once on its whole chat, its reward and success on every segment, each segment
with its own turns' turn rewards.

Scripted replies on the real tiny-agent tokenizer and chat template (Qwen2.5's), and on the Qwen tokenizer with
QwQ's thinking template (which drops a turn's reasoning once tool results follow it).
"""

import asyncio
import dataclasses

import pytest
from transformers import AutoTokenizer

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.cli.flags import UsageError, validate
from agent_loop.cli.rollout import RolloutOptions
from agent_loop.episode.chat import TemplateError
from agent_loop.episode.context import SUMMARY_HEADER, digest, load_summarizer, windowed
from agent_loop.episode.contracts import StepResult, TurnEnvironment
from agent_loop.episode.loop import run_episode, run_session
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tools import ToolExecutor
from agent_loop.options import OptionError
from agent_loop.runners.local import run_rollouts
from agent_loop.runners.stats import RolloutStats
from agent_loop.tasks.plugins import PluginError
from agent_loop.types import Episode, Trajectory
from masking import SpanKind
from tests.helpers.echo_task import echo
from tests.helpers.scripted_turns import call
from tests.helpers.testdata import qwen_tokenizer_dir, read_template

A, O = SpanKind.ASSISTANT, SpanKind.OBSERVATION
WORDS = ["alpha", "beta", "gamma"]
TASK = "Echo alpha, beta and gamma, one call each, then say done."


class EchoThrice:
    """Three echo calls then "done": the reward counts the words echoed over the whole chat (a segment's own
    messages would hold fewer), the turn rewards number the turns."""

    name = "echo_thrice"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": TASK}], tools=[echo], answer="done")

    def reward(self, episode, messages, tool_calls):
        echoed = {m["content"] for m in messages if m["role"] == "tool"}
        return sum(w in echoed for w in WORDS) / len(WORDS) + float(messages[-1]["content"] == "done")

    def turn_rewards(self, episode, messages, tool_calls):
        return [0.1 * (k + 1) for k in range(sum(m["role"] == "assistant" for m in messages))]

    def success(self, episode, reward):
        return reward == 2.0


def counting_backend(tokenizer, replies):
    """Reply k on the episode's k-th request (one episode at a time: segments restart the prompt, so the turn
    cannot be read from it)."""
    asked = []

    def script(prompt_ids):
        asked.append(prompt_ids)
        return tokenizer.encode(replies[min(len(asked) - 1, len(replies) - 1)], add_special_tokens=False)
    return ScriptedBackend(script)


REPLIES = [call("echo", text=w) for w in WORDS] + ["done"]


def session(tokenizer, config, replies=REPLIES, task=None):
    return asyncio.run(run_session(task or EchoThrice(), 0, counting_backend(tokenizer, replies), tokenizer, config))


def render(tokenizer, messages, generation_prompt, tools=(echo,)):
    text = tokenizer.apply_chat_template(messages, tools=ToolExecutor(list(tools)).schemas, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_keep_is_one_segment_and_run_episode_gives_it(tiny_tokenizer):
    segments = session(tiny_tokenizer, LoopConfig(max_turns=4))
    alone = asyncio.run(run_episode(EchoThrice(), 0, counting_backend(tiny_tokenizer, REPLIES), tiny_tokenizer,
                                    LoopConfig(max_turns=4)))
    fields = ("prompt_ids", "response_ids", "spans", "turn_ids", "logprobs", "messages", "reward", "turn_rewards",
              "finish_reason", "info")
    assert len(segments) == 1
    assert [getattr(segments[0], f) for f in fields] == [getattr(alone, f) for f in fields]
    assert alone.segment == 0 and alone.finish_reason == "stop" and alone.reward == 2.0
    assert "context" not in alone.metrics  # keep records exactly what they recorded before


def test_window_one_starts_a_segment_per_cut_on_a_fresh_render_of_task_and_last_turn(tiny_tokenizer):
    segments = session(tiny_tokenizer, LoopConfig(max_turns=4, context="window", context_window=1))
    assert [s.segment for s in segments] == [0, 1, 2]
    assert len({s.session_id for s in segments}) == 1 and segments[0].session_id == "echo_thrice:0:0"
    assert [s.finish_reason for s in segments] == ["history_rewrite", "history_rewrite", "stop"]
    # segment 0 holds turns 0 and 1 (one turn in the window after turn 0: nothing cut), ending on turn 1's tokens
    assert [sorted(set(s.turn_ids)) for s in segments] == [[0, 1], [0], [0]]
    assert segments[0].spans[-1] == A and [s.metrics["turns"] for s in segments] == [2, 1, 1]
    task = {"role": "user", "content": TASK}
    for k, (before, after) in enumerate(zip(segments, segments[1:])):
        # the kept messages: the task, then the last turn (its assistant message and its tool result)
        last_turn = after.messages[1:3]
        assert after.messages[0] == task and [m["role"] for m in last_turn] == ["assistant", "tool"]
        assert last_turn[0] == before.messages[-1]  # the turn that closed the segment before
        assert last_turn[1]["content"] == WORDS[k + 1]
        assert after.prompt_ids == render(tiny_tokenizer, [task, *last_turn], True)  # a fresh render, exactly
    # each segment is token-in/token-out: its prompt and response are a render of its own messages
    for s in segments:
        full = render(tiny_tokenizer, s.messages, False)
        assert full[: len(s.prompt_ids) + len(s.response_ids)] == s.prompt_ids + s.response_ids
    # the session is scored once on its whole chat (a segment alone echoed at most two words); its turns keep
    # their own turn rewards, and every segment has the session's reward and success
    assert [s.reward for s in segments] == [2.0, 2.0, 2.0] and all(s.info["success"] for s in segments)
    assert [s.turn_rewards for s in segments] == [[0.1, 0.2], [pytest.approx(0.3)], [0.4]]
    assert [[(r.name, r.turn, r.result) for r in s.tool_calls] for s in segments] == [
        [("echo", 0, "alpha"), ("echo", 1, "beta")], [("echo", 0, "gamma")], []]
    assert [s.metrics["context"] for s in segments] == [
        {"policy": "window", "segment": n, "segments": 3} for n in range(3)]
    for s in segments:
        s.check()
        assert Trajectory.from_json(s.to_json()).segment == s.segment


def test_a_session_of_segments_refuses_run_episode_and_runs_through_the_runner(tiny_tokenizer, tmp_path):
    config = LoopConfig(max_turns=4, context="window", context_window=1)
    with pytest.raises(ValueError, match="context='window' rewrote its history into 3 segments.*run_session"):
        asyncio.run(run_episode(EchoThrice(), 0, counting_backend(tiny_tokenizer, REPLIES), tiny_tokenizer, config))
    out = tmp_path / "run.jsonl"
    got = asyncio.run(run_rollouts(EchoThrice(), counting_backend(tiny_tokenizer, REPLIES), tiny_tokenizer, [0],
                                   config, concurrency=1, output_path=out, progress=False))
    assert [(t.info["index"], t.segment) for t in got] == [(0, 0), (0, 1), (0, 2)]
    assert all(t.info["options"]["context"] == "window" for t in got)
    stats = RolloutStats()
    for t in got:
        stats.add(t)
    assert (stats.episodes, stats.segments, stats.successes, stats.turns) == (1, 3, 1, 4)


def big(n: int) -> str:
    """A long result.

    Args:
        n: How many words.
    """
    return " ".join(f"w{k}" for k in range(n))


class BigResults(EchoThrice):
    name = "big_results"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "Fetch twice, then say done."}], tools=[big], answer="done")

    def reward(self, episode, messages, tool_calls):
        return float(sum(m["role"] == "tool" for m in messages) == 2 and messages[-1]["content"] == "done")

    def success(self, episode, reward):
        return reward == 1.0


BIG_REPLIES = [call("big", n=8), call("big", n=40), "done"]
BIG_CONFIG = dict(max_turns=4, max_response_tokens=150, max_observation_tokens=200)


def short_summary(messages):
    return f"{sum(m['role'] == 'tool' for m in messages)} results so far"


def test_summarize_finishes_an_episode_that_keep_ends_in_observation_overflow(tiny_tokenizer):
    kept = session(tiny_tokenizer, LoopConfig(**BIG_CONFIG), BIG_REPLIES, BigResults())
    assert len(kept) == 1 and kept[0].finish_reason == "observation_overflow" and kept[0].reward == 0.0
    segments = session(tiny_tokenizer, LoopConfig(**BIG_CONFIG, context="summarize"), BIG_REPLIES, BigResults())
    assert [s.finish_reason for s in segments] == ["history_rewrite", "stop"]
    assert [s.reward for s in segments] == [1.0, 1.0] and all(s.info["success"] for s in segments)
    # the first segment is what keep played up to the overflow: the same tokens
    assert segments[0].prompt_ids == kept[0].prompt_ids and segments[0].response_ids == kept[0].response_ids
    # the summary (by default the digest of the tool results) joins the task; it is prompt, never trained
    task = segments[1].messages[0]
    assert task["content"].startswith("Fetch twice") and SUMMARY_HEADER in task["content"]
    assert '- big({"n": 40}) -> w0 w1' in task["content"] and segments[1].messages[1:] == [
        {"role": "assistant", "content": "done"}]
    assert segments[1].prompt_ids == render(tiny_tokenizer, segments[1].messages[:1], True, tools=[big])
    assert set(segments[1].spans) == {A} and segments[1].turn_rewards == [pytest.approx(0.3)]


def test_summarize_with_a_user_summarizer_and_a_token_budget(tiny_tokenizer):
    config = LoopConfig(max_turns=4, context="summarize", context_budget=220,
                        summarizer="tests.episode.test_context_policies:short_summary")
    segments = session(tiny_tokenizer, config, [call("big", n=5), call("big", n=6), call("big", n=7), "done"],
                       BigResults())
    # each time the next observation would take prompt + response past 220 tokens, a summary replaces the turns
    assert [s.finish_reason for s in segments] == ["history_rewrite", "history_rewrite", "stop"]
    assert [s.metrics["turns"] for s in segments] == [2, 1, 1]
    assert all(len(s.prompt_ids) + len(s.response_ids) <= 220 for s in segments)
    unbounded = session(tiny_tokenizer, dataclasses.replace(config, context_budget=0),
                        [call("big", n=5), call("big", n=6), call("big", n=7), "done"], BigResults())
    assert len(unbounded) == 1 and unbounded[0].finish_reason == "stop"  # the same episode fits the context
    assert segments[1].messages[0]["content"].endswith(f"{SUMMARY_HEADER}\n{len(segments[0].tool_calls)} results so far")
    # the next summary replaces that one (never stacked): one header, the count of segment 1's own results
    task = segments[2].messages[0]["content"]
    assert task.count(SUMMARY_HEADER) == 1 and task.endswith(f"{SUMMARY_HEADER}\n{len(segments[1].tool_calls)} results so far")


def test_summarizer_and_policy_options_are_checked():
    with pytest.raises(OptionError, match="summarizer no_colon: expected module:function"):
        LoopConfig(context="summarize", summarizer="no_colon")
    with pytest.raises(PluginError, match="no 'nothing'"):
        load_summarizer("tests.episode.test_context_policies:nothing")
    with pytest.raises(PluginError, match="is not a function"):
        load_summarizer("tests.episode.test_context_policies:WORDS")
    with pytest.raises(OptionError, match="summarizer tests.episode.test_context_policies:short_summary: is for "
                                          "context summarize, not keep"):
        LoopConfig(summarizer="tests.episode.test_context_policies:short_summary")
    with pytest.raises(OptionError, match="context_budget 100: is for context summarize, not window"):
        LoopConfig(context="window", context_budget=100)
    with pytest.raises(ValueError, match="context must be one of"):
        LoopConfig(context="fold")
    with pytest.raises(OptionError, match="context drop_reasoning: .*history_mode keep_seen .* pick one"):
        LoopConfig(context="drop_reasoning", history_mode="keep_seen")
    with pytest.raises(ValueError, match="no user message"):
        windowed([{"role": "system", "content": "s"}], 1)


def test_a_summarizer_that_returns_no_text_is_named(tiny_tokenizer):
    config = LoopConfig(**BIG_CONFIG, context="summarize", summarizer="tests.episode.test_context_policies:no_text")
    with pytest.raises(TypeError, match="summarizer returned int"):
        session(tiny_tokenizer, config, BIG_REPLIES, BigResults())


def no_text(messages):
    return 3


def test_digest_is_deterministic_and_keeps_the_latest_results_within_its_size():
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{k}", "type": "function", "function": {"name": "echo", "arguments": {"text": str(k)}}}]}
        for k in range(3)]
    messages = [m for k, a in enumerate(messages) for m in (a, {"role": "tool", "tool_call_id": f"c{k}", "content": f"r{k}"})]
    assert digest(messages) == '- echo({"text": "0"}) -> r0\n- echo({"text": "1"}) -> r1\n- echo({"text": "2"}) -> r2'
    assert digest(messages, max_chars=60) == ('(1 earlier results left out)\n- echo({"text": "1"}) -> r1\n'
                                              '- echo({"text": "2"}) -> r2')
    assert digest([]) == "(no tool results)"
    # a digest of a context that carries an earlier digest goes on from its lines and its count of left-out ones
    earlier = {"role": "user", "content": f"{SUMMARY_HEADER}\n{digest(messages[:4], max_chars=30)}"}
    assert earlier["content"].endswith('(1 earlier results left out)\n- echo({"text": "1"}) -> r1')
    assert digest([earlier, *messages[4:]]) == ('(1 earlier results left out)\n- echo({"text": "1"}) -> r1\n'
                                                '- echo({"text": "2"}) -> r2')
    assert digest([{"role": "user", "content": f"{SUMMARY_HEADER}\n(no tool results)"}]) == "(no tool results)"


def test_summaries_replace_each_other_and_the_digest_keeps_every_result(tiny_tokenizer):
    """A later rewrite replaces the earlier summary in the task (the context stays bounded however often it is
    rewritten) and the digest carries the earlier summary's lines: no result is lost."""
    config = LoopConfig(max_turns=5, context="summarize", context_budget=220)
    replies = [call("big", n=5), call("big", n=6), call("big", n=7), "done"]
    segments = session(tiny_tokenizer, config, replies, BigResults())
    assert len(segments) >= 3, [s.finish_reason for s in segments]
    results = [r for s in segments for r in s.tool_calls]
    for before, after in zip(segments, segments[1:]):
        task = after.messages[0]["content"]
        assert task.count(SUMMARY_HEADER) == 1 and task.startswith("Fetch twice, then say done.")
        lines = task.split(f"{SUMMARY_HEADER}\n", 1)[1].splitlines()
        played = [r for s in segments[: segments.index(after)] for r in s.tool_calls]
        assert len(lines) == len(played) and all(line.endswith(f"-> {r.result}") for line, r in zip(lines, played))
    assert len(results) == 3


QWQ_REPLY = 'I think.\n</think>\n\n<tool_call>\n{"name": "echo", "arguments": {"text": "a"}}\n</tool_call><|im_end|>'


class EchoTwice(EchoThrice):
    name = "echo_twice"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "Echo twice."}], tools=[echo], answer="done")

    def reward(self, episode, messages, tool_calls):
        return float(sum(m["role"] == "tool" for m in messages) == 2 and "done" in messages[-1]["content"])

    def success(self, episode, reward):
        return reward == 1.0


def test_drop_reasoning_starts_a_segment_where_a_thinking_template_drops_earlier_reasoning():
    """QwQ (a Qwen thinking template) drops a tool-calling turn's reasoning once its results follow: strict refuses,
    keep_seen drifts from how the model is served; drop_reasoning starts a new segment on the template's own render,
    so every segment is exact and no later context holds reasoning the template would have dropped."""
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.chat_template = read_template("qwq-32b.jinja")
    replies = [QWQ_REPLY, QWQ_REPLY, "</think>\n\ndone<|im_end|>"]
    with pytest.raises(TemplateError, match="rewrites the earlier text"):
        session(tok, LoopConfig(), replies, EchoTwice())
    drift = session(tok, LoopConfig(history_mode="keep_seen"), replies, EchoTwice())
    assert len(drift) == 1 and drift[0].metrics["template_drift"] == 3
    segments = session(tok, LoopConfig(context="drop_reasoning"), replies, EchoTwice())
    assert [s.finish_reason for s in segments] == ["history_rewrite", "history_rewrite", "stop"]
    assert [s.reward for s in segments] == [1.0] * 3 and [s.turn_rewards for s in segments] == [[0.1], [0.2], [
        pytest.approx(0.3)]]
    for s in segments:
        assert s.metrics["template_exact"] and s.metrics["template_mismatch"] == 0 and s.metrics["template_drift"] == 0
        # the prompt is the template's render of the chat so far, as served: no earlier turn's reasoning in it
        assert s.prompt_ids == render(tok, s.messages[:-1], True)
        assert "I think." not in tok.decode(s.prompt_ids)
        assert tok.decode(s.response_ids).count("I think.") == (s.segment < 2)
    assert [len(s.messages) for s in segments] == [2, 4, 6]  # the whole chat, each context one turn longer


class Guessing(TurnEnvironment):
    """A game that answers each guess with a user message: "higher" until the second guess."""

    def __init__(self):
        self.guesses = 0

    def step(self, turn, limits):
        self.guesses += 1
        return StepResult(observations=[{"role": "user", "content": "higher"}], done=self.guesses == 2)


class GuessTask(EchoThrice):
    name = "guess"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "Guess my number."}], tools=[], environment=Guessing(), answer="2")

    def reward(self, episode, messages, tool_calls):
        return float(sum(m["role"] == "assistant" for m in messages) == 2)


def test_drop_reasoning_runs_qwen3_as_served_where_a_user_turn_drops_the_reasoning_before_it():
    """Qwen3 renders an assistant turn's reasoning only after the last user message: once the environment answers
    with a user message, the turn's reasoning is gone from the render. drop_reasoning starts the next segment on
    that render (strict refuses the template for user observations, keep_seen would train turn 1 on a context
    with reasoning that the served model never sees)."""
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.chat_template = read_template("qwen3-0.6b.jinja")
    replies = ["<think>\nlow first\n</think>\n\n1<|im_end|>", "<think>\nthen two\n</think>\n\n2<|im_end|>"]
    with pytest.raises(TemplateError, match="rewrites the earlier text"):
        session(tok, LoopConfig(), replies, GuessTask())
    segments = session(tok, LoopConfig(context="drop_reasoning"), replies, GuessTask())
    assert [s.finish_reason for s in segments] == ["history_rewrite", "stop"]
    assert [s.reward for s in segments] == [1.0, 1.0] and [s.turn_rewards for s in segments] == [[0.1], [0.2]]
    second = tok.decode(segments[1].prompt_ids)
    assert "low first" not in second and second.endswith("higher<|im_end|>\n<|im_start|>assistant\n")
    assert segments[1].prompt_ids == tok(tok.apply_chat_template(segments[1].messages[:-1], tokenize=False,
                                                                 add_generation_prompt=True),
                                         add_special_tokens=False)["input_ids"]
    assert all(s.metrics["template_exact"] for s in segments)


def test_the_commands_name_a_broken_context_rule_as_flags():
    with pytest.raises(UsageError, match="^--context-budget 5: is for --context summarize, not window$"):
        validate(RolloutOptions, {"context": "window", "context_budget": "5"})
    with pytest.raises(UsageError, match="^--summarizer nomodule: expected module:function"):
        validate(RolloutOptions, {"context": "summarize", "summarizer": "nomodule"})
    assert validate(RolloutOptions, {"context": "window", "context_window": "1"}).context_window == 1


def test_max_context_tokens_bounds_each_context_and_a_window_plays_on_past_it(tiny_tokenizer):
    """``max_context_tokens`` (issue 54 item 5's small context): a turn asks for no more than the context has left;
    with keep the episode ends in observation_overflow where the next observation would not fit, a window
    starts a new segment there instead and the session finishes, every segment within the bound."""
    whole = session(tiny_tokenizer, LoopConfig(max_turns=4))[0]
    # room for turn 1's reply but not for its observation: its last ASSISTANT token's position, plus 1
    turn_1 = max(i for i, (s, t) in enumerate(zip(whole.spans, whole.turn_ids)) if s == A and t == 1)
    limit = len(whole.prompt_ids) + turn_1 + 2
    assert limit < len(whole.prompt_ids) + len(whole.response_ids)
    kept = session(tiny_tokenizer, LoopConfig(max_turns=4, max_context_tokens=limit))
    assert len(kept) == 1 and kept[0].finish_reason == "observation_overflow" and kept[0].reward < 2.0
    assert len(kept[0].prompt_ids) + len(kept[0].response_ids) <= limit
    windowed_ = session(tiny_tokenizer, LoopConfig(max_turns=4, max_context_tokens=limit, context="window",
                                                   context_window=1))
    assert windowed_[-1].finish_reason == "stop" and windowed_[-1].reward == 2.0 and len(windowed_) > 1
    assert all(len(s.prompt_ids) + len(s.response_ids) <= limit for s in windowed_)
    asked = []
    backend = ScriptedBackend(lambda prompt: asked.append(prompt) or [])
    short = dataclasses.replace(LoopConfig(max_turns=1), max_context_tokens=len(whole.prompt_ids))
    refused = asyncio.run(run_episode(EchoThrice(), 0, backend, tiny_tokenizer, short))
    assert refused.finish_reason == "error" and asked == []  # no room for a single token: nothing generated
    assert refused.metrics["backend_error"] == (f"ContextLengthError: turn 0: the prompt of {len(whole.prompt_ids)} "
                                                f"tokens leaves no room in --max-context-tokens of {len(whole.prompt_ids)} tokens")
