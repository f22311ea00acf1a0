"""Fixtures: the built-in tiny agent (built once per machine, then cached) and the real Qwen2.5 tokenizer."""

import os
from pathlib import Path

import pytest
import torch

# Two cores: one intra-op thread per test process keeps timings sane when tools run in threads. The commands
# the tests start inherit it (agent_loop.threads reads OMP_NUM_THREADS): without it their thread count would
# follow the machine's load, and two runs a test compares bit for bit could differ in their numerics.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# The tiny agent's full recipe reproduction (tests/tiny/test_shipped.py, over 11 minutes on one core) is opt-in:
# its first steps and the shipped agent's play are checked by cheaper tests on every run.
FULL_RECIPE = "AGENT_LOOP_TEST_FULL_RECIPE"


def pytest_configure(config):
    config.addinivalue_line("markers", f"full_recipe: the tiny agent's whole recipe rebuilt; runs only with {FULL_RECIPE}=1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(FULL_RECIPE) == "1":
        return
    deselected = [item for item in items if item.get_closest_marker("full_recipe")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("full_recipe")]


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
def tiny_tokenizer(tiny_agent_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_agent_dir)
