"""Shared fixtures: the built-in tiny agent (built once per machine, then cached) and ../shared paths."""

from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"

# Two cores: one intra-op thread per test process keeps timings sane when tools run in threads.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (real chat templates and tokenizers) is absent on this machine")
    return SHARED


@pytest.fixture(scope="session")
def tiny_agent_dir() -> Path:
    """The tiny agent's folder (tokenizer + model); the first use on a machine builds it (< 5 min)."""
    from agent_loop.tiny import tiny_agent_path

    return tiny_agent_path()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_agent_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_agent_dir)
