""":func:`masking.validate.validate_batch`'s checks on CPU as one compiled loop (issue 20).

In torch the checks take a dozen elementwise ops and reductions, a few microseconds each whatever
their size, plus a pass over memory each: 1.3-1.8x the time of the scan they guard. One C loop
(``native_checks.c``) reads rewards, mask and spans once and costs about 0.1-0.15x of it
(BENCHMARKS.md). ``torch.compile`` fuses the checks too, but its call overhead alone (~60 us here)
is most of the budget at (8, 4096).

The C file is compiled on first use with the system compiler (``$CC``, else ``cc``) into
``$AGENT_LOOP_CACHE/native`` (default ``~/.cache/agent_loop/native``), under a name that hashes the
source and the command, so an edit recompiles. The shared library is written to a temporary file
and renamed, so concurrent processes never load a partial one. Without a compiler (or with
``AGENT_LOOP_NATIVE=0``) validation runs its torch path: the same checks and messages, slower
(one warning says why).
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
from typing import Callable

import torch

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-shared", "-fPIC")  # no -march=native: the cache may be shared by machines with other CPUs
_REWARDS = {torch.float32: "f32", torch.float64: "f64"}
_MASKS = {
    torch.float32: "f32", torch.float64: "f64", torch.bool: "u8", torch.uint8: "u8",
    torch.int8: "i8", torch.int32: "i32", torch.int64: "i64",
}
_SPANS = (torch.int8, torch.uint8)
# The loop runs on one thread, torch's ops on all of its threads. At (256, 16384) torch's path took
# 12.5 ms on 1 thread and 7.1 ms on 2 against the loop's 4.7-4.9 ms (BENCHMARKS.md), so from 3
# threads torch's path takes batches above this size (small ones are all per-op overhead).
MULTI_THREAD_MAX_ELEMENTS = 2**21
MULTI_THREAD_MIN_THREADS = 3


def cache_dir() -> Path:
    return Path(os.environ.get("AGENT_LOOP_CACHE") or Path.home() / ".cache" / "agent_loop") / "native"


def _compile_command() -> list[str]:
    return [*shlex.split(os.environ.get("CC", "cc")), *FLAGS]


def library_key() -> str:
    """What the compiled library depends on, hashed: the source, the command and the machine."""
    text = " ".join([*_compile_command(), platform.machine()]).encode()
    return hashlib.sha256(SOURCE.read_bytes() + text).hexdigest()[:16]


@functools.cache
def compiled_checks() -> dict[tuple[torch.dtype, torch.dtype], Callable] | None:
    """The compiled check of each (rewards, mask) dtype pair (compiled on first use, then loaded
    from the cache), or None."""
    if os.environ.get("AGENT_LOOP_NATIVE", "1") == "0":
        return None
    path = cache_dir() / f"native_checks-{library_key()}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
                built = Path(scratch) / path.name
                command = [*_compile_command(), "-o", str(built), str(SOURCE)]
                subprocess.run(command, check=True, capture_output=True, text=True)
                os.replace(built, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        reason = getattr(error, "stderr", None) or error
        warnings.warn(f"could not compile or load {SOURCE.name} ({reason}); batch validation runs its slower torch path")
        return None
    functions = {}
    for rewards, rewards_name in _REWARDS.items():
        for mask, mask_name in _MASKS.items():
            function = functions[rewards, mask] = getattr(lib, f"check_{rewards_name}_{mask_name}")
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.POINTER(ctypes.c_int64)]
    return functions


def native_check(rewards: torch.Tensor, mask: torch.Tensor, spans: torch.Tensor | None) -> tuple[bool, int] | None:
    """``(ok, ASSISTANT tokens)`` for a non-empty ``(b, t)`` batch, or None when the compiled loop
    cannot take it (not CPU, not contiguous, other dtypes, no compiler): then use the torch path.

    ``ok`` is True iff every check of ``validate_batch`` passes; on False the caller runs the
    single checks, which raise with row and position. Spans must be int8 or uint8 (``SPAN_DTYPE``).
    """
    # Written out (no generator, is_cpu rather than device.type): this runs per call, at small
    # sizes its microseconds count against the scan it guards.
    if not (rewards.is_cpu and mask.is_cpu and rewards.is_contiguous() and mask.is_contiguous()):
        return None
    if spans is not None and not (spans.is_cpu and spans.is_contiguous() and spans.dtype in _SPANS):
        return None
    if rewards.numel() > MULTI_THREAD_MAX_ELEMENTS and torch.get_num_threads() >= MULTI_THREAD_MIN_THREADS:
        return None
    functions = compiled_checks()
    check = None if functions is None else functions.get((rewards.dtype, mask.dtype))
    if check is None:
        return None
    rows, cols = rewards.shape
    count = ctypes.c_int64()
    bad = check(rewards.data_ptr(), mask.data_ptr(), None if spans is None else spans.data_ptr(), rows, cols, ctypes.byref(count))
    return not bad, count.value
