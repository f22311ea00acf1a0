"""Fixtures: the built-in tiny agent (built once per machine, then cached) and the real Qwen2.5 tokenizer."""

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch

# Two cores: one intra-op thread per test process keeps timings sane when tools run in threads. The commands
# the tests start inherit it (agent_loop.threads reads OMP_NUM_THREADS): without it their thread count would
# follow the machine's load, and two runs a test compares bit for bit could differ in their numerics.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# Each pytest-xdist worker's vLLM engines and servers on a core of their own: by default an engine binds the first
# core this process may use (agent_loop.backends.vllm_server.omp_threads_bind), so both workers' engines would
# share core 0 while the other core ran neither.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_getaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_cores[int(_WORKER[2:]) % len(_cores)]))

# The tiny agent's full recipe reproduction (tests/tiny/test_shipped.py, over 11 minutes on one core) is opt-in:
# its first steps and the shipped agent's play are checked by cheaper tests on every run.
FULL_RECIPE = "AGENT_LOOP_TEST_FULL_RECIPE"


def pytest_configure(config):
    config.addinivalue_line("markers", f"full_recipe: the tiny agent's whole recipe rebuilt; runs only with {FULL_RECIPE}=1")


# The seconds each test file took in a recorded run of the whole suite (README's test command with
# AGENT_LOOP_RECORD_DURATIONS=tests/data/test_durations.json). scripts/test.sh's pytest-xdist workers take whole
# files in collection order (--dist loadfile --no-loadscope-reorder): the longest first, so the last file to
# start is a short one and neither worker idles at the end. A file not in the record goes after the recorded ones
# (a new file is usually short).
DURATIONS = Path(__file__).parent / "data" / "test_durations.json"
RECORD_DURATIONS = "AGENT_LOOP_RECORD_DURATIONS"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(FULL_RECIPE) != "1":
        deselected = [item for item in items if item.get_closest_marker("full_recipe")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not item.get_closest_marker("full_recipe")]
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    items.sort(key=lambda item: -recorded.get(item.nodeid.split("::")[0], 0.0))  # stable: a file stays together


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Back to one torch thread after each test: a command run in this process sets its own (agent_loop.threads),
    and the worker's later tests would keep them. Two threads per worker beside the other worker (or any load)
    stall at every operation: a tiny-agent warm start took 44 s with 2 threads under load, 4 s with 1."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    if os.environ.get(RECORD_DURATIONS):  # set-up, call and tear-down of every test (the controller sees them all)
        _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    path = os.environ.get(RECORD_DURATIONS)
    if path and _seconds and not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        from agent_loop.files import write_text

        write_text(path, json.dumps({name: round(s, 1) for name, s in sorted(_seconds.items())}, indent=1) + "\n")


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    """The real Qwen2.5/Qwen3 tokenizer folder (shipped compressed in tests/data, unpacked once)."""
    from tests.helpers.testdata import qwen_tokenizer_dir

    return qwen_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="session")
def tiny_agent_dir() -> Path:
    """The tiny agent's folder (tokenizer + model); the first use on a machine builds it (< 5 min)."""
    from agent_loop.tiny import tiny_agent_path

    return tiny_agent_path()


@pytest.fixture(scope="session")
def tiny_mid() -> str:
    """The tiny agent's middling checkpoint (``tiny-mid``): a start RL can still improve."""
    from agent_loop.tiny import tiny_agent_path

    return str(tiny_agent_path(stage="mid"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_agent_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_agent_dir)
