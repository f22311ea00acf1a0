"""Ray runner: on a real local Ray cluster, the same episodes give the same trajectories as the in-process runner.

The scripted backend (loop logic only) answers from the prompt with the real Qwen2.5 tokenizer and chat
template: a calculator call (malformed on every third episode, so error observations are exercised
too), then the tool's result as the answer.
"""

import asyncio
import dataclasses
import functools
import os
import re
import sys

import pytest

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import read_trajectories, run_rollouts
from agent_loop.tasks.builtin import ArithmeticTask

ray = pytest.importorskip("ray")
from agent_loop.runners.ray_runner import run_rollouts_ray  # noqa: E402  (needs ray)
from agent_loop.runners.spec import RunSpec  # noqa: E402

SEED = 3
EPISODES = range(12)
CONFIG = LoopConfig(max_turns=4, max_tokens=64, max_response_tokens=512)


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer):
    return qwen_tokenizer


def calculator_script(tokenizer, prompt_ids: list[int]) -> list[int]:
    """Reply to the last message: a calculator call to a question, the tool's result as the answer."""
    text = tokenizer.decode(prompt_ids)
    last_message = text.rsplit("<|im_start|>", 2)[-2]  # the last one is the open assistant turn
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last_message, re.S)
    if results and not results[-1].startswith("Error"):
        return tokenizer.encode(f"The answer is {results[-1]}.")
    expression = re.findall(r"What is (.*?)\?", text)[-1]
    broken = len(prompt_ids) % 3 == 0 and not results  # a malformed call first, on some episodes
    call = '{"name": "calculator", "arguments": {"expression": "%s"}%s}' % (expression, "" if not broken else ",")
    return tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>")


def comparable(trajectory) -> dict:
    """A Trajectory without its wall-clock timings (they differ between any two runs)."""
    record = dataclasses.asdict(trajectory)
    for call in record["tool_calls"]:
        call.pop("latency_s")
    for key in ("generate_s", "tools_s", "total_s"):
        record["metrics"].pop(key)
    return record


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # this test module is not importable in the workers: ship its functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.mark.integration
def test_ray_runner_equals_in_process_runner(tokenizer, local_ray, tmp_path):
    task = ArithmeticTask()
    script = functools.partial(calculator_script, tokenizer)
    expected = asyncio.run(
        run_rollouts(task, ScriptedBackend(script), tokenizer, EPISODES, CONFIG, seed=SEED, concurrency=4, progress=False)
    )
    output = tmp_path / "ray.jsonl"
    spec = RunSpec(task, tokenizer, EPISODES, CONFIG, seed=SEED, output_path=output, progress=False)
    got = run_rollouts_ray(spec, functools.partial(ScriptedBackend, script), num_workers=2, concurrency_per_worker=3)

    # the script must have exercised the loop: tool calls, error observations, rewards
    assert all(t.metrics["tool_calls"] >= 1 for t in expected)
    assert any(t.metrics["tool_errors"] for t in expected) and any(not t.metrics["tool_errors"] for t in expected)
    assert all(t.reward == 1.0 and t.finish_reason == "stop" for t in expected)

    assert [t.info["index"] for t in got] == list(EPISODES)
    assert [comparable(t) for t in got] == [comparable(t) for t in expected]
    # every episode was written once, as it finished
    written = sorted(read_trajectories(output), key=lambda t: t.info["index"])
    assert [comparable(t) for t in written] == [comparable(t) for t in expected]


class PidLoggingBackend(ScriptedBackend):
    """The scripted backend, appending the id of the process that served each request to a file, and
    taking ``delay_s`` per request."""

    def __init__(self, script, log_path, delay_s: float = 0.0):
        super().__init__(script)
        self.log_path, self.delay_s = log_path, delay_s

    async def generate(self, prompt_ids, sampling, session_id=None):
        with open(self.log_path, "a") as log:
            log.write(f"{os.getpid()}\n")
        await asyncio.sleep(self.delay_s)
        return await super().generate(prompt_ids, sampling, session_id)


@pytest.mark.integration
def test_episodes_are_spread_over_the_workers(tokenizer, local_ray, tmp_path):
    """Each actor is its own process with its own backend; the first episodes go to both at once."""
    log_path = tmp_path / "pids.txt"
    script = functools.partial(calculator_script, tokenizer)
    got = run_rollouts_ray(RunSpec(ArithmeticTask(), tokenizer, range(8), CONFIG, progress=False),
                           functools.partial(PidLoggingBackend, script, log_path), num_workers=2, concurrency_per_worker=2)
    assert len(got) == 8
    pids = log_path.read_text().split()
    assert len(pids) == sum(t.metrics["turns"] for t in got)
    assert len(set(pids)) == 2 and os.getpid() not in map(int, pids)
