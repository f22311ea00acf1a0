"""Every command binds vLLM's CPU threads to the cores it may use (issue 48 item 2): ``agent-loop serve`` and the
in-process engine (``rollout --backend vllm``) alike, by one function (``vllm_server.omp_threads_bind``); a binding
that asks for more cores than the process may use is refused in one line (it would oversubscribe them:
docs/platform.md)."""

import os

import psutil
import pytest

from agent_loop.backends import vllm_server
from agent_loop.backends.vllm_server import omp_threads_bind, vllm_on_cpu
from agent_loop.cli import main

CORES = sorted(os.sched_getaffinity(0))


def test_the_binding_is_the_first_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert omp_threads_bind(1) == str(CORES[0])
    assert omp_threads_bind(len(CORES)) == ",".join(map(str, CORES))
    monkeypatch.setattr(vllm_server, "allowed_cores", lambda: [2, 3, 5])
    assert omp_threads_bind(2) == "2,3"


def test_more_threads_than_cores_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_server, "allowed_cores", lambda: [0, 1])
    with pytest.raises(ValueError) as error:
        omp_threads_bind(3)
    assert str(error.value) == ("--threads 3: this process may use 2 core(s) (0,1); binding 3 threads would "
                                "oversubscribe them (docs/platform.md)")


def test_a_given_binding_is_kept_unless_it_names_cores_this_process_may_not_use(monkeypatch):
    monkeypatch.setattr(vllm_server, "allowed_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1-2")
    assert omp_threads_bind(4) == "1-2"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2-5")
    with pytest.raises(ValueError, match=r"^VLLM_CPU_OMP_THREADS_BIND=2-5: binds core\(s\) 4,5, which this process "
                                         r"may not use \(it may use 0-3; docs/platform.md\)$"):
        omp_threads_bind(1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # vLLM's own binding, asked for by name
    assert omp_threads_bind(1) == "auto"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,x")
    with pytest.raises(ValueError, match="not a list of core ids"):
        omp_threads_bind(1)


def test_serve_refuses_more_threads_than_cores(capsys, tiny_agent_dir, monkeypatch):
    import agent_loop.model_folders

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(agent_loop.model_folders, "vllm_on_cpu", lambda: True)
    too_many = len(CORES) + 1
    assert main(["serve", "--model", str(tiny_agent_dir), "--dry-run", "--threads", str(too_many)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"agent-loop serve: --threads {too_many}: this process may use {len(CORES)} core(s) "
        f"({vllm_server._ranges(CORES)}); binding {too_many} threads would oversubscribe them (docs/platform.md)"]


@pytest.mark.skipif(not vllm_on_cpu(), reason="vLLM's CPU build binds threads to cores")
def test_rollout_with_the_vllm_engine_refuses_more_threads_than_cores(capsys, tiny_agent_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    too_many = len(CORES) + 1
    assert main(["rollout", "--backend", "vllm", "--model", str(tiny_agent_dir), "--threads", str(too_many),
                 "--episodes", "1", "--out", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"--threads {too_many}: this process may use {len(CORES)} core(s)" in err[0], err
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.skipif(not vllm_on_cpu(), reason="vLLM's CPU build binds threads to cores")
def test_train_with_the_vllm_engine_refuses_more_threads_than_cores(capsys, tiny_agent_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    too_many = len(CORES) + 1
    assert main(["train", "--backend", "vllm", "--model", str(tiny_agent_dir), "--threads", str(too_many),
                 "--steps", "1", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"--threads {too_many}: this process may use {len(CORES)} core(s)" in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def single_core_threads(processes) -> set[int]:
    """The cores that threads of ``processes`` are bound to one by one (vLLM binds each OpenMP thread to its core;
    every other thread keeps the whole affinity it inherited)."""
    cores = set()
    for process in processes:
        try:
            threads = [thread.id for thread in process.threads()]
        except psutil.Error:
            continue
        for tid in threads:
            try:
                affinity = os.sched_getaffinity(tid)
            except OSError:  # the thread has ended
                continue
            if len(affinity) == 1:
                cores |= affinity
    return cores


@pytest.mark.slow
@pytest.mark.skipif(not vllm_on_cpu(), reason="vLLM's CPU build binds threads to cores")
def test_the_in_process_engine_binds_its_worker_to_the_threads_cores(tiny_agent_dir, monkeypatch):
    """Without the binding vLLM's "auto" computes on all cores but one (on 2 cores: core 0 only). What the engine
    did is read from its processes' threads: a forked worker's /proc environ would not show a variable its parent
    set after it started."""
    import asyncio

    from agent_loop.backends.base import SamplingParams
    from agent_loop.backends.vllm_engine import VLLMEngineBackend

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    expected = ",".join(map(str, CORES))
    before = set(psutil.Process().children(recursive=True))  # an earlier test's engine may still run here
    with VLLMEngineBackend(tiny_agent_dir, seed=0, threads=len(CORES)) as backend:
        assert backend.cores == expected
        asyncio.run(backend.generate([1, 2, 3], SamplingParams(max_tokens=2)))  # its threads have computed
        engine = set(psutil.Process().children(recursive=True)) - before
        assert single_core_threads(engine) == set(CORES)  # one OpenMP thread on each core the rule gives
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # set for the engine's start only
