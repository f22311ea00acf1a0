"""The tiny agent's recipe with pinned numerics, so that any x86-64 CPU with AVX2, Intel or AMD, trains the same bits.

Without the pin, torch picks its CPU kernels by the machine: ATen's vector loops take AVX-512 where the CPU has
it, and MKL's GEMM takes a code path by CPU maker and vector width. Their last-bit differences grow over a
thousand training steps into another model (BENCHMARKS.md, "Tiny agent build": one recipe built a "mid" at 11%
sampled success on a Xeon and at 38% on an EPYC). Pinned: ATen's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``),
MKL's COMPATIBLE branch in strict mode (``MKL_CBWR=COMPATIBLE,STRICT``: the one conditional-numerical-
reproducibility branch that MKL honours on non-Intel CPUs too; AVX2 and the others fall back to the CPU's own
path there) and BUILD_THREADS thread(s). Both variables are read when torch loads, so the recipe runs in a child
process, by its name (``agent_loop.tiny.build.RECIPE``: the recipes live in ``agent_loop.training.tiny_agent``). Where the CPU cannot take the pin (no AVX2, not x86-64) the recipe runs unpinned, with a warning that
its build may differ from the shipped one.
"""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

PINNED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT"}
BUILD_THREADS = 1  # AGENT_LOOP_TINY_THREADS overrides it (then the bits may differ); 1: no thread waits on a busy machine


def can_pin() -> bool:
    """True on an x86-64 CPU with AVX2 (the pin's kernels run there)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx2" in cpuinfo.read_text()


def build_threads() -> int:
    return int(os.environ.get("AGENT_LOOP_TINY_THREADS", BUILD_THREADS))


def numerics() -> dict:
    """The numerics this process trains with, for the build record."""
    import torch  # the tiny package loads on the rollout path, which stays free of torch

    return {"aten": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def run_pinned(target: str, *args: str) -> None:
    """Call the module-level function ``target`` (``"module:function"``, imported by that name) with ``args`` in a
    child Python with the pinned numerics (its output goes to this process's stdout/stderr); RuntimeError if it
    fails. Unpinned, in this process, where the CPU cannot pin."""
    if not can_pin():
        warnings.warn("this CPU cannot run the tiny agent's pinned numerics (x86-64 with AVX2): the build runs "
                      "with its own kernels and may differ from the shipped one", stacklevel=2)
        _call(target, args)
        return
    command = [sys.executable, "-c", "import sys; from agent_loop.tiny.pinned import _call; _call(sys.argv[1], sys.argv[2:])",
               target, *args]
    done = subprocess.run(command, env={**os.environ, **PINNED_ENV})
    if done.returncode != 0:
        raise RuntimeError(f"the tiny agent's build failed in its child process (exit {done.returncode}; "
                           "its output is above)")


def _call(target: str, args) -> None:
    import torch  # as numerics()

    torch.set_num_threads(build_threads())
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(*args)
