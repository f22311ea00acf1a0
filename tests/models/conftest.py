import pytest

from agent_loop.model_folders import model_path


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The converted model (the first use on a machine converts the set-up's wheel, 1-3 minutes)."""
    return model_path("smollm2-135m")
