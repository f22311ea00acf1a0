"""The turn-level estimators' token passes on the CPU as compiled loops (``native_turns.c``; issue 47).

:mod:`advantages.turn_credit` works on per-turn tables ``(b, n)`` (tiny: turns, not tokens); what
costs is reading the tokens once to build them (per-turn reward sums, the critic's value at each
turn's first token, two hashes of each observation) and writing the advantages back. Torch does
each as a dozen passes over ``(b, t)``; these loops make one pass each way. Compiled on first use
by :func:`masking.native.load`; every function returns None when it cannot take the tensors (not
CPU, not contiguous, other dtypes, no compiler, ``AGENT_LOOP_NATIVE=0``), and the caller runs the
torch path (the same groups and values; other hash values).
"""

import ctypes
import functools
from pathlib import Path

import torch

import masking.native as native

SOURCE = Path(__file__).with_suffix(".c")
_TYPES = {torch.float32: "f32", torch.float64: "f64"}
_TURN_KINDS = {torch.int16: 2, torch.int64: 8}


@functools.cache
def compiled_turns() -> dict | None:
    """``{name: function}`` for turn_counts, turn_tables_* and turn_broadcast_*, or None (no compiler)."""
    lib = native.load(SOURCE)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    functions = {"counts": lib.turn_counts}
    lib.turn_counts.argtypes = [p, p, i32, i64, i64, p]
    for dtype, name in _TYPES.items():
        tables = functions["tables", dtype] = getattr(lib, f"turn_tables_{name}")
        tables.argtypes = [p, p, p, p, i32, p, i64, i64, i64, p, p, p, p]
        broadcast = functions["broadcast", dtype] = getattr(lib, f"turn_broadcast_{name}")
        broadcast.argtypes = [p, p, p, i32, i64, i64, i64, p]
    for function in functions.values():
        function.restype = None
    return functions


def _pointer(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _usable(rewards, spans, turn_ids, *others) -> dict | None:
    if rewards.dtype not in _TYPES or spans.dtype != torch.int8:
        return None
    if turn_ids is not None and turn_ids.dtype not in _TURN_KINDS:
        return None
    if not native.on_cpu(*(x for x in (rewards, spans, turn_ids, *others) if x is not None)):
        return None
    return compiled_turns()


def native_turn_tables(rewards, spans, turn_ids, tokens=None, values=None):
    """``(r, count, n, keys, first_values)`` for ``(b, t)`` rewards (float32/float64), int8 spans,
    int16/int64 turn ids (None: derived from the spans), optional long token ids (the observation
    hashes) and values (at each turn's first ASSISTANT token): ``r`` ``(b, n)`` float64 per-turn
    reward sums, ``count`` ``(b,)`` turns per row, ``keys`` ``(h1, h2)`` ``(b, n)`` int64 or None,
    ``first_values`` ``(b, n)`` float64 or None; or None."""
    if tokens is not None and tokens.dtype != torch.int64:
        return None
    if values is not None and values.dtype != rewards.dtype:
        return None
    functions = _usable(rewards, spans, turn_ids, tokens, values)
    if functions is None:
        return None
    b, t = rewards.shape
    kind = 0 if turn_ids is None else _TURN_KINDS[turn_ids.dtype]
    count = torch.empty(b, dtype=torch.int64)
    functions["counts"](spans.data_ptr(), _pointer(turn_ids), kind, b, t, count.data_ptr())
    n = max(int(count.max()) if b else 0, 1)
    r = torch.empty(b, n, dtype=torch.float64)
    v = torch.empty(b, n, dtype=torch.float64) if values is not None else None
    h1, h2 = (torch.empty(b, n, dtype=torch.int64) for _ in range(2)) if tokens is not None else (None, None)
    functions["tables", rewards.dtype](rewards.data_ptr(), _pointer(values), spans.data_ptr(), _pointer(turn_ids), kind,
                                       _pointer(tokens), b, t, n, r.data_ptr(), _pointer(v), _pointer(h1), _pointer(h2))
    return r, count, n, (None if tokens is None else (h1, h2)), v


def native_broadcast(table: torch.Tensor, spans, turn_ids, dtype: torch.dtype) -> torch.Tensor | None:
    """``(b, t)`` in ``dtype``: the float64 ``(b, n)`` table's value at each ASSISTANT token's turn,
    exactly 0 elsewhere; or None."""
    if dtype not in _TYPES or table.dtype != torch.float64:
        return None
    table = table.contiguous()
    functions = _usable(torch.empty(0, dtype=dtype), spans, turn_ids, table)
    if functions is None:
        return None
    b, t = spans.shape
    out = torch.empty(b, t, dtype=dtype)
    kind = 0 if turn_ids is None else _TURN_KINDS[turn_ids.dtype]
    functions["broadcast", dtype](table.data_ptr(), spans.data_ptr(), _pointer(turn_ids), kind, b, t, table.shape[1],
                                  out.data_ptr())
    return out
