"""benchmarks/engine_limit.py (issue 48 item 1) at tiny sizes on the tiny agent: the loop run is recorded, the engine
replays exactly its token work (same prompts, same generated counts), and the table's columns hold sane values."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_limit():
    spec = importlib.util.spec_from_file_location("engine_limit", ROOT / "benchmarks" / "engine_limit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_limit"] = module
    spec.loader.exec_module(module)
    return module


def test_busy_share_and_mean_in_flight_against_a_plain_reference(engine_limit):
    calls = [(None, [], 1, 0.0, 2.0, 0), (None, [], 1, 1.0, 3.0, 0), (None, [], 1, 5.0, 6.0, 0)]
    busy, in_flight = engine_limit.interval_stats(calls, 0.0, 10.0)
    steps = [i / 100 for i in range(1000)]  # the plain reference: count the requests in flight at each 10 ms
    levels = [sum(start <= t < end for _, _, _, start, end, _ in calls) for t in steps]
    assert busy == pytest.approx(sum(level > 0 for level in levels) / len(steps), abs=0.01)  # 4 s of 10
    assert in_flight == pytest.approx(sum(levels) / len(steps), abs=0.01)  # 5 request-seconds over 10 s


def check_rows(rows, backend, concurrency):
    assert [(r["backend"], r["concurrency"]) for r in rows] == [(backend, c) for c in concurrency]
    for r in rows:
        assert r["tokens"] > 0 and r["turns"] >= r["episodes"]
        assert r["engine"] > 0 and r["ours"] > 0
        assert r["ratio"] == pytest.approx(r["ours"] / r["engine"])
        assert 0 < r["ratio"] < 5  # the same work: ours cannot be far faster than the engine alone
        assert 0 < r["busy"] <= 1.0001 and 0 < r["in_flight"] <= 1.0001
        assert all(cpu >= 0 for cpu in r["cpu"])


def test_quick_run_on_transformers_prints_the_table(engine_limit, capsys):
    rows = engine_limit.main(["--quick", "--backends", "hf", "--threads", "1"])
    check_rows(rows, "transformers", [1, 4])
    out = capsys.readouterr().out
    assert "| " + " | ".join(engine_limit.COLUMNS) + " |" in out
    assert "Main thread's time in the profiled loop run" in out
    for r in rows:
        assert sum(r["profile"].values()) == pytest.approx(1.0)
        assert r["profile"]["rendering"] > 0 and r["profile"]["sink"] > 0


@pytest.mark.slow
def test_quick_run_on_the_vllm_engine_replays_the_exact_token_counts(engine_limit, capsys):
    rows = engine_limit.main(["--quick", "--backends", "vllm", "--threads", "1", "--no-profile"])
    check_rows(rows, "vLLM in process", [1, 4])  # a replay that generated another count raises
