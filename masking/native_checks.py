""":func:`masking.validate.validate_batch`'s checks on CPU as one compiled loop (issue 20).

In torch the checks take a dozen elementwise ops and reductions, each with a fixed cost per call
whatever its size, plus a pass over memory each. One C loop (``native_checks.c``, compiled by
:func:`masking.native.load`) reads rewards, mask and spans once, with no per-op overhead
(timings: BENCHMARKS.md, issue 20).
"""

import ctypes
import functools
from pathlib import Path
from typing import Callable

import torch

import masking.native as native

SOURCE = Path(__file__).with_suffix(".c")
_REWARDS = {torch.float32: "f32", torch.float64: "f64"}
_MASKS = {
    torch.float32: "f32", torch.float64: "f64", torch.bool: "u8", torch.uint8: "u8",
    torch.int8: "i8", torch.int32: "i32", torch.int64: "i64",
}
_SPANS = (torch.int8, torch.uint8)
# torch threads from which its multi-threaded path of the checks beats the one-thread loop on a big batch,
# from their measured times (BENCHMARKS.md, issue 20: "The compiled checks alone")
THREADS_TO_MATCH = 3


@functools.cache
def compiled_checks() -> dict[tuple[torch.dtype, torch.dtype], Callable] | None:
    """The compiled check of each (rewards, mask) dtype pair, or None (no compiler)."""
    lib = native.load(SOURCE)
    if lib is None:
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
    cannot take it (not CPU, not contiguous, other dtypes, no compiler, a big batch with many torch
    threads): then use the torch path.

    ``ok`` is True iff every check of ``validate_batch`` passes; on False the caller runs the
    single checks, which raise with row and position. Spans must be int8 or uint8 (``SPAN_DTYPE``).
    """
    if not native.on_cpu(rewards, mask) or (spans is not None and not (native.on_cpu(spans) and spans.dtype in _SPANS)):
        return None
    if not native.one_thread_wins(rewards.numel(), THREADS_TO_MATCH):
        return None
    functions = compiled_checks()
    check = None if functions is None else functions.get((rewards.dtype, mask.dtype))
    if check is None:
        return None
    rows, cols = rewards.shape
    count = ctypes.c_int64()
    bad = check(rewards.data_ptr(), mask.data_ptr(), None if spans is None else spans.data_ptr(), rows, cols, ctypes.byref(count))
    return not bad, count.value
