"""Loop-free carry-through scans in plain torch (docs/design.md section 3).

Every return estimator here reduces to the right-to-left linear recurrence

    state_t = x_t + decay * state_{t+1}   where ``steps_t`` is 1 (an ASSISTANT token),
    state_t = state_{t+1}                 where it is 0 (an OBSERVATION: carried through),

with ``state_T = 0`` (``x`` off the steps is ignored). PAD trails each row (validated), so the
state is 0 over it without an explicit reset. ``x`` and ``steps`` are ``(b, t)`` floats of one
dtype (``steps`` 0/1). The functions run unchanged on CPU and CUDA, never synchronise with the
host, and loop in Python only over the levels of the blocked scan (one or two for rows up to
tens of thousands of tokens) and, on CPU, over blocks of rows (:func:`by_row_blocks`).
"""

import functools
import math
from typing import Callable

import torch

BLOCK = 16  # positions summed by one (.., 16) @ (16, 16) matmul: 32 flops per element
CPU_BLOCK_ELEMENTS = 2**19  # 2 MiB of float32 per temporary: a scan's few temporaries stay in the L3 cache


def by_row_blocks(fn: Callable, *tensors: torch.Tensor):
    """``fn(*tensors)``, computed on CPU over blocks of about ``CPU_BLOCK_ELEMENTS`` elements of rows.

    The scans are memory-bound, with a few full-size temporaries; on blocks that fit in the
    cache those temporaries stay there instead of going to memory (BENCHMARKS.md, issue 2). Rows
    are independent, so the result is the same. Elsewhere (CUDA) ``fn`` runs once on the whole
    batch. ``fn`` maps ``(b, t)`` tensors to a ``(b, t)`` tensor or a tuple of them.
    """
    b, t = tensors[0].shape
    rows = max(1, CPU_BLOCK_ELEMENTS // max(t, 1))
    if tensors[0].device.type != "cpu" or b <= rows:
        return fn(*tensors)
    outputs, is_tuple = [], False
    for start in range(0, b, rows):
        parts = fn(*(x[start : start + rows] for x in tensors))
        is_tuple = isinstance(parts, tuple)
        parts = parts if is_tuple else (parts,)
        if not outputs:
            outputs = [torch.empty((b, *part.shape[1:]), dtype=part.dtype) for part in parts]
        for output, part in zip(outputs, parts):
            output[start : start + rows] = part  # copied out at once, so the next block reuses the memory
    return tuple(outputs) if is_tuple else outputs[0]


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``out_t = sum_{s >= t} x_s`` along the last dim (flip, cumsum, flip: the sum runs from the
    right, so small late terms are added before large early ones)."""
    return x.flip(-1).cumsum(-1).flip(-1)


def fill_from_right(x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``x`` at the first step at or after ``t`` (0 if none): the scan with ``decay = 0``.

    The k-th step of a row (counted from 0) is summed into slot k of a table, and position ``t``
    reads slot "steps before t". Non-steps add their ``x``, which must be 0, to the slot of the
    next step, so a sum (not an overwrite) keeps the result deterministic.
    """
    slot = steps.cumsum(-1).sub_(steps).long()
    table = torch.zeros(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype, device=x.device)
    return table.scatter_add_(-1, slot, x).gather(-1, slot)


def max_exponent(decay: float, dtype: torch.dtype) -> int:
    """Largest exponent ``e`` with ``decay**e`` at or above ``sqrt(finfo.tiny)``, for ``0 < decay < 1``.

    Weights ``decay**e`` up to it, and their products with rewards, stay normal floats, so dividing
    by them loses no precision (float32: decay 0.99 -> 4345, 0.5 -> 63; float64: 0.99 -> 35247).
    """
    return max(1, int(math.log(torch.finfo(dtype).tiny ** 0.5) / math.log(decay)))


@functools.lru_cache(maxsize=64)
def _powers(decay: float, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``decay**e`` for ``e = 0 .. n - 1``, correctly rounded (computed in float64), in ``dtype``.

    Cached: the table depends only on its arguments, and computing thousands of float64 powers
    is a visible share of a small call (BENCHMARKS.md, issue 2). Callers never write to it.
    """
    if dtype != torch.float64:
        return _powers(decay, n, torch.float64, device).to(dtype)
    return torch.pow(decay, torch.arange(n, dtype=torch.float64, device=device))


def _doubling_scan(x: torch.Tensor, decays: torch.Tensor) -> torch.Tensor:
    """``state_t = x_t + decays_t * state_{t+1}`` by recursive doubling (Hillis-Steele), ``(b, n)``.

    ``ceil(log2 n)`` vectorised steps; products of decays may underflow to 0, which is their limit.
    The fallback for block counts whose powers would leave the float range (tiny ``decay``, long rows).
    """
    n = x.shape[-1]
    total, factor, span = x, decays, 1
    while span < n:  # after this step total_k composes positions k .. k + 2*span - 1
        total = torch.cat([total[..., :-span] + factor[..., :-span] * total[..., span:], total[..., -span:]], -1)
        factor = torch.cat([factor[..., :-span] * factor[..., span:], torch.zeros_like(factor[..., -span:])], -1)
        span *= 2
    return total


def _power_scan(x: torch.Tensor, steps: torch.Tensor, decay: float, max_count: int, masked: bool = False) -> torch.Tensor:
    """``state_t = x_t + decay**steps_t * state_{t+1}`` (``state_T = 0``), ``(b, t)``, where ``steps``
    holds integer counts in ``[0, max_count]`` (floats of ``x``'s dtype; 0/1 for tokens). ``masked``:
    ``x`` is already 0 off the steps (validated), so the scan need not zero it.

    The count-power scan: with ``e_t`` the count before ``t`` in its block and ``w_t = decay**e_t``
    (looked up in a float64 table of powers, so correctly rounded),
    ``state_t = (sum_{s >= t in the block} w_s x_s + decay**E * right) / w_t``, where ``E`` is the
    block's total count and ``right`` the state just right of the block. A row whose powers stay
    normal floats is one block, summed by cumsums. A longer row is cut into blocks of ``BLOCK``
    positions, summed by ``(.., BLOCK) @ (BLOCK, BLOCK)`` matmuls; the states at their first
    positions obey the same recurrence one level up (``x`` = the block sums, counts = ``E``), solved
    in float64 by this function again. Few full-size temporaries: fresh memory costs page faults.
    (On CUDA with TF32 matmuls allowed the block sums of float32 round to TF32; float32 normally
    takes the Triton kernel there.)
    """
    b, t = x.shape
    limit = max_exponent(decay, x.dtype) // max_count  # longest block whose weights stay normal floats
    if limit < 2:  # x off the steps is ignored here too (one level up it is already 0 there)
        return _doubling_scan(x * (steps > 0), torch.pow(decay, steps))
    one_block = t <= limit
    length = t if one_block else min(BLOCK, limit)
    n = -(-t // length)
    if n * length != t:  # zeros appended on the right change nothing (the state starts at 0 there)
        x = torch.nn.functional.pad(x, (0, n * length - t))
        steps = torch.nn.functional.pad(steps, (0, n * length - t))
    x, steps = x.view(b, n, length), steps.view(b, n, length)
    if one_block:
        before = steps.cumsum(-1).sub_(steps)  # e_t, exact (integers)
    else:
        ones = torch.ones(length, length, dtype=x.dtype, device=x.device)
        before = steps @ ones.triu(1)
    if n > 1:
        block_steps = (before[..., -1] + steps[..., -1]).int()  # E
    weights = _powers(decay, length * max_count + 1, x.dtype, x.device).index_select(0, before.view(-1).int()).view_as(x)
    weighted = torch.mul(x, weights, out=before)  # before is no longer needed: reuse its memory
    if max_count == 1 and not masked:  # tokens: x off the steps is ignored (one level up, x is 0 wherever E is)
        weighted.mul_(steps)
    state = reverse_cumsum(weighted) if one_block else weighted @ ones.tril()  # sum_{s >= t} w_s x_s
    if n > 1:
        starts = _power_scan(state[..., 0].double(), block_steps.double(), decay, length * max_count)
        powers = _powers(decay, length * max_count + 1, torch.float64, x.device)
        right = torch.nn.functional.pad(starts[..., 1:], (0, 1))  # the last block has nothing to its right
        state += right.mul_(powers.index_select(0, block_steps.view(-1)).view_as(right)).to(x.dtype).unsqueeze(-1)
    state = state.div_(weights).view(b, n * length)
    return state if n * length == t else state[..., :t].contiguous()  # copies only if zeros were appended


def carry_scan(x: torch.Tensor, steps: torch.Tensor, decay: float, masked: bool = False) -> torch.Tensor:
    """State of the carry-through recurrence (module docstring) on the steps, 0 elsewhere, ``(b, t)``.

    ``masked`` promises that ``x`` is already 0 off the steps (validated rewards), which saves a
    pass; the result is the same.

    ``decay = 1`` is a plain reversed cumsum and ``decay = 0`` a fill from the right, both exact;
    other decays run the blocked count-power scan (:func:`_power_scan`) with 0/1 counts.
    """
    if x.shape[-1] == 0 or decay == 1.0:
        return reverse_cumsum(x if masked else x * steps).mul_(steps)
    if decay == 0.0:
        return fill_from_right(x if masked else x * steps, steps).mul_(steps)
    return _power_scan(x, steps, decay, 1, masked).mul_(steps)
