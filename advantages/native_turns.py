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
    """``{(name, dtype): function}`` for turn_tables and turn_broadcast, or None (no compiler)."""
    lib = native.load(SOURCE)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    functions = {}
    for dtype, name in _TYPES.items():
        tables = functions["tables", dtype] = getattr(lib, f"turn_tables_{name}")
        tables.argtypes = [p, p, p, p, i32, p, i64, i64, i64, p, p, p, p, p, p, p, p, p, p]
        broadcast = functions["broadcast", dtype] = getattr(lib, f"turn_broadcast_{name}")
        broadcast.argtypes = [p, p, p, p, i32, i64, i64, i64, p, p]
    for function in functions.values():
        function.restype = None
    functions["check"] = lib.check_turn_ids
    lib.check_turn_ids.argtypes = [p, p, i32, i64, i64]
    lib.check_turn_ids.restype = i64
    return functions


FIRST_COLUMNS = 64  # turn columns of the first try: more turns in a row, and the pass runs again with enough


def _pointer(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _usable(dtype, spans, turn_ids, *others) -> dict | None:
    if dtype not in _TYPES or spans.dtype != torch.int8:
        return None
    if turn_ids is not None and turn_ids.dtype not in _TURN_KINDS:
        return None
    if not native.on_cpu(*(x for x in (spans, turn_ids, *others) if x is not None)):
        return None
    return compiled_turns()


def native_check_turn_ids(spans, turn_ids) -> int | None:
    """The flat index of the first token whose turn id breaks the rule of
    ``advantages.turn_credit._check_turn_ids``, -1 if none; None where the loop cannot run."""
    functions = _usable(torch.float32, spans, turn_ids)
    if functions is None or turn_ids is None:
        return None
    return functions["check"](spans.data_ptr(), turn_ids.data_ptr(), _TURN_KINDS[turn_ids.dtype], *spans.shape)


def native_turn_tables(rewards, spans, turn_ids, tokens=None, values=None, check=False, chain=None):
    """``(r, count, n, keys, first_values)`` for ``(b, t)`` rewards (float32/float64), int8 spans,
    int16/int64 turn ids (None: derived from the spans), optional long token ids (the observation
    hashes) and values (at each turn's first ASSISTANT token): ``r`` ``(b, n)`` float64 per-turn
    reward sums, ``count`` ``(b,)`` turns per row, ``keys`` ``(h1, h2)`` ``(b, n)`` int64 or None,
    ``first_values`` ``(b, n)`` float64 or None; or None. One pass (two when a row has more than
    :data:`FIRST_COLUMNS` turns). With ``check`` (and tokens) ``keys`` holds two more tables: a third
    hash and the length of each observation, for gigpo's collision check.

    ``chain`` ``(order, previous)`` (``(b,)`` int64 CPU tensors; with ``tokens``): the rows are segments of
    sessions, ``order`` every row after its session's previous segment, ``previous`` that segment's row (-1
    for a segment 0); each row's observation hashes then continue its session's earlier segments' as on the
    joined row (a later segment's first turn is keyed by the previous segments' trailing observation tokens
    followed by its own opening ones: ``native_turns.c``)."""
    if tokens is not None and tokens.dtype != torch.int64:
        return None
    if values is not None and values.dtype != rewards.dtype:
        return None
    functions = _usable(rewards.dtype, spans, turn_ids, rewards, tokens, values, *(chain or ()))
    if functions is None or (chain is not None and (tokens is None or any(x.dtype != torch.int64 for x in chain))):
        return None
    order, previous = chain or (None, None)
    carry = torch.empty(rewards.shape[0], 4, dtype=torch.int64) if chain is not None else None
    b, t = rewards.shape
    kind = 0 if turn_ids is None else _TURN_KINDS[turn_ids.dtype]
    count = torch.empty(b, dtype=torch.int64)
    n = max(min(t, FIRST_COLUMNS), 1)
    while True:
        r = torch.empty(b, n, dtype=torch.float64)
        v = torch.empty(b, n, dtype=torch.float64) if values is not None else None
        hashes = [torch.empty(b, n, dtype=torch.int64) for _ in range(4 if check else 2)] if tokens is not None else []
        h1, h2, h3, length = (hashes + [None] * 4)[:4]
        functions["tables", rewards.dtype](
            rewards.data_ptr(), _pointer(values), spans.data_ptr(), _pointer(turn_ids), kind, _pointer(tokens),
            b, t, n, r.data_ptr(), _pointer(v), _pointer(h1), _pointer(h2), _pointer(h3), _pointer(length),
            count.data_ptr(), _pointer(order), _pointer(previous), _pointer(carry))
        needed = max(int(count.max()) if b else 0, 1)
        if needed <= n:
            break
        n = needed

    def cut(x):
        return None if x is None else x[:, :needed].contiguous()

    return cut(r), count, needed, tuple(cut(h) for h in hashes) or None, cut(v)


def native_broadcast(tables: list[torch.Tensor], spans, turn_ids, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """One or two ``(b, t)`` outputs in ``dtype``: each float64 ``(b, n)`` table's value at each
    ASSISTANT token's turn, exactly 0 elsewhere (one pass); or None."""
    if dtype not in _TYPES or len(tables) not in (1, 2):
        return None
    tables = [x.to(torch.float64).contiguous() for x in tables]
    functions = _usable(dtype, spans, turn_ids, *tables)
    if functions is None:
        return None
    b, t = spans.shape
    outs = [torch.empty(b, t, dtype=dtype) for _ in tables]
    kind = 0 if turn_ids is None else _TURN_KINDS[turn_ids.dtype]
    second = tables[1] if len(tables) == 2 else None
    functions["broadcast", dtype](tables[0].data_ptr(), _pointer(second), spans.data_ptr(), _pointer(turn_ids), kind,
                                  b, t, tables[0].shape[1], outs[0].data_ptr(), _pointer(outs[1] if second is not None else None))
    return outs
