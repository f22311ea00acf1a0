"""Small C loops for the CPU, compiled on first use and called through ctypes (issue 20).

Some CPU work is a single pass that torch can only write as a dozen ops, each with its own fixed
cost per call (the batch checks, :mod:`masking.native_checks`), or as a blocked scan that makes
several passes over memory (the return scans, :mod:`advantages.native_scans`). A C file next to the
module does it in one loop. ``torch.compile`` fuses such ops too, but its own call overhead is
most of a small batch's budget (BENCHMARKS.md, issue 20).

:func:`load` compiles a C file with the system compiler (``$CC``, else ``cc``) into
``$AGENT_LOOP_CACHE/native`` (default ``~/.cache/agent_loop/native``) under a name that hashes the
source, the shared header (``native_simd.h``, next to this module), the command and the machine, so
an edit recompiles, once per machine (compile times: BENCHMARKS.md, issue 20). The library is
written to a scratch folder and renamed, so concurrent processes never load a partial one. Without
a compiler (or with ``AGENT_LOOP_NATIVE=0``) callers run their torch path: the same results,
slower (one warning says why).
"""

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from masking.cache import cache_root  # the one cache folder (stdlib only: agent_loop reads it without torch)

# No -march=native: the cache may be shared by machines with other CPUs. IEEE semantics are kept
# (NaN compares unequal: the checks rely on it; no fused multiply-adds, which only some clones
# would use). Relaxed: errno from sqrt and the FP exception flags (so float ops under a condition
# may become selects and vectorise), and -fopenmp-simd (no OpenMP runtime) lets `omp simd` sums
# vectorise: their order follows the vector width, so the whitening's moments (in double) can differ
# between CPUs in bits far below a float32 output's rounding.
FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp-simd")
HEADERS = Path(__file__).parent  # native_simd.h, included by every C file: on the -I path, hashed with each source


def cache_dir() -> Path:
    return cache_root() / "native"


def _compile_command() -> list[str]:
    return [*shlex.split(os.environ.get("CC", "cc")), *FLAGS, f"-I{HEADERS}"]


def library_path(source: Path) -> Path:
    """Where ``source`` compiles to: its name and a hash of the source, the headers, the command and
    the machine."""
    text = " ".join([*_compile_command(), platform.machine()]).encode()
    headers = b"".join(header.read_bytes() for header in sorted(HEADERS.glob("*.h")))
    return cache_dir() / f"{source.stem}-{hashlib.sha256(source.read_bytes() + headers + text).hexdigest()[:16]}.so"


@functools.cache
def load(source: Path) -> ctypes.CDLL | None:
    """The compiled ``source`` (compiled on first use, then loaded from the cache), or None."""
    if os.environ.get("AGENT_LOOP_NATIVE", "1") == "0":
        return None
    try:
        path = library_path(source)  # reads the source: a missing file is an OSError too
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
                built = Path(scratch) / path.name
                command = [*_compile_command(), "-o", str(built), str(source)]
                subprocess.run(command, check=True, capture_output=True, text=True)
                os.replace(built, path)  # not agent_loop.files: masking imports only torch
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        reason = getattr(error, "stderr", None) or error
        warnings.warn(f"could not compile or load {source.name} ({reason}); its torch path runs instead (slower)")
        return None


def on_cpu(*tensors: torch.Tensor) -> bool:
    """Every tensor on the CPU and contiguous (row-major, what the C loops index). Written out, no
    generator: this runs per call, and at small sizes its overhead counts."""
    for x in tensors:
        if not (x.is_cpu and x.is_contiguous()):
            return False
    return True


def one_thread_wins(numel: int, threads_to_match: int) -> bool:
    """Whether a single-threaded C loop beats torch's ops on ``numel`` elements: yes up to 2^21
    elements (there torch's ops are mostly per-op overhead), above it while torch has fewer than
    ``threads_to_match`` threads (how many threads its multi-threaded ops would need to catch up with
    the one loop: each caller derives it from its measured one-thread ratio and torch's scaling
    with threads; BENCHMARKS.md, issue 20)."""
    return numel <= 2**21 or torch.get_num_threads() < threads_to_match
