"""verl's server manager behind our Backend contract (agent_loop.integrations.verl_backend), with a stand-in
manager that answers as verl 0.9's ``AsyncLLMServerManager.generate`` does (no verl needed), and the
episode loop running on it."""

import asyncio
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from agent_loop.backends.base import SamplingParams
from agent_loop.backends.scripted import scripted_logprob
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.integrations.verl_backend import VerlServerBackend, finish_reason
from agent_loop.tasks.dataset import DatasetTask
from tests.helpers.testdata import qwen_tokenizer_dir

VERL_PARAMS = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


class Manager:
    """Replies from ``replies`` in order; records what verl's manager would have been sent."""

    def __init__(self, replies, logprobs=True, stop_reason=None, preempted=0):
        self.replies, self.calls = list(replies), []
        self.logprobs, self.stop_reason, self.preempted = logprobs, stop_reason, preempted

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        ids = self.replies.pop(0)[: sampling_params["max_tokens"]]
        return SimpleNamespace(token_ids=ids, log_probs=[scripted_logprob(t) for t in ids] if self.logprobs else None,
                               stop_reason=self.stop_reason, num_preempted=self.preempted)


def generate(backend, max_tokens=8, stops=(99,)):
    return asyncio.run(backend.generate([1, 2, 3], SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stops))))


def test_sends_verls_sampling_dict_with_the_loops_budget_and_stop_ids():
    manager = Manager([[5, 6, 99]])
    backend = VerlServerBackend(manager, {**VERL_PARAMS, "stop_token_ids": [7]}, "req-1")
    result = generate(backend)
    assert manager.calls == [("req-1", [1, 2, 3], {**VERL_PARAMS, "max_tokens": 8, "stop_token_ids": [7, 99]})]
    assert result == ([5, 6, 99], [scripted_logprob(t) for t in (5, 6, 99)], "stop", None)  # no policy version: verl's weights
    assert backend.logprobs_given and backend.num_preempted == 0 and backend.requests == 1


def test_finish_reasons():
    sampling = SamplingParams(max_tokens=3, stop_token_ids=[99])
    assert finish_reason([1, 99], sampling) == "stop"
    assert finish_reason([1, 2, 3], sampling) == "length"
    assert finish_reason([1, 2], sampling) == "stop"  # the server ended the sequence itself (its EOS)


def test_no_logprobs_from_the_server_is_recorded_not_invented():
    backend = VerlServerBackend(Manager([[5, 99]], logprobs=False), VERL_PARAMS, "r")
    assert generate(backend).logprobs == [0.0, 0.0]
    assert backend.logprobs_given is False  # the AgentLoop then gives verl response_logprobs=None


@pytest.mark.parametrize(("replies", "stop_reason", "message"), [
    ([[5, 6]], "aborted", "aborted request r after 2 tokens"),
    ([[]], None, "returned no tokens for request r"),
])
def test_a_failed_request_is_an_error(replies, stop_reason, message):
    with pytest.raises(RuntimeError, match=message):
        generate(VerlServerBackend(Manager(replies, stop_reason=stop_reason), VERL_PARAMS, "r"))


def test_not_a_server_manager():
    with pytest.raises(TypeError, match="not a verl server manager"):
        VerlServerBackend(object(), VERL_PARAMS, "r")


def test_the_episode_loop_runs_on_it_within_the_budget():
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = tokenizer.encode(" word" * 50, add_special_tokens=False)
    manager = Manager([reply], preempted=2)
    backend = VerlServerBackend(manager, VERL_PARAMS, "req")
    task = DatasetTask([{"prompt": "Talk.", "answer": "1"}], reward="number")
    trajectory = asyncio.run(run_episode(task, 0, backend, tokenizer, LoopConfig(max_response_tokens=20)))
    assert manager.calls[0][2]["max_tokens"] == 20 and manager.calls[0][2]["stop_token_ids"] == [im_end]
    assert trajectory.response_ids == reply[:20] and trajectory.finish_reason == "length"
    assert trajectory.logprobs == [scripted_logprob(t) for t in reply[:20]]
    assert backend.num_preempted == 2


def test_a_tool_format_fixed_on_the_episode_is_the_one_the_loop_parses():
    """The AgentLoop's ``tool_format`` option sets the episode's format; the loop keeps it (not the template's)."""
    from agent_loop.episode.tool_formats import TOOL_FORMATS
    from agent_loop.tasks.builtin import calculator

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    call = tokenizer.encode('[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+3"}}]<|im_end|>',
                            add_special_tokens=False)
    task = DatasetTask([{"prompt": "What is 2+3?", "answer": "5"}], reward="number", tools=[calculator])
    episode = task.make_episode(0)
    episode.tool_format = next(f for f in TOOL_FORMATS if f.name == "mistral")

    class Fixed(DatasetTask):
        def make_episode(self, index, seed=0):
            return episode

    fixed = Fixed([{"prompt": "What is 2+3?", "answer": "5"}], reward="number", tools=[calculator])
    answer = tokenizer.encode("5<|im_end|>", add_special_tokens=False)
    trajectory = asyncio.run(run_episode(fixed, 0, VerlServerBackend(Manager([call, answer]), VERL_PARAMS, "r"),
                                         tokenizer, LoopConfig()))
    assert [(c.name, c.result) for c in trajectory.tool_calls] == [("calculator", "5")]
    assert trajectory.reward == 1.0
