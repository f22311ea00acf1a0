"""verifiers (v1) environments through the loop (``--task verifiers:ID``), in the side environment
``.side-envs/verifiers`` (verifiers 0.4.0 pins mcp 2.0 and openai<3, which cannot share .venv).

tests/ecosystem/verifiers_side/play.py plays this folder's local tasksets there (a single-turn taskset, a tool
taskset with a verifiers Toolset, a multi-turn Env; tiny datasets built in code, nothing from a hub) on the tiny
agent's tokenizer with scripted replies, and the tiny agent itself through ``agent-loop rollout``; next to each
episode it scores the same completions serially with verifiers' own objects (its typed messages, its Toolset's
tool method, its Task.score). This test checks what it printed."""

import pytest

from masking import SpanKind
from tests.helpers.side_envs import ROOT, side_json

A, O = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def played(tiny_agent_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("verifiers") / "rollout.jsonl"
    return side_json("verifiers", "tests/ecosystem/verifiers_side/play.py", str(tiny_agent_dir), str(out),
                     env={"PYTHONPATH": str(ROOT / "tests" / "ecosystem" / "verifiers_side"), "OMP_NUM_THREADS": "1"})


def assert_exact_and_same_reward(episode):
    assert episode["error"] is None and episode["finish"] == "stop"
    assert episode["reward"] == pytest.approx(episode["reference"])
    assert episode["template_exact"] and episode["render_prefix"]


def test_single_turn_rewards_are_its_rubric(played):
    episodes = played["math"]
    for episode in episodes:
        assert_exact_and_same_reward(episode)
        assert episode["span_runs"] == [A]
        assert episode["metrics"]["reward_exact"] == episode["components"]["exact"]
        assert episode["metrics"]["length"] == len(episode["messages"][-1]["content"])  # its @vf.metric
    assert [e["reward"] for e in episodes] == [1.0, 0.0, 1.0, 0.0]  # 2+3=5, 4+1!=6, 7+2=9, "two" is no number
    assert episodes[0]["messages"][:2] == [{"role": "system", "content": "Answer with the number only."},
                                           {"role": "user", "content": "What is 2+3?"}]


def test_toolset_tools_answer_calls_as_observations(played):
    tools = played["tools"]
    assert [s["function"]["name"] for s in tools["schemas"]] == ["add"]
    assert tools["schemas"][0]["function"]["parameters"]["required"] == ["a", "b"]
    for episode in tools["episodes"]:
        assert_exact_and_same_reward(episode)
    first, wrong, no_call = tools["episodes"]
    assert first["span_runs"] == [A, O, A] and first["messages"][2]["role"] == "tool"
    assert first["messages"][2]["content"] == "42"  # the Toolset's add ran
    # weighted rubric: correct (1.0) + 0.5 * used_tool
    assert (first["reward"], wrong["reward"], no_call["reward"]) == (1.5, 0.5, 1.0)


def test_multi_turn_env_messages_are_observations(played):
    for episode, expected in zip(played["dialogue"], [2 / 3, 1.0]):
        assert_exact_and_same_reward(episode)
        assert episode["reward"] == pytest.approx(expected)
        assert episode["span_runs"] == [A, O] * 2 + [A]  # the env's two messages between three replies
        users = [m["content"] for m in episode["messages"] if m["role"] == "user"]
        assert users == episode["expected_users"]


def test_bad_input_is_an_error_episode_or_one_line(played):
    broken = played["broken"]
    assert broken["finish"] == "error" and "EchoEnv.run raised RuntimeError: round 1 is broken" in broken["error"]
    errors = played["errors"]
    assert "did you mean vf_tiny_math?" in errors["verifiers:vf_tiny_mth"]
    assert "container or a hosted service" in errors["verifiers:harbor"]
    assert "no_such_field" in errors["verifiers:vf_tiny_math"]
    assert all(e and "\n" not in e for e in errors.values())


def test_tiny_agent_rollout_scored_by_verifiers(played):
    rows = played["rollout"]
    assert len(rows) == 4
    for row in rows:
        assert row["reward"] == row["reference"] and row["template_exact"] and row["finish"] in ("stop", "length")
        assert row["prompt"][1]["content"] == row["task_prompt"]
