"""``--context summarize --summarizer policy`` (issue 54 item 3): the policy writes the summary itself, asked with
``--summary-prompt``; the request is OBSERVATION and the summary ASSISTANT tokens (trained, with their logprobs) of
the segment they close, the next segment starts from the head with the summary and the latest turn verbatim, and
the task scores the session's chat, which never holds the request or the summary.

Scripted replies on the real tiny-agent tokenizer and chat template (Qwen2.5's): the backend answers a prompt that
ends with the summary request with the summary, every other prompt with the next scripted turn.
"""

import asyncio
import dataclasses

import pytest
import torch

from advantages import get_estimator
from agent_loop.backends.scripted import ScriptedBackend, scripted_logprob
from agent_loop.cli.flags import UsageError, validate
from agent_loop.cli.rollout import RolloutOptions
from agent_loop.episode import loop
from agent_loop.episode.context import SUMMARY_HEADER, with_summary
from agent_loop.episode.loop import request_seed, run_session
from agent_loop.episode.loop_config import SUMMARY_PROMPT, LoopConfig
from agent_loop.options import OptionError
from agent_loop.runners.batch import trajectories_to_batch, turn_state_ids
from agent_loop.types import Trajectory
from masking import SpanKind
from tests.episode.test_context_policies import BIG_CONFIG, REPLIES, BigResults, EchoThrice, big, render
from tests.helpers.echo_task import echo
from tests.helpers.scripted_turns import call

A, O = SpanKind.ASSISTANT, SpanKind.OBSERVATION
ASK = "Summarize."
SUMMARY = "Fetched 8, then 40 words."
POLICY = dict(context="summarize", summarizer="policy", summary_prompt=ASK, summary_tokens=20)


class PolicyBackend(ScriptedBackend):
    """The scripted turns in order; to the summary request (a prompt ending with it) ``summary``, or ``fail`` raised.
    Records each request's sampling and session id; every answer carries policy version ``version``."""

    def __init__(self, tokenizer, replies, summary=SUMMARY, fail=None, version=7):
        self.sampled, self.version, turns = [], version, []
        request_end = f"{ASK}<|im_end|>\n<|im_start|>assistant\n"

        def script(prompt_ids):
            if tokenizer.decode(prompt_ids).endswith(request_end):
                if fail is not None:
                    raise fail
                return tokenizer.encode(summary, add_special_tokens=False)
            turns.append(prompt_ids)
            return tokenizer.encode(replies[min(len(turns) - 1, len(replies) - 1)], add_special_tokens=False)
        super().__init__(script)

    async def generate(self, prompt_ids, sampling, session_id=None):
        self.sampled.append((sampling, session_id))
        return (await super().generate(prompt_ids, sampling, session_id))._replace(policy_version=self.version)


class Recording(BigResults):
    """BigResults that keeps the chat each scoring hook was given."""

    def __init__(self):
        self.chats = []

    def reward(self, episode, messages, tool_calls):
        self.chats.append([dict(m) for m in messages])
        return super().reward(episode, messages, tool_calls)


BIG_REPLIES = [call("big", n=8), call("big", n=40), "done"]


def play(tokenizer, config, replies=BIG_REPLIES, task=None, **backend):
    backend = PolicyBackend(tokenizer, replies, **backend)
    segments = asyncio.run(run_session(task or BigResults(), 0, backend, tokenizer, config))
    return segments, backend


def exact(tokenizer, segments, tools):
    """Every segment is token-in/token-out: its prompt and response are the start of a render of its messages (with
    the generation prompt where they end on an observation: a generation that failed)."""
    for s in segments:
        full = render(tokenizer, s.messages, s.messages[-1]["role"] != "assistant", tools=tools)
        assert full[: len(s.prompt_ids) + len(s.response_ids)] == s.prompt_ids + s.response_ids
        assert s.metrics["template_exact"] and s.metrics["template_rerender_diffs"] == 0
        s.check()
        assert Trajectory.from_json(s.to_json()).response_ids == s.response_ids


def test_the_policy_writes_the_summary_as_a_trained_turn_that_closes_its_segment(tiny_tokenizer):
    """Turn 1's 40 words do not fit: the request follows turn 1's assistant message (its result does not fit with
    it), the policy's summary is ASSISTANT tokens of a turn of its own, and the next segment is the task with the
    summary, then turn 1 and its result verbatim."""
    task = Recording()
    segments, backend = play(tiny_tokenizer, LoopConfig(**BIG_CONFIG, **POLICY), task=task)
    first, second = segments
    assert [s.finish_reason for s in segments] == ["history_rewrite", "stop"]
    # the closing segment's messages: ..., turn 1 (its calls), the request, the summary as the policy replied
    assert [m["role"] for m in first.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert first.messages[-2:] == [{"role": "user", "content": ASK}, {"role": "assistant", "content": SUMMARY}]
    assert first.metrics["context"]["summary"] == {"turn": 2, "request_tokens": first.metrics["context"]["summary"][
        "request_tokens"], "tokens": len(tiny_tokenizer.encode(SUMMARY)) + 1, "finish": "stop", "after_results": False}
    # its tokens: the request is turn 1's OBSERVATION, the summary ASSISTANT tokens of turn 2 with their logprobs
    summary_ids = tiny_tokenizer.encode(SUMMARY, add_special_tokens=False) + [backend.sampled[0][0].stop_token_ids[0]]
    request = first.metrics["context"]["summary"]["request_tokens"]
    tail = slice(-len(summary_ids) - request, None)
    assert tiny_tokenizer.decode(first.response_ids[tail]) == (f"\n<|im_start|>user\n{ASK}<|im_end|>\n"
                                                                 f"<|im_start|>assistant\n{SUMMARY}<|im_end|>")
    assert first.spans[tail] == [O] * request + [A] * len(summary_ids)
    assert first.turn_ids[tail] == [1] * request + [2] * len(summary_ids)
    assert first.response_ids[-len(summary_ids):] == summary_ids
    assert first.logprobs[-len(summary_ids):] == [scripted_logprob(t) for t in summary_ids]
    assert first.policy_versions[-len(summary_ids):] == [7] * len(summary_ids)
    assert first.policy_versions[tail][:request] == [-1] * request
    # the summary turn's own turn reward is 0 (the session's return reaches it); the task's turns keep theirs
    assert [s.turn_rewards for s in segments] == [[0.1, 0.2, 0.0], [pytest.approx(0.3)]]
    # the next segment: a fresh render of the task with the summary, then turn 1 and its result as they were
    task_message, turn_1, result_1 = second.messages[:3]
    assert task_message["content"] == f"Fetch twice, then say done.\n\n{SUMMARY_HEADER}\n{SUMMARY}"
    assert second.messages[:3] == with_summary(first.messages[:1], SUMMARY, [first.messages[3], result_1])
    assert turn_1 == first.messages[3] and result_1["role"] == "tool" and result_1["content"].startswith("w0 w1")
    assert second.prompt_ids == render(tiny_tokenizer, second.messages[:3], True, tools=[big])
    assert second.messages[3:] == [{"role": "assistant", "content": "done"}] and set(second.spans) == {A}
    exact(tiny_tokenizer, segments, [big])
    # the session is scored once, on a chat without the request or the summary: its last message is the answer
    assert [s.reward for s in segments] == [1.0, 1.0] and all(s.info["success"] for s in segments)
    assert [[m["role"] for m in chat] for chat in task.chats] == [
        ["user", "assistant", "tool", "assistant", "tool", "assistant"]]
    assert not any(m["content"] in (ASK, SUMMARY) for m in task.chats[0])
    # one session id; the summary's request: its own seed, --summary-tokens, the episode's sampling otherwise
    (turn_0, _), (turn_1_sampling, _), (asked, session_id), (turn_2, _) = backend.sampled
    assert {sid for _, sid in backend.sampled} == {session_id} == {"big_results:0:0"}
    assert asked.seed == request_seed(0, 0, -2) not in {turn_0.seed, turn_1_sampling.seed, turn_2.seed}
    assert turn_2.seed == request_seed(0, 0, 2)
    assert asked.max_tokens == 20 and (asked.temperature, asked.top_p) == (turn_0.temperature, turn_0.top_p)


def test_every_turn_leaves_room_for_the_summary_and_a_long_summary_is_cut_at_summary_tokens(tiny_tokenizer):
    """A turn asks for no more than the segment's room less the request and the summary (the reserve), so the
    summary always fits after the latest assistant turn; the rewrite comes where a next turn would cut into it. A
    summary that reaches --summary-tokens ends there (finish "length") and is used as written."""
    config = LoopConfig(**BIG_CONFIG, **POLICY)
    segments, backend = play(tiny_tokenizer, config, summary="Fetched 8, then 40 words; all that is left is done.")
    summary = segments[0].metrics["context"]["summary"]
    assert backend.sampled[0][0].max_tokens == config.max_response_tokens - (summary["request_tokens"] + 20)
    assert (summary["tokens"], summary["finish"]) == (20, "length")
    cut = tiny_tokenizer.decode(segments[0].response_ids[-20:])
    assert segments[0].messages[-1] == {"role": "assistant", "content": cut}
    assert segments[1].messages[0]["content"].endswith(f"{SUMMARY_HEADER}\n{cut}")
    assert [s.finish_reason for s in segments] == ["history_rewrite", "stop"] and segments[1].reward == 1.0
    assert all(len(s.response_ids) <= config.max_response_tokens for s in segments)
    exact(tiny_tokenizer, segments, [big])


def test_the_request_follows_the_latest_results_where_they_fit(tiny_tokenizer):
    """At --context-budget, with room to spare: the request follows the latest tool results (the summary sees them)
    and the latest turn still opens the next segment verbatim."""
    keep = asyncio.run(run_session(EchoThrice(), 0, PolicyBackend(tiny_tokenizer, REPLIES), tiny_tokenizer,
                                   LoopConfig(max_turns=4)))[0]
    turn_1_end = max(i for i, t in enumerate(keep.turn_ids) if t == 1)
    budget = len(keep.prompt_ids) + turn_1_end  # passed by turn 1's observation, not by turn 0's
    config = LoopConfig(max_turns=4, context_budget=budget, **POLICY)
    segments, _ = play(tiny_tokenizer, config, REPLIES, EchoThrice(), summary="Echoed alpha and beta.")
    assert segments[0].finish_reason == "history_rewrite" and segments[-1].finish_reason == "stop"
    first, second = segments[:2]
    assert [m["role"] for m in first.messages[-4:]] == ["assistant", "tool", "user", "assistant"]
    assert first.messages[-3]["content"] == "beta" and first.metrics["context"]["summary"]["after_results"]
    assert second.messages[1:3] == first.messages[-4:-2]  # turn 1 and its result, verbatim
    assert second.messages[0]["content"].endswith(f"{SUMMARY_HEADER}\nEchoed alpha and beta.")
    assert second.prompt_ids == render(tiny_tokenizer, second.messages[:3], True)
    exact(tiny_tokenizer, segments, [echo])
    assert all(s.reward == 2.0 and s.info["success"] for s in segments)
    assert segments[0].turn_rewards == [0.1, 0.2, 0.0]


class Keyed(BigResults):
    """BigResults whose turns have state keys (GiGPO's anchors)."""

    def turn_states(self, episode, messages, tool_calls):
        return [f"after {k} results" for k in range(sum(m["role"] == "assistant" for m in messages))]


def test_the_summary_turn_has_a_turn_state_and_the_rows_batch(tiny_tokenizer):
    segments, _ = play(tiny_tokenizer, LoopConfig(**BIG_CONFIG, **POLICY), task=Keyed())
    assert [s.info["turn_states"] for s in segments] == [
        ["after 0 results", "after 1 results", ("summary", "after 1 results")], ["after 2 results"]]
    ids = turn_state_ids(segments)  # one key per ASSISTANT turn of each row, the summary's included
    assert ids.tolist() == [[0, 1, 2], [3, -1, -1]]


def test_the_summary_tokens_are_trained_on_the_sessions_return(tiny_tokenizer):
    """In the batch the summary is in the loss mask (the request is not), and carry-through across the session's
    segments gives it the return of what followed it: the next segment's turn reward (0.3) and the outcome (1.0)."""
    segments, _ = play(tiny_tokenizer, LoopConfig(**BIG_CONFIG, **POLICY))
    batch = trajectories_to_batch(segments, dtype=torch.float64)
    assert batch.session.tolist() == [0, 0] and batch.segment.tolist() == [0, 1]
    _, returns = get_estimator("reinforce_plus_plus")(batch.token_level_rewards, batch.response_mask, spans=batch.spans,
                                                      session=batch.session, segment=batch.segment, gamma=1.0,
                                                      whiten=False)
    n, summary = len(segments[0].response_ids), segments[0].metrics["context"]["summary"]
    request = slice(n - summary["tokens"] - summary["request_tokens"], n - summary["tokens"])
    assert batch.response_mask[0, n - summary["tokens"]:n].tolist() == [1] * summary["tokens"]
    assert batch.response_mask[0, request].tolist() == [0] * summary["request_tokens"]
    assert returns[0, n - summary["tokens"]:n].tolist() == pytest.approx([1.3] * summary["tokens"])


def test_a_backend_failure_while_summarizing_ends_the_episode_with_an_error(tiny_tokenizer):
    config = LoopConfig(**BIG_CONFIG, **POLICY, backend_retries=0)
    segments, _ = play(tiny_tokenizer, config, fail=RuntimeError("server gone"))
    assert len(segments) == 1 and segments[0].finish_reason == "error"
    failed = segments[0]
    assert failed.metrics["backend_error"] == ("SummaryError: turn 1: the policy's summary failed: RuntimeError: "
                                               "server gone")
    # the request was seen (its OBSERVATION tokens end the record, as after any failed generation); nothing sampled
    assert failed.messages[-1] == {"role": "user", "content": ASK} and failed.spans[-1] == O
    assert tiny_tokenizer.decode(failed.response_ids).endswith(f"{ASK}<|im_end|>\n<|im_start|>assistant\n")
    assert failed.reward == 0.0 and "summary" not in failed.metrics["context"]
    exact(tiny_tokenizer, segments, [big])


def test_no_room_for_the_summary_is_an_observation_overflow_that_says_why(tiny_tokenizer, monkeypatch):
    """The reserve keeps room for the request the template writes after an assistant turn; where the request costs
    more than that (here: a long request, whose reserve is measured as if it cost nothing), the episode ends in
    observation_overflow, ``metrics["context"]["summary"]["overflow"]`` saying why, nothing of the request appended."""
    monkeypatch.setattr(loop, "_request_tokens", lambda *args: 0)
    segments, backend = play(tiny_tokenizer, LoopConfig(**BIG_CONFIG, **{**POLICY, "summary_prompt": SUMMARY_PROMPT}))
    assert len(segments) == 1 and segments[0].finish_reason == "observation_overflow"
    assert segments[0].metrics["context"]["summary"]["overflow"].startswith(
        "turn 1: no room for the policy's summary of 20 tokens and its request in the ")
    assert len(backend.sampled) == 2 and segments[0].spans[-1] == A and segments[0].messages[-1]["role"] == "tool"


def test_a_segment_whose_prompt_leaves_no_room_beside_the_summary_is_refused_before_generating(tiny_tokenizer):
    config = LoopConfig(**{**BIG_CONFIG, "max_response_tokens": 30}, **POLICY)
    segments, backend = play(tiny_tokenizer, config)
    assert segments[0].finish_reason == "error" and backend.sampled == []
    assert segments[0].metrics["backend_error"].startswith(
        "ContextLengthError: turn 0: --max-response-tokens 30 leaves no room, beside the ")
    short = dataclasses.replace(LoopConfig(**POLICY), max_context_tokens=170)
    refused, _ = play(tiny_tokenizer, short)
    assert refused[0].metrics["backend_error"].startswith("ContextLengthError: turn 0: the prompt of 139 tokens leaves "
                                                          "no room in --max-context-tokens of 170 tokens, beside the ")


def test_the_policy_summary_options_are_checked():
    with pytest.raises(OptionError, match="^summary_prompt: is for summarizer policy"):
        LoopConfig(context="summarize", summary_prompt="Sum up.")
    with pytest.raises(OptionError, match="^summary_tokens 5: is for summarizer policy$"):
        LoopConfig(context="summarize", summarizer="tests.episode.test_context_policies:short_summary",
                   summary_tokens=5)
    with pytest.raises(OptionError, match="^summarizer policy: is for context summarize, not window$"):
        LoopConfig(context="window", summarizer="policy")
    with pytest.raises(OptionError, match="^summary_prompt: is empty"):
        LoopConfig(context="summarize", summarizer="policy", summary_prompt="  ")
    with pytest.raises(OptionError, match="^summary_tokens 0: the policy's summary of up to 256 tokens .* no room for "
                                          "a turn in max_response_tokens 200$"):
        LoopConfig(context="summarize", summarizer="policy", max_response_tokens=200)
    assert LoopConfig(context="summarize", summarizer="policy").summary_prompt == SUMMARY_PROMPT


def test_the_commands_name_the_policy_summary_options_as_flags():
    with pytest.raises(UsageError, match="^--summary-tokens 9: is for --summarizer policy$"):
        validate(RolloutOptions, {"context": "summarize", "summary_tokens": "9"})
    with pytest.raises(UsageError, match="^--summary-prompt: is for --summarizer policy"):
        validate(RolloutOptions, {"summary_prompt": "Sum up."})
    with pytest.raises(UsageError, match="^--summary-tokens 300: .* no room for a turn in --max-response-tokens 300$"):
        validate(RolloutOptions, {"context": "summarize", "summarizer": "policy", "summary_tokens": "300",
                                  "max_response_tokens": "300"})
    options = validate(RolloutOptions, {"context": "summarize", "summarizer": "policy", "summary_tokens": "64"})
    assert (options.summarizer, options.summary_tokens) == ("policy", 64)
