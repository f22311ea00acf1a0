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


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    """The real Qwen2.5/Qwen3 tokenizer folder (shipped compressed in tests/data, unpacked once)."""
    from testdata import qwen_tokenizer_dir

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
