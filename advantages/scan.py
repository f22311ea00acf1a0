"""Loop-free carry-through scans in plain torch (DESIGN.md section 3).

Every return estimator here reduces to the right-to-left linear recurrence

    state_t = x_t + decay * state_{t+1}   where ``steps_t`` is 1 (an ASSISTANT token),
    state_t = state_{t+1}                 where it is 0 (an OBSERVATION: carried through),

with ``state_T = 0`` (``x`` must be 0 off the steps). PAD trails each row (validated), so the
state is 0 over it without an explicit reset. ``x`` and ``steps`` are ``(b, t)`` floats of one
dtype (``steps`` 0/1). The functions run unchanged on CPU and CUDA, never synchronise with the
host, and loop in Python only over ``log2`` of the number of chunks (and, on CPU, over blocks of
rows: :func:`by_row_blocks`).
"""

import math
from typing import Callable

import torch

CPU_BLOCK_ELEMENTS = 2**18  # 1 MiB of float32 per temporary: a scan's dozen temporaries stay in cache


def by_row_blocks(fn: Callable, *tensors: torch.Tensor):
    """``fn(*tensors)``, computed on CPU over blocks of about ``CPU_BLOCK_ELEMENTS`` elements of rows.

    The scans are memory-bound, with about a dozen full-size temporaries; on blocks that fit in
    the cache a big batch ran 2-3x faster here (256 x 16384, one thread). Rows are independent,
    so the result is the same. Elsewhere (CUDA) ``fn`` runs once on the whole batch. ``fn`` maps
    ``(b, t)`` tensors to a ``(b, t)`` tensor or a tuple of them.
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


def chunk_length(decay: float, dtype: torch.dtype) -> int:
    """Longest chunk over which ``decay**count`` stays at or above ``sqrt(finfo.tiny)``.

    The weights ``decay**e`` and their products with rewards then stay normal floats, so
    dividing by them loses no precision (float32: decay 0.99 -> 4345 tokens, 0.5 -> 63).
    """
    return max(1, int(math.log(torch.finfo(dtype).tiny ** 0.5) / math.log(decay)))


def _chunk_carries(scale: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Carry entering each chunk from its right, ``(b, n)`` float64.

    Chunk ``k`` maps the state right of it, ``c``, to ``scale_k * c + start_k`` at its first
    token. The carries solve that small recurrence by recursive doubling (Hillis-Steele):
    ``ceil(log2 n)`` vectorised steps.
    """
    n = scale.shape[-1]
    total, factor, span = start, scale, 1
    while span < n:  # after this step total_k composes chunks k .. k + 2*span - 1
        total = torch.cat([total[..., :-span] + factor[..., :-span] * total[..., span:], total[..., -span:]], -1)
        factor = torch.cat([factor[..., :-span] * factor[..., span:], torch.zeros_like(factor[..., -span:])], -1)
        span *= 2
    return torch.nn.functional.pad(total[..., 1:], (0, 1))  # the last chunk has nothing to its right


def carry_scan(x: torch.Tensor, steps: torch.Tensor, decay: float) -> torch.Tensor:
    """State of the carry-through recurrence (module docstring) at every position, ``(b, t)``.

    The count-power scan: with ``e_t`` the number of steps before ``t`` in its chunk,
    ``state_t = decay**-e_t * sum_{s >= t} decay**e_s x_s`` (the discount between ``t`` and ``s``
    is ``decay`` to the number of steps in between): a cumsum, a table lookup of the powers
    (computed once in float64, so each is correctly rounded), a reversed cumsum and a division.
    Chunks keep the powers inside the float range; a float64 carry joins them.
    ``decay = 1`` is a plain reversed cumsum and ``decay = 0`` a fill from the right, both exact.
    """
    t = x.shape[-1]
    if t == 0 or decay == 1.0:
        return reverse_cumsum(x)
    if decay == 0.0:
        return fill_from_right(x, steps)
    n_chunks = -(-t // chunk_length(decay, x.dtype))
    chunk = -(-t // n_chunks)  # equal chunks, so that fewer than n_chunks zeros are appended
    if n_chunks > 1:  # zeros appended on the right change nothing (the state starts at 0 there)
        tail = n_chunks * chunk - t
        x = torch.nn.functional.pad(x, (0, tail)).unflatten(-1, (n_chunks, chunk))
        steps = torch.nn.functional.pad(steps, (0, tail)).unflatten(-1, (n_chunks, chunk))
    # e_t, the steps before t within the chunk, indexes decay**0 .. decay**chunk (computed in float64,
    # so each weight is correctly rounded; exp(e_t * log(decay)) in float32 is off by up to |log w| ulps).
    counts = steps.cumsum(-1).sub_(steps)
    before = counts.int()
    powers = torch.pow(decay, torch.arange(chunk + 1, dtype=torch.float64, device=x.device))
    weight = powers.to(x.dtype).index_select(0, before.flatten()).view_as(x)
    suffix = torch.mul(x, weight, out=counts).flip(-1).cumsum_(-1).flip(-1)  # reuses the counts' memory
    if n_chunks == 1:
        return suffix.div_(weight)
    # state_t = (suffix_t + decay**(steps in the chunk) * carry) / weight_t
    scale = powers[before[..., -1] + steps[..., -1].int()]
    carry = _chunk_carries(scale, suffix[..., 0].double())  # weight is 1 at a chunk's start
    suffix += (scale * carry).to(x.dtype).unsqueeze(-1)
    return suffix.div_(weight).flatten(-2)[..., :t].contiguous()  # copies only if zeros were appended
