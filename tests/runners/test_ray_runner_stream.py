"""The Ray runner streams its episode indices (issue 30): ``--episodes 50000000`` on Ray builds no list, memory is the
episodes in flight, and ``stream_rollouts_ray`` keeps running statistics only, as the in-process runner does.

A real local Ray cluster; the scripted backend (loop logic) with the real Qwen2.5 tokenizer and chat template.
The replay of a dead actor's episodes is tests/runners/test_faults.py's killed-actor test (it runs through the
same pool).
"""

import functools
import sys
import tracemalloc

import pytest
import ray
import test_ray_runner  # its calculator script and loop settings

from agent_loop.backends.base import FatalBackendError
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.runners.local import read_trajectories
from agent_loop.runners.ray_runner import stream_rollouts_ray
from agent_loop.runners.spec import RunSpec
from agent_loop.tasks.builtin import ArithmeticTask

STOP_AT = 40  # the first episode index whose request is a fatal error


class StopsAt(ScriptedBackend):
    """The scripted backend; a request of episode ``STOP_AT`` or later is a fatal error (the run stops)."""

    async def generate(self, prompt_ids, sampling, session_id=None):
        if int(session_id.rsplit(":", 1)[1]) >= STOP_AT:
            raise FatalBackendError(f"stop at episode {session_id}")
        return await super().generate(prompt_ids, sampling, session_id)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    for module in (sys.modules[__name__], test_ray_runner):
        ray.cloudpickle.register_pickle_by_value(module)
    yield
    ray.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_huge_ray_run_pulls_its_indices_one_at_a_time(qwen_tokenizer, local_ray, tmp_path):
    script = functools.partial(test_ray_runner.calculator_script, qwen_tokenizer)
    # a small run, statistics only: nothing kept but the sample
    out = tmp_path / "small.jsonl"
    spec = RunSpec(ArithmeticTask(), qwen_tokenizer, range(10), test_ray_runner.CONFIG, seed=3, output_path=out,
                   progress=False)
    stats, kept = stream_rollouts_ray(spec, functools.partial(ScriptedBackend, script), num_workers=2,
                                      concurrency_per_worker=3, sample_size=3)
    assert kept is None and stats.episodes == 10 and stats.successes == 10
    assert sorted(t.info["index"] for t in stats.sample) == [0, 1, 2]
    assert sorted(t.info["index"] for t in read_trajectories(out)) == list(range(10))

    # 50 million episodes as a generator (it cannot be pickled: the actors must not get it), stopped by a fatal
    # error at episode STOP_AT: how many indices were pulled, and what the driver allocated, tell a list apart
    pulled = []

    def indices():
        for index in range(50_000_000):
            pulled.append(index)
            yield index

    out = tmp_path / "huge.jsonl"
    spec = RunSpec(ArithmeticTask(), qwen_tokenizer, indices(), test_ray_runner.CONFIG, seed=3, output_path=out,
                   progress=False)
    workers, concurrency = 2, 4
    tracemalloc.start()
    try:
        with pytest.raises(FatalBackendError, match="stop at episode"):
            stream_rollouts_ray(spec, functools.partial(StopsAt, script), num_workers=workers,
                                concurrency_per_worker=concurrency, total=50_000_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(pulled) <= STOP_AT + workers * concurrency + 1, len(pulled)
    assert peak < 64 * 2**20, peak  # a list of 50M indices alone is 400 MB of pointers
    written = [t.info["index"] for t in read_trajectories(out)]
    assert len(set(written)) == len(written) and set(written) <= set(range(STOP_AT))
    assert len(written) >= STOP_AT - workers * concurrency
