"""Our AgentLoop inside verl's real ``AgentLoopWorker`` (verl 0.9.1, the side environment built by
``bash scripts/side_env.sh verl-0.9.1``), on a scripted token server: the worker runs
``tests/integrations/verl_side/agent_loop_worker_run.py`` in a subprocess, this file checks verl's DataProto
against the tokenizer and chat template (loaded here, independently) and our span labelling.

Rows of the main batch: 0 a verl dataset row whose ``reward_model.ground_truth`` our ``number`` rule scores,
calling a verl ``BaseTool`` from verl's tool config; 1 our ``arithmetic`` task (agent_name column ->
an ``agent_loop_config_path`` entry) calling our ``calculator``; 2 a reply longer than ``response_length``.

The slow tests at the end run ``verl_side/agent_loop_worker_ray_run.py``: verl's ``AgentLoopWorker`` as a Ray
actor (created as ``AgentLoopManager`` creates it) in a local Ray cluster, the scripted server a Ray actor of
its own, our AgentLoop registered in the worker only by ``VERL_USE_EXTERNAL_MODULES`` in its ``runtime_env``.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from agent_loop.backends.scripted import scripted_logprob
from agent_loop.integrations.verl import spans_from_verl_batch
from agent_loop.tasks.builtin import calculator
from masking.kinds import SpanKind
from tests.helpers.testdata import qwen_tokenizer_dir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".side-envs" / "verl-0.9.1" / "bin" / "python"
SCRIPT = Path(__file__).resolve().parent / "verl_side" / "agent_loop_worker_run.py"
RAY_SCRIPT = SCRIPT.with_name("agent_loop_worker_ray_run.py")
EXTERNAL, REGISTER = "VERL_USE_EXTERNAL_MODULES", "agent_loop.integrations.verl_register"
PROMPT_LENGTH, RESPONSE_LENGTH = 512, 192  # as the script configures verl
A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)


def run_side_script(script: Path, work: Path) -> dict:
    assert SIDE_PYTHON.exists(), (f"the verl 0.9.1 side environment is missing ({SIDE_PYTHON}); build it with "
                                  "`bash scripts/side_env.sh verl-0.9.1` (scripts/setup.sh --test does)")
    env = {k: v for k, v in os.environ.items() if k != EXTERNAL}  # the Ray script gives it to one actor only
    run = subprocess.run([str(SIDE_PYTHON), str(script), str(qwen_tokenizer_dir()), str(work)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, f"the verl side script failed:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    return json.loads((work / "result.json").read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return run_side_script(SCRIPT, tmp_path_factory.mktemp("verl_agent_loop"))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def tensors(part: dict) -> dict:
    return {k: torch.tensor(v) for k, v in part["batch"].items()}


def test_registered_in_verls_registry_as_agent_loop(result):
    assert {"agent_loop", "tool_agent", "single_turn_agent"} <= set(result["registry"])
    assert result["registered_target"] == "agent_loop.integrations.verl_agent_loop.AgentLoop"


def test_response_mask_is_our_spans_and_verl_batch_spans_label_the_rows(result):
    batch, spans = tensors(result["main"]), result["main"]["non_tensor"]["spans"]
    padded = torch.full((3, RESPONSE_LENGTH), P, dtype=torch.int8)
    for row, s in enumerate(spans):
        padded[row, : len(s)] = torch.tensor(s, dtype=torch.int8)
    assert batch["response_mask"].dtype == torch.int64
    assert torch.equal(batch["response_mask"], (padded == A).long())
    assert torch.equal(batch["attention_mask"][:, PROMPT_LENGTH:], (padded != P).long())
    assert torch.equal(spans_from_verl_batch(batch["responses"], batch["attention_mask"], batch["response_mask"]), padded)
    assert [s.count(O) > 0 for s in spans] == [True, True, False]  # rows 0 and 1 called a tool


def observation_ids(batch: dict, spans: list[int], row: int) -> list[int]:
    return [t for t, s in zip(batch["responses"][row].tolist(), spans) if s == O]


def test_observation_tokens_are_the_templates_rendering_of_the_tool_result(result, tokenizer):
    batch, extra = tensors(result["main"]), result["main"]["non_tensor"]
    expression = extra["messages"][1][0]["content"].removeprefix("What is ").removesuffix("?")
    expected_results = ["417", calculator(expression)]  # the verl tool's table entry; our calculator
    for row, expected in enumerate(expected_results):
        messages = extra["messages"][row]
        assert messages[2] == {"role": "tool", "name": ["code_lookup", "calculator"][row], "content": expected,
                               "tool_call_id": "call00000"}
        assert extra["tool_calls"][row][0]["result"] == expected
        rendered = tokenizer.apply_chat_template(messages[:3], tokenize=False, add_generation_prompt=True)
        text = rendered.split("</tool_call><|im_end|>", 1)[1]  # what the template writes after the call turn
        assert text == f"\n<|im_start|>user\n<tool_response>\n{expected}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        assert observation_ids(batch, extra["spans"][row], row) == tokenizer.encode(text, add_special_tokens=False)


def test_prompt_is_the_templates_rendering_with_verls_tool_schema(result, tokenizer):
    batch = tensors(result["main"])
    prompt = batch["prompts"][0][batch["attention_mask"][0, :PROMPT_LENGTH].bool()].tolist()
    expected = tokenizer.apply_chat_template([{"role": "user", "content": 'What is the code of "river"?'}],
                                             tools=[result["lookup_schema"]], add_generation_prompt=True, tokenize=False)
    assert prompt == tokenizer.encode(expected, add_special_tokens=False)


def test_our_rewards_are_verls_rm_scores_on_the_last_response_token(result):
    batch, extra = tensors(result["main"]), result["main"]["non_tensor"]
    assert extra["reward_source"] == ["agent_loop"] * 3
    assert extra["agent_loop_reward"] == [1.0, 1.0, 0.0]  # 417 and the calculator's value right; "7" never said
    expected = torch.zeros(3, RESPONSE_LENGTH)
    last = batch["attention_mask"][:, PROMPT_LENGTH:].sum(1) - 1
    expected[torch.arange(3), last] = torch.tensor(extra["agent_loop_reward"])
    assert torch.equal(batch["rm_scores"], expected)
    assert all(batch["response_mask"][r, last[r]] == 1 for r in range(3))  # each reward sits on an ASSISTANT token


def test_logprobs_are_the_servers_on_assistant_tokens(result):
    batch, spans = tensors(result["main"]), result["main"]["non_tensor"]["spans"]
    for row, s in enumerate(spans):
        ids = batch["responses"][row].tolist()
        want = [scripted_logprob(t) if k == A else 0.0 for t, k in zip(ids, s)] + [0.0] * (RESPONSE_LENGTH - len(s))
        assert torch.allclose(batch["rollout_log_probs"][row], torch.tensor(want), atol=1e-6)


def test_response_length_is_the_episode_budget(result):
    extra, calls = result["main"]["non_tensor"], result["calls"]
    assert len(extra["spans"][2]) == RESPONSE_LENGTH and extra["finish_reason"] == ["stop", "stop", "length"]
    assert extra["truncated"] == [False, False, True]
    by_request: dict[str, list] = {}
    for call in calls:
        by_request.setdefault(call["request_id"], []).append(call)
    assert sorted(len(c) for c in by_request.values()) == [1, 2, 2]  # one request id per episode (sticky session)
    for episode_calls in by_request.values():
        first = episode_calls[0]["prompt_len"]
        for call in episode_calls:  # the turn's budget is what is left of response_length
            assert call["sampling_params"]["max_tokens"] == RESPONSE_LENGTH - (call["prompt_len"] - first)
            assert call["sampling_params"]["stop_token_ids"] == [151645]  # <|im_end|>, our end of turn
            assert call["sampling_params"]["top_k"] == -1 and call["sampling_params"]["logprobs"] is True  # verl's


def test_verl_tool_lifecycle_and_step_reward(result):
    extra = result["main"]["non_tensor"]
    assert extra["tool_rewards"] == [[0.5], [], []]
    assert extra["__num_turns__"] == [4, 4, 2]  # user + assistant + tool + assistant, as verl counts
    assert result["released"] == 2  # both code_lookup calls (main row 0 and the verl-scored row) were released


def test_reward_source_verl_leaves_scoring_to_verls_reward_manager(result):
    part = result["verl_reward"]
    assert "rm_scores" not in part["batch"]
    assert part["non_tensor"]["reward_source"] == ["verl"]
    assert part["non_tensor"]["agent_loop_reward"] == [1.0]  # ours, kept for comparison


def test_bad_configuration_and_rows_are_clear_errors(result):
    errors = result["errors"]
    assert "unknown key(s) ['max_turn']" in errors["unknown_option"]
    assert errors["long_prompt"].startswith("ValueError: verl row with index 9: the prompt has")
    assert "rollout.prompt_length=512" in errors["long_prompt"]


@pytest.fixture(scope="module")
def ray_result(tmp_path_factory) -> dict:
    return run_side_script(RAY_SCRIPT, tmp_path_factory.mktemp("verl_agent_loop_ray"))


@pytest.mark.slow
@pytest.mark.integration
class TestAgentLoopWorkerAsRayActor:
    """verl's process layout: driver, AgentLoopWorker actor, server actor; one row calling verl's code_lookup."""

    def test_the_registry_in_the_actor_comes_from_the_runtime_env_only(self, ray_result):
        driver, worker, unregistered = ray_result["driver"], ray_result["worker"], ray_result["unregistered_worker"]
        assert driver["ours_loaded_before_actors"] == [] and driver["ours_loaded_at_end"] == []
        assert "agent_loop" not in driver["registry"]
        assert len({driver["pid"], worker["pid"], unregistered["pid"], ray_result["server_pid"]}) == 4
        assert worker["env"] == REGISTER and REGISTER in worker["ours_loaded"]
        assert worker["registry"]["agent_loop"] == "agent_loop.integrations.verl_agent_loop.AgentLoop"
        # the same worker, config and row without the variable: verl's own error, and none of ours was loaded
        assert unregistered["env"] is None and unregistered["ours_loaded"] == []
        assert "agent_loop" not in unregistered["registry"]
        assert ray_result["unregistered_error"].startswith("AssertionError: Agent loop agent_loop not registered")

    def test_response_mask_is_our_spans(self, ray_result):
        batch, spans = tensors(ray_result["main"]), ray_result["main"]["non_tensor"]["spans"][0]
        assert batch["response_mask"].shape == (1, RESPONSE_LENGTH) and set(spans) == {A, O}
        padded = torch.full((RESPONSE_LENGTH,), P, dtype=torch.int8)
        padded[: len(spans)] = torch.tensor(spans, dtype=torch.int8)
        assert torch.equal(batch["response_mask"][0], (padded == A).long())
        assert torch.equal(batch["attention_mask"][0, PROMPT_LENGTH:], (padded != P).long())

    def test_observation_tokens_decode_to_the_tool_result(self, ray_result, tokenizer):
        batch, extra = tensors(ray_result["main"]), ray_result["main"]["non_tensor"]
        assert extra["tool_calls"][0][0]["result"] == "417" and extra["tool_rewards"] == [[0.5]]
        text = tokenizer.decode(observation_ids(batch, extra["spans"][0], 0))
        assert text == "\n<|im_start|>user\n<tool_response>\n417\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

    def test_rm_scores_sit_on_the_last_response_token(self, ray_result):
        batch, extra = tensors(ray_result["main"]), ray_result["main"]["non_tensor"]
        assert extra["reward_source"] == ["agent_loop"] and extra["agent_loop_reward"] == [1.0]
        last = int(batch["attention_mask"][0, PROMPT_LENGTH:].sum()) - 1
        expected = torch.zeros(1, RESPONSE_LENGTH)
        expected[0, last] = 1.0
        assert torch.equal(batch["rm_scores"], expected) and batch["response_mask"][0, last] == 1

    def test_the_calls_reached_the_scripted_server_actor(self, ray_result):
        calls, spans = ray_result["calls"], ray_result["main"]["non_tensor"]["spans"][0]
        assert len(calls) == 2 and calls[0]["request_id"] == calls[1]["request_id"]  # the call turn, the answer
        first = calls[0]["prompt_len"]
        assert all(c["sampling_params"]["max_tokens"] == RESPONSE_LENGTH - (c["prompt_len"] - first) for c in calls)
        assert calls[1]["prompt_len"] - first == spans.index(O) + spans.count(O)  # the call turn and the tool result
        assert ray_result["calls_after_unregistered"] == 2  # the unregistered worker never reached the server
