"""Fixtures shared by the advantages tests."""

import pytest

from advantages.native_scans import compiled_scans


@pytest.fixture(params=["compiled", "torch"])
def scan_path(request, monkeypatch):
    """The CPU scans: the compiled loops (advantages.native_scans), or the torch scans that run
    without a C compiler, for other dtypes and on CUDA without Triton."""
    if request.param == "torch":
        for function in ("native_returns", "native_whitened_returns", "native_gae"):
            monkeypatch.setattr(f"advantages.returns.{function}", lambda *args, **kwargs: None)
    else:
        assert compiled_scans() is not None
    return request.param
