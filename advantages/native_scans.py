"""The carry-through return scans on the CPU as compiled loops (``native_scans.c``; issue 20).

The torch scans (:mod:`advantages.scan`) are loop-free but make several passes with matmuls and
temporaries; a C loop over each row, four rows at a time, makes one pass (timings against the torch
scans and the memory floor: BENCHMARKS.md, issue 20). The running state is a double. The whitened
estimators sum their moments per group of rows just after it is scanned, while it is in the cache,
and whiten in one more pass, instead of torch's whitening reading the whole batch again.
Compiled on first use by :func:`masking.native.load`; every function returns None when it cannot
take the tensors (not CPU, other dtypes, no compiler, a big batch with many torch threads), and the
caller runs the torch scan.
"""

import ctypes
import functools
from pathlib import Path
from typing import Callable

import torch

import masking.native as native

SOURCE = Path(__file__).with_suffix(".c")
_TYPES = {torch.float32: "f32", torch.float64: "f64"}
THREADS_TO_MATCH = 6  # from the torch scan's measured one-thread ratio to the loop (BENCHMARKS.md, issue 20)


@functools.cache
def compiled_scans() -> dict[tuple[str, torch.dtype], Callable] | None:
    """``{(kind, dtype): function}`` for the kinds returns, whitened_returns, gae, whitened_gae,
    chained_returns and chained_gae, or None (no compiler)."""
    lib = native.load(SOURCE)
    if lib is None:
        return None
    functions = {}
    for dtype, name in _TYPES.items():
        for kind, pointers, numbers in (
            ("returns", 3, 1), ("whitened_returns", 4, 2), ("gae", 5, 2), ("whitened_gae", 5, 3),
        ):  # pointers, rows and cols, gamma (and lam, and the whitening's eps)
            function = functions[kind, dtype] = getattr(lib, f"{kind}_{name}")
            function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * 2 + [ctypes.c_double] * numbers
            function.restype = None
        for kind, pointers, numbers in (("chained_returns", 4, 2), ("chained_gae", 5, 3)):  # + order, next, level, carry
            function = functions[kind, dtype] = getattr(lib, f"{kind}_{name}")
            function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * 2 + [ctypes.c_double] * numbers \
                + [ctypes.c_void_p] * 4
            function.restype = None
    return functions


def _function(kind: str, *tensors: torch.Tensor):
    """The compiled ``kind`` scan for these ``(b, t)`` tensors (one float32/float64 dtype, on the
    CPU, contiguous), or None."""
    dtype = tensors[0].dtype
    if dtype not in _TYPES or not native.on_cpu(*tensors) or not native.one_thread_wins(tensors[0].numel(), THREADS_TO_MATCH):
        return None
    for x in tensors:
        if x.dtype != dtype:
            return None
    functions = compiled_scans()
    return None if functions is None else functions[kind, dtype]


def native_returns(rewards: torch.Tensor, steps: torch.Tensor, gamma: float) -> torch.Tensor | None:
    """Carry-through returns (``advantages.returns.discounted_returns``' table) of ``(b, t)``
    rewards over ``steps`` (the ASSISTANT mask as 0/1 of the rewards' dtype), exactly 0 off the
    steps; or None (then use the torch scan)."""
    function = _function("returns", rewards, steps)
    if function is None:
        return None
    out = torch.empty_like(rewards)
    function(rewards.data_ptr(), steps.data_ptr(), out.data_ptr(), *rewards.shape, gamma)
    return out


def native_whitened_returns(
    rewards: torch.Tensor, steps: torch.Tensor, gamma: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`native_returns` and their whitening over the steps (verl's ``masked_whiten``,
    Bessel-corrected, ``eps`` added to the variance): ``(advantages, returns)``, exactly 0 off the
    steps (below 2 steps the advantages are 0 everywhere: :mod:`advantages.stats`); or None.
    The moments are summed per group of rows just after it is scanned, while it is in the cache,
    and one more pass whitens (``native_scans.c``)."""
    function = _function("whitened_returns", rewards, steps)
    if function is None:
        return None
    returns, advantages = torch.empty_like(rewards), torch.empty_like(rewards)
    function(rewards.data_ptr(), steps.data_ptr(), returns.data_ptr(), advantages.data_ptr(), *rewards.shape, gamma, eps)
    return advantages, returns


def native_gae(
    rewards: torch.Tensor, values: torch.Tensor, steps: torch.Tensor, gamma: float, lam: float,
    whiten_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Carry-through GAE (``advantages.returns.gae``' recurrence) of ``(b, t)`` rewards and values
    over ``steps``: ``(advantages, returns)``, exactly 0 off the steps; or None. With ``whiten_eps``
    the advantages are whitened as in :func:`native_whitened_returns`, with that ``eps``."""
    whiten = () if whiten_eps is None else (whiten_eps,)
    function = _function("whitened_gae" if whiten else "gae", rewards, values, steps)
    if function is None:
        return None
    advantages, returns = torch.empty_like(rewards), torch.empty_like(rewards)
    function(
        rewards.data_ptr(), values.data_ptr(), steps.data_ptr(), advantages.data_ptr(), returns.data_ptr(),
        *rewards.shape, gamma, lam, *whiten,
    )
    return advantages, returns


def native_chained_returns(
    rewards: torch.Tensor, steps: torch.Tensor, gamma: float, chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    whiten_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`native_returns` (with ``whiten_eps``: :func:`native_whitened_returns`) of rows that are segments
    of sessions, each row's scan starting from the state its session's next segment ended with: the
    returns of the segments laid end to end, with no copy. ``chain``: ``(order, next, level)``, ``(b,)``
    int64 CPU tensors (:func:`masking.sessions.segment_chain`). ``(advantages, returns)`` ``(b, t)``
    (the advantages are the returns without ``whiten_eps``), exactly 0 off the steps; or None."""
    function = _function("chained_returns", rewards, steps)
    if function is None:
        return None
    returns = torch.empty_like(rewards)
    advantages = returns if whiten_eps is None else torch.empty_like(rewards)
    carry = torch.empty(rewards.shape[0], dtype=torch.float64)
    function(rewards.data_ptr(), steps.data_ptr(), returns.data_ptr(), advantages.data_ptr(), *rewards.shape, gamma,
             -1.0 if whiten_eps is None else whiten_eps, *(x.data_ptr() for x in chain), carry.data_ptr())
    return advantages, returns


def native_chained_gae(
    rewards: torch.Tensor, values: torch.Tensor, steps: torch.Tensor, gamma: float, lam: float,
    chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor], whiten_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`native_gae` of rows that are segments of sessions (``chain`` as in :func:`native_chained_returns`):
    each row's scan starts from the advantage and the value its session's next segment's scan ended with,
    so the last step of segment k bootstraps from the value at segment k + 1's first step.
    ``(advantages, returns)`` ``(b, t)``, exactly 0 off the steps; or None."""
    function = _function("chained_gae", rewards, values, steps)
    if function is None:
        return None
    advantages, returns = torch.empty_like(rewards), torch.empty_like(rewards)
    carry = torch.empty(rewards.shape[0], 2, dtype=torch.float64)
    function(rewards.data_ptr(), values.data_ptr(), steps.data_ptr(), advantages.data_ptr(), returns.data_ptr(),
             *rewards.shape, gamma, lam, -1.0 if whiten_eps is None else whiten_eps, *(x.data_ptr() for x in chain),
             carry.data_ptr())
    return advantages, returns
