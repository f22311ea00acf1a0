"""The context policies on the real built-in model (issue 54's "done when": they run through ``rollout`` and
``train`` on the real model): SmolLM2-135M-Instruct, greedy, plays tests/helpers/repeat_call.py's task, which
shows it the same tool call after every turn, so that an episode calls the tool turn after turn.

- ``rollout --max-context-tokens 400``: under ``keep`` the episodes end in observation_overflow; under ``window``
  (``--context-window 1``) the same episodes play all their turns in several segments of one session each, every
  segment token-in/token-out within the bound (issue 54 item 5's first claim); the summary counts sessions with
  their segments beside them.
- ``--context summarize`` (the default digest), triggered by the same bound: the first segment is what keep played
  up to the overflow, the next one's prompt is the task with the summary under SUMMARY_HEADER.
- ``train`` one step (hf backend, RLOO, ``--context window``): every ASSISTANT token of every segment of a session
  gets the session's RLOO value, computed here serially from the sessions' rewards.

The numbers behind --max-context-tokens 400: the first prompt is about 250 tokens, a turn about 30 and its
observation (the tool's answer and the user message) about 60, so a context holds the first two turns but not the
second one's observation, while the task and one turn (window 1) stay well inside it.
Needs scripts/setup.sh's wheel (fails, not skips, without it), as tests/models/test_smollm2_smoke.py.
"""

import contextlib
import io
import json

import pytest

from agent_loop.cli import main
from agent_loop.episode.context import SUMMARY_HEADER, digest
from agent_loop.episode.tools import ToolExecutor
from masking import SpanKind
from tests.helpers.copy_call import echo
from tests.helpers.repeat_call import ASK, CALL

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MAX_TURNS = 4
CONTEXT = 400  # --max-context-tokens: one context, prompt and response
COMMON = ["--model", "smollm2-135m", "--backend", "hf", "--temperature", "0", "--max-tokens", "32", "--no-progress"]
POLICIES = {"keep": [], "window": ["--context", "window", "--context-window", "1"],
            "summarize": ["--context", "summarize"]}
ASSISTANT = int(SpanKind.ASSISTANT)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def played(smollm2_dir, tmp_path_factory):
    """``played(policy)``: the records and the printed output (whitespace collapsed) of one ``agent-loop rollout``
    of 2 episodes under that policy and --max-context-tokens 400; each policy is played once per module."""
    runs = {}

    def play(policy):
        if policy not in runs:
            out = tmp_path_factory.mktemp(policy) / "r.jsonl"
            printed, errors = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
                code = main(["rollout", "--task", "tests.helpers.repeat_call:RepeatCall", "--episodes", "2", *COMMON,
                             "--max-turns", str(MAX_TURNS), "--max-context-tokens", str(CONTEXT), *POLICIES[policy], "--out", str(out)])
            assert code == 0, errors.getvalue()
            records = [json.loads(line) for line in out.read_text().splitlines()]
            runs[policy] = records, " ".join(printed.getvalue().split())
        return runs[policy]
    return play


def sessions_of(records: list[dict]) -> dict[str, list[dict]]:
    """Session id -> its records, checked to be consecutive in the file, its segments 0, 1, ... in order."""
    sessions: dict[str, list[dict]] = {}
    for record in records:
        sessions.setdefault(record["info"]["session_id"], []).append(record)
    ids = [r["info"]["session_id"] for r in records]
    assert [s for k, s in enumerate(ids) if k == 0 or ids[k - 1] != s] == list(sessions), ids  # each one run of rows
    for segments in sessions.values():
        assert [s["info"]["segment"] for s in segments] == list(range(len(segments)))
    return sessions


def answered(segments: list[dict]) -> int:
    """The tool's "BLUE" answers over all segments of a session: RepeatCall's reward of the whole session."""
    return sum(c["name"] == "echo" and c["result"] == "BLUE" for s in segments for c in s["tool_calls"])


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """A fresh one-go render of ``messages`` with the episode's tool, as token ids."""
    text = tokenizer.apply_chat_template(messages, tools=ToolExecutor([echo]).schemas, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokens(record: dict) -> list[int]:
    return record["prompt_ids"] + record["response_ids"]


def test_window_plays_to_the_end_the_episodes_keep_ends_in_observation_overflow(played, tokenizer):
    kept, kept_printed = played("keep")
    windowed, printed = played("window")
    kept_sessions, sessions = sessions_of(kept), sessions_of(windowed)
    assert list(kept_sessions) == list(sessions) == ["repeat_call:0:0", "repeat_call:0:1"]

    # keep: one context per episode, which the bound ends before the turns run out
    for (record,) in kept_sessions.values():
        assert record["finish_reason"] == "observation_overflow" and record["metrics"]["turns"] < MAX_TURNS
        assert len(tokens(record)) <= CONTEXT and record["reward"] == answered([record]) > 0
    assert "│ episodes │ 2 │" in kept_printed

    # window: the same episodes play every turn, in segments of one session
    assert len(windowed) > len(sessions)
    assert f"│ episodes │ 2 ({len(windowed)} segments) │" in printed  # the summary table counts sessions
    assert f"wrote {len(windowed)} trajectories (2 episodes) to" in printed
    for session_id, segments in sessions.items():
        n = len(segments)
        assert n > 1 and [s["finish_reason"] for s in segments] == ["history_rewrite"] * (n - 1) + ["max_turns"]
        assert sum(s["metrics"]["turns"] for s in segments) == MAX_TURNS
        # scored once on the whole session: more answers than keep's episode got before its overflow
        reward = answered(segments)
        assert all(s["reward"] == reward for s in segments) and reward > kept_sessions[session_id][0]["reward"]
        for k, segment in enumerate(segments):
            assert segment["metrics"]["context"] == {"policy": "window", "segment": k, "segments": n}
            assert len(tokens(segment)) <= CONTEXT
            # token-in/token-out: the segment's prompt and response are a fresh render of its own messages
            assert segment["metrics"]["template_exact"], segment["metrics"]
            full = render(tokenizer, segment["messages"], False)
            assert full[: len(tokens(segment))] == tokens(segment)
        for before, after in zip(segments, segments[1:]):
            # the next segment keeps the task and the last turn (its call, the tool's answer, the call shown again)
            task, *last_turn = after["messages"][:4]
            assert task == {"role": "user", "content": ASK}
            assert [m["role"] for m in last_turn] == ["assistant", "tool", "user"]
            assert last_turn[0] == before["messages"][-1]  # the turn that closed the segment before
            assert (last_turn[1]["content"], last_turn[2]["content"]) == ("BLUE", CALL)
            assert after["prompt_ids"] == render(tokenizer, [task, *last_turn], True)


def test_summarize_goes_on_from_keeps_overflow_with_the_digest_in_the_next_prompt(played, tokenizer):
    kept, _ = played("keep")
    summarized, printed = played("summarize")
    kept_sessions, sessions = sessions_of(kept), sessions_of(summarized)
    assert list(sessions) == list(kept_sessions) and len(summarized) > len(sessions)
    assert f"│ episodes │ 2 ({len(summarized)} segments) │" in printed
    for session_id, segments in sessions.items():
        (kept_one,) = kept_sessions[session_id]
        first, later = segments[0], segments[1]
        # the first segment is what keep played up to the overflow: the same tokens
        assert first["finish_reason"] == "history_rewrite" and tokens(first) == tokens(kept_one)
        # the next prompt: the task with the digest of every tool result so far under the header, rendered afresh
        summary = digest(kept_one["messages"][1:])
        assert summary.count("- echo(") == answered([kept_one]) > 0
        assert later["messages"][0] == {"role": "user", "content": f"{ASK}\n\n{SUMMARY_HEADER}\n{summary}"}
        assert later["prompt_ids"] == render(tokenizer, later["messages"][:1], True)
        assert SUMMARY_HEADER in tokenizer.decode(later["prompt_ids"]) and later["metrics"]["template_exact"]
        assert later["metrics"]["context"] == {"policy": "summarize", "segment": 1, "segments": len(segments)}
        assert all(len(tokens(s)) <= CONTEXT for s in segments)
        assert all(s["reward"] == answered(segments) for s in segments)


def test_one_rloo_train_step_gives_every_segment_its_sessions_value(smollm2_dir, tmp_path, capsys):
    # RepeatCallBudgets: the episodes answer 1, 2, 1, ... calls in the order they are made, so the two greedy
    # samples of a question end with different rewards and numbers of segments (3 turns: 1 or 2 segments).
    # LoRA and the sampler's logprobs as PPO's old ones (no second forward pass): a shorter step, the same advantages
    run = tmp_path / "train"
    code = main(["train", "--task", "tests.helpers.repeat_call:RepeatCallBudgets", *COMMON, "--max-turns", "3",
                 "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--estimator", "rloo", "--context",
                 "window", "--context-window", "1", "--mini-batches", "1", "--micro-batch-size", "4", "--lora-rank",
                 "4", "--no-recompute-old-logprobs", "--output-dir", str(run)])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    sessions = sessions_of(rows)
    assert len(sessions) == 4 and max(len(s) for s in sessions.values()) > 1

    rewards, groups = {}, {}
    for session_id, segments in sessions.items():
        rewards[session_id] = answered(segments)
        assert all(s["reward"] == rewards[session_id] and s["info"]["group"] == segments[0]["info"]["group"]
                   for s in segments)
        groups.setdefault(segments[0]["info"]["group"], []).append(session_id)
    assert sorted(len(g) for g in groups.values()) == [2, 2]

    expected = {}
    for members in groups.values():  # RLOO, serially: R_i minus the mean of the other sessions' rewards in its group
        for session_id in members:
            others = [rewards[o] for o in members if o != session_id]
            expected[session_id] = rewards[session_id] - sum(others) / len(others)
    assert any(value != 0 for value in expected.values())  # the groups' sessions differ: the check is not all zeros

    for session_id, segments in sessions.items():
        for segment in segments:
            assert (segment["info"]["estimator"], segment["info"]["gamma"]) == ("rloo", 1.0)
            assert not any(segment["turn_rewards"] or [])  # no per-turn rewards: one value per session
            values = [a for a, span in zip(segment["advantages"], segment["spans"]) if span == ASSISTANT]
            assert values and all(v == pytest.approx(expected[session_id], abs=1e-6) for v in values), (
                session_id, segment["info"]["segment"], values[:3], expected[session_id])
            assert all(a == 0 for a, span in zip(segment["advantages"], segment["spans"]) if span != ASSISTANT)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 1 and metrics[-1]["segments"] == pytest.approx(len(rows) / len(sessions))
