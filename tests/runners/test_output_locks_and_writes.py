"""Nothing lost on the output side (issue 30): one run per output (a lock), strict JSON whatever
an episode holds, bounded memory on damaged files, and writes that fail leaving whole lines.

Real processes where the probe used them: the lock's holder is another process (killed with SIGKILL to
leave a stale lock), the file size limit is a real ``RLIMIT_FSIZE`` in a subprocess.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.runners.jsonl import JsonlWriter, written_episodes
from agent_loop.runners.local import plan_output, read_trajectories, run_rollouts
from agent_loop.runners.outputs import OutputLockedError, RunLock, changed_settings, fresh_path
from agent_loop.types import Trajectory

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


def strict_loads(line: str):
    """json.loads that refuses NaN/Infinity tokens, as strict readers do."""
    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")
    return json.loads(line, parse_constant=refuse)


def record(index: int, **fields) -> Trajectory:
    fields = {"logprobs": [-0.5, -0.25], "messages": [{"role": "user", "content": "q"}],
              "info": {"task": "t", "index": index, "seed": 0}, **fields}
    return Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], spans=[1, 1], turn_ids=[0, 0], **fields)


def hold_lock_in_a_process(target: Path, folder: bool = False) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import sys, time
        from agent_loop.runners.outputs import RunLock
        RunLock({str(target)!r}, folder={folder}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.timeout(60)
def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(tmp_path):
    out = tmp_path / "run.jsonl"
    holder = hold_lock_in_a_process(out)
    try:
        with pytest.raises(OutputLockedError) as refused:
            RunLock(out).acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on {os.uname().nodename}, started 20" in message and "\n" not in message
        assert fresh_path(str(out)) == str(tmp_path / "run-2.jsonl")  # a default path skips a locked output
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    assert (tmp_path / "run.jsonl.lock").exists()  # left behind by the killed run
    with pytest.warns(UserWarning, match=f"took over the lock left by pid {holder.pid}"):
        lock = RunLock(out).acquire()
    assert json.loads((tmp_path / "run.jsonl.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "run.jsonl.lock").exists()
    with RunLock(out):  # released: taken again at once, without a warning
        pass


def test_numpy_values_lone_surrogates_and_nan_become_strict_json_and_are_counted():
    trajectory = record(0, reward=np.float32(0.5), metrics={"n": np.int64(3), "array": np.arange(3)},
                        info={"task": "t", "index": 0, "seed": 0, "answer": np.int64(7)})
    line = trajectory.to_json()  # numpy values are plain JSON values, not repairs
    assert strict_loads(line)["info"]["answer"] == 7 and strict_loads(line)["metrics"]["array"] == [0, 1, 2]
    assert "json_repairs" not in strict_loads(line)["metrics"]

    bad = record(1, messages=[{"role": "user", "content": "a\ud800b"}], logprobs=[float("nan"), -np.inf],
                 info={"task": "t", "index": 1, "seed": 0, "answer": object()})
    with pytest.warns(UserWarning, match="json_repairs"):
        line = bad.to_json()
    data = strict_loads(line)  # no NaN token, and encodable as UTF-8
    line.encode("utf-8")
    assert data["messages"][0]["content"] == "a\ufffdb" and data["logprobs"] == [None, None]
    assert data["metrics"]["json_repairs"] == {"surrogates": 1, "non_finite": 2, "unserialisable": 1}
    assert bad.logprobs[0] != bad.logprobs[0]  # the Trajectory itself is left as it was


@pytest.mark.timeout(120)
def test_a_row_with_a_lone_surrogate_and_a_numpy_answer_is_written_and_resume_finishes(qwen_tokenizer, tmp_path):
    """The probe: a prompts row "\\ud800" crashed the run when written, and --resume at the same row every time."""
    from agent_loop.tasks.dataset import DatasetTask

    rows = [{"prompt": f"question {i}", "answer": "x"} for i in range(6)]
    rows[2]["prompt"] = "bad \ud800 row"
    with pytest.warns(UserWarning, match=r"1 prompt rows held .*prompts\[2\]: 1 surrogates"):
        task = DatasetTask(rows, reward=lambda completion, answer: np.float64(1.0))  # replaced and counted at load
    task.rows[4]["answer"] = np.int64(4)  # a task whose answer is a numpy value
    backend = ScriptedBackend(lambda prompt: qwen_tokenizer.encode("done"))
    out = tmp_path / "run.jsonl"
    got = asyncio.run(run_rollouts(task, backend, qwen_tokenizer, range(4), output_path=out, progress=False))
    assert [t.finish_reason for t in got] == ["stop"] * 4  # the repaired row plays like the others
    mode, todo, total = plan_output(out, range(6), 0, task.name, resume=True)
    assert (mode, list(todo), total) == ("resume", [4, 5], 2)
    asyncio.run(run_rollouts(task, backend, qwen_tokenizer, [4, 5], output_path=out, progress=False,
                             output_mode="resume"))
    lines = out.read_text(encoding="utf-8").splitlines()
    written = {strict_loads(line)["info"]["index"]: strict_loads(line) for line in lines}
    assert sorted(written) == list(range(6)) and len(lines) == 6
    assert written[2]["messages"][0]["content"] == "bad \ufffd row" and written[4]["info"]["answer"] == 4


def test_plan_output_streams_the_indices_of_a_huge_run(tmp_path):
    """The probe: --episodes 50000000 held 2.8 GB before the first episode (the index list was built first)."""
    out = tmp_path / "run.jsonl"
    out.write_text("".join(record(i).to_json() + "\n" for i in (0, 2)))
    tracemalloc.start()
    mode, todo, total = plan_output(out, range(50_000_000), 0, "t", resume=True)
    first = [next(iter(todo)) for _ in range(2)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert mode == "resume" and total == 50_000_000 - 2 and first == [1, 3]
    assert peak < 5_000_000, peak
    assert plan_output(tmp_path / "new.jsonl", range(50_000_000), 0, "t")[1:] == (range(50_000_000), 50_000_000)


@pytest.mark.timeout(120)
def test_resume_reads_and_repairs_a_huge_garbage_tail_in_bounded_memory(tmp_path):
    """The probe: rollout --resume on good lines + a 1 GB NUL tail peaked at 5.2 GB (here: 200 MB of NULs)."""
    out = tmp_path / "run.jsonl"
    out.write_text("".join(record(i).to_json() + "\n" for i in range(3)))
    with open(out, "ab") as f:
        for _ in range(200):
            f.write(b"\0" * (1 << 20))
    tracemalloc.start()
    assert written_episodes(out, seed=0, task="t") == {0, 1, 2}
    with pytest.warns(UserWarning, match="torn last line"):
        JsonlWriter(out, "resume").close()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 80 << 20, peak  # the line cap (32 MB; readline holds it twice), not the file (200 MB)
    assert [t.info["index"] for t in read_trajectories(out)] == [0, 1, 2]


WRITE_UNTIL_FULL = textwrap.dedent("""
    import resource, sys
    from agent_loop.runners.jsonl import JsonlWriter, OutputWriteError
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
    writer = JsonlWriter(sys.argv[1], "new")
    try:
        for i in range(1000):
            writer.write_line('{"i": %d, "pad": "%s"}' % (i, "x" * 700))
    except OutputWriteError as error:
        print(f"stopped at {i}: {error.strerror}")
""")


@pytest.mark.timeout(60)
def test_a_write_past_the_file_size_limit_cuts_its_partial_line_and_names_the_file(tmp_path):
    out = tmp_path / "run.jsonl"
    done = subprocess.run([sys.executable, "-c", WRITE_UNTIL_FULL, str(out)], env=ENV, capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("stopped at ") and f"cannot write {out}: File too large" in done.stdout
    data = out.read_bytes()
    assert data.endswith(b"\n") and len(data) <= 10_000  # no torn last line left behind
    stopped = int(done.stdout.split()[2].rstrip(":"))
    assert [json.loads(line)["i"] for line in data.splitlines()] == list(range(stopped))


def test_changed_settings_is_the_one_comparison():
    assert changed_settings({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 5, "d": 0}, {"a", "b", "c", "d"}) == ["b: 2 -> 5"]
    from agent_loop.recipes.train_options import TrainConfig
    from agent_loop.training.checkpoint import changed_settings as training_changes

    config = TrainConfig.from_flat(output_dir="x", steps=3, temperature=0.5)
    saved = TrainConfig.from_flat(output_dir="y", steps=9, overwrite=True).resolved()
    assert training_changes(saved, config.resolved()) == ["temperature: 1.0 -> 0.5"]  # steps, output_dir, overwrite resumable
