"""Sessions: one episode recorded as several rows (segments), joined end to end for the estimators
(docs/design.md section 3, "Sessions"; issue 54).

When an agent rewrites its history (a summary, a sliding window, reasoning stripped), the recording
starts a new *segment*: a new row whose tokens are the context the model saw. The rows of one
*session* are its segments ``0, 1, .., n-1`` in order. A session is one sample with one return: its
outcome reward sits on the last ASSISTANT token of its last segment only (:func:`masking.batch.collate`),
per-turn rewards on their own turns.

:func:`session_join` lays each session's segments end to end (each segment's trailing PAD dropped)
into one *joined* row ``(S, W)``; :func:`join_tokens` and :func:`join_turns` move ``(b, t)`` token
tensors and ``(b, m)`` per-turn tensors there, :func:`split_tokens` moves a joined result back to the
rows. Every estimator that runs on the joined rows (``advantages.registry.Estimator`` with
``session=``) is then session-aware by construction: a session is one row, so it counts once in
group statistics, its returns run across segment boundaries (the discount and the turn index carry
on; OBSERVATION tokens opening a later segment cost nothing, as any OBSERVATION token) and GAE
bootstraps the end of segment k from the value at segment k+1's first ASSISTANT token.

On the CPU a row's tokens move as one ``memcpy`` (``native_join.c``, compiled by
:func:`masking.native.load`); elsewhere (and without a compiler) by one scatter/gather over a ``(b, t)``
index tensor. No Python loop over rows, segments or sessions. The shape ``(S, W)`` is two Python ints, read from ``session`` and ``segment``
(and, on the CPU, from the spans): free for CPU tensors; for accelerator tensors one host read of
two ints per batch (keep ``session``/``segment`` on the CPU to make it free).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Sequence

import torch

import masking.native as native
from masking.spans import SpanKind

SOURCE = Path(__file__).with_name("native_join.c")


def row_ids(values, batch_size: int, name: str = "index", device: torch.device | str = "cpu", what: str = "group id") -> torch.Tensor:
    """``values`` -> ``(b,)`` long ids on ``device`` (equal ids = same group / session).

    Takes an integer tensor (kept as is, no host sync), or a numpy array / list / tuple of ints or
    strings (uids), numbered in order of first appearance. ValueError (naming ``name``, the row and
    ``what`` an entry is) for a wrong length, floats, bools or None.
    """
    if isinstance(values, torch.Tensor):
        if values.shape != (batch_size,) or values.dtype.is_floating_point or values.dtype.is_complex \
                or values.dtype == torch.bool:
            raise ValueError(
                f"{name} must hold one integer {what} per row, shape ({batch_size},); got a {values.dtype} tensor "
                f"of shape {tuple(values.shape)}"
            )
        return values.to(device=device, dtype=torch.long)
    items = values.tolist() if hasattr(values, "tolist") else values
    if not isinstance(items, (list, tuple)) or len(items) != batch_size:
        raise ValueError(f"{name} must hold one {what} per row ({batch_size}); got {values!r}")
    return torch.tensor(number_keys(items, name, what), dtype=torch.long, device=device)


def segment_numbers(segments, batch_size: int, name: str = "segment") -> torch.Tensor:
    """``segments`` (a tensor, array or list of ints) -> ``(b,)`` long segment numbers, kept as given (not
    renumbered). ValueError for a wrong length or non-integers."""
    numbers = torch.as_tensor(segments.tolist() if hasattr(segments, "tolist") and not isinstance(segments, torch.Tensor)
                              else segments)
    if numbers.shape != (batch_size,) or numbers.dtype.is_floating_point or numbers.dtype.is_complex \
            or numbers.dtype == torch.bool:
        raise ValueError(f"{name} must hold one integer segment number per row ({batch_size}); got {segments!r}")
    return numbers.long()


def number_keys(keys: Sequence, name: str, what: str = "key") -> list[int]:
    """Hashable keys (ints or strings) -> their numbers in order of first appearance (equal keys, equal
    numbers). ValueError naming ``name[i]`` for floats, bools, None, lists or unhashable keys."""
    dense: dict = {}
    numbers = []
    for i, key in enumerate(keys):
        if isinstance(key, (bool, float)) or key is None or isinstance(key, (list, tuple)):
            raise ValueError(f"{name}[{i}] is {key!r}; {what}s are ints or strings (uids)")
        try:
            numbers.append(dense.setdefault(key, len(dense)))
        except TypeError:
            raise ValueError(f"{name}[{i}]: key {key!r} is not hashable") from None
    return numbers


def dense_ids(ids: torch.Tensor) -> torch.Tensor:
    """``(b,)`` integer ids -> ``(b,)`` long ids ``0..k-1`` (equal in, equal out; in sorted order of the
    ids): a sort and a cumsum, no host sync."""
    sorted_ids, order = torch.sort(ids)
    starts = torch.ones_like(sorted_ids, dtype=torch.long)
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
    return torch.empty_like(order).scatter_(0, order, starts.cumsum(0) - 1)


class SessionJoin:
    """Where each row's tokens and turns go in the joined ``(sessions, width)`` batch.

    ``session`` ``(b,)`` long: the dense session (joined row) of each row, ``0..sessions-1``;
    ``length`` ``(b,)`` long: the row's non-PAD tokens; ``offset`` ``(b,)`` long: the flat index
    (``session * width + column``) of the row's first token in the joined batch; ``total``
    ``(sessions,)`` long: each session's joined length; ``first_row`` ``(sessions,)`` long: each
    session's segment-0 row; ``sessions``, ``width``: the joined shape; ``segments``: the most segments
    of a session. ``turn_count``/``turn_offset`` ``(b,)`` (the row's own turns, and its session's
    earlier segments' turns) and ``target`` ``(b, t)`` (the flat joined index of every token, the spare
    slot ``sessions * width`` on PAD: the torch path's scatter/gather index) are computed when first read.
    """

    def __init__(self, spans, session, length, offset, total, first_row, sessions: int, width: int, segments: int, order):
        self.spans, self.session, self.length, self.offset, self.total = spans, session, length, offset, total
        self.first_row, self.sessions, self.width, self.segments, self._order = first_row, sessions, width, segments, order

    @functools.cached_property
    def target(self) -> torch.Tensor:
        columns = torch.arange(self.spans.shape[1], device=self.spans.device)
        return torch.where(columns < self.length.unsqueeze(1), self.offset.unsqueeze(1) + columns, self.sessions * self.width)

    @functools.cached_property
    def turn_count(self) -> torch.Tensor:
        lib = _compiled() if native.on_cpu(self.spans) and self.spans.dtype == torch.int8 else None
        if lib is None:
            assistant = self.spans == SpanKind.ASSISTANT
            return (assistant[:, 1:] & ~assistant[:, :-1]).sum(1) + assistant[:, :1].sum(1)
        out = torch.empty(self.spans.shape[0], dtype=torch.long)
        lib.row_turns(self.spans.data_ptr(), *self.spans.shape, self.length.data_ptr(), out.data_ptr())
        return out

    @functools.cached_property
    def turn_offset(self) -> torch.Tensor:
        return _exclusive_sums_in_session(self.turn_count, self._order, self.session[self._order], self.sessions)[0]


def _exclusive_sums_in_session(amount: torch.Tensor, order: torch.Tensor, sorted_session: torch.Tensor, sessions: int):
    """``(b,)`` the sum of ``amount`` over the earlier segments of each row's session (rows in
    ``order`` are sorted by session, then segment), and ``(sessions,)`` each session's total."""
    sorted_amount = amount[order]
    before = sorted_amount.cumsum(0) - sorted_amount
    start = torch.full((sessions,), torch.iinfo(torch.long).max, dtype=torch.long, device=amount.device)
    start = start.scatter_reduce(0, sorted_session, before, reduce="amin")
    total = torch.zeros(sessions, dtype=torch.long, device=amount.device).index_add_(0, sorted_session, sorted_amount)
    return torch.empty_like(before).scatter_(0, order, before - start[sorted_session]), total


def _sync_free(x: torch.Tensor) -> bool:
    """Whether reading a tensor's values on the host would stall an accelerator (then the joined width is
    an upper bound read from the shapes instead)."""
    return not x.is_cpu


def host_layout(session, segment, b: int, validate: bool) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """What :func:`session_join` reads on the host: ``(b,)`` dense session ids and segment numbers on the CPU,
    the number of sessions and the most segments of one (free for CPU tensors, one read otherwise);
    ``validate``: :func:`check_segments`."""
    sessions_cpu = row_ids(session, b, "session", what="session id").cpu()
    segment_cpu = segment_numbers(segment, b).cpu()
    dense_cpu = dense_ids(sessions_cpu)
    if validate:
        check_segments(dense_cpu, segment_cpu)
    return dense_cpu, segment_cpu, int(dense_cpu.max()) + 1 if b else 0, int(segment_cpu.max()) + 1 if b else 0


def session_join(spans: torch.Tensor, session, segment, validate: bool = True) -> SessionJoin:
    """The joined layout of a batch whose rows are segments of sessions.

    ``spans`` ``(b, t)`` SpanKind (PAD trails each row); ``session`` ``(b,)`` the session of each row
    (ints, strings or a tensor: :func:`row_ids`); ``segment`` ``(b,)`` its segment number. Session
    s's joined row holds its segments in segment order, each without its trailing PAD, then PAD.
    A row's turns continue its session's earlier segments' turns (a row has as many turns as
    ASSISTANT runs). ``validate`` raises ValueError naming the rows unless each session's segment
    numbers are exactly ``0..n-1``. The width is the longest session on the CPU, else ``t`` times
    the most segments (no sync).
    """
    b, t = spans.shape
    device = spans.device
    dense_cpu, segment_cpu, sessions, segments = host_layout(session, segment, b, validate)
    dense = dense_cpu.to(device)
    order = torch.argsort(dense * max(segments, 1) + segment_cpu.to(device))
    sorted_session = dense[order]
    length = _lengths(spans)
    offset, total = _exclusive_sums_in_session(length, order, sorted_session, sessions)
    width = max((int(total.max()) if sessions else 0) if not _sync_free(spans) else t * segments, 1)
    positions = torch.arange(b, device=device)
    first = torch.full((sessions,), b, dtype=torch.long, device=device).scatter_reduce(0, sorted_session, positions, "amin")
    return SessionJoin(spans, dense, length, dense * width + offset, total, order[first], sessions, width, segments, order)


def session_rows(session, segment, b: int, device: torch.device | str, validate: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The sessions of ``b`` rows without joining them: ``(b,)`` dense session ids on ``device``, ``(sessions,)``
    each session's segment-0 row (the row whose per-row fields, as its group, stand for the session; its
    lowest-numbered row if unvalidated) and the number of sessions. The host reads only the ids
    (:func:`host_layout`; ``validate``: :func:`check_segments`); the rest is a scatter on ``device``, no host sync."""
    dense_cpu, segment_cpu, sessions, _ = host_layout(session, segment, b, validate)
    dense, segment_ = dense_cpu.to(device), segment_cpu.to(device)
    key = segment_ * max(b, 1) + torch.arange(b, device=device)  # the lowest segment (0, when validated) wins
    first = torch.full((sessions,), torch.iinfo(torch.long).max, dtype=torch.long, device=device)
    return dense, first.scatter_reduce(0, dense, key, "amin") % max(b, 1), sessions


def segment_chain(session, segment, b: int, validate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How a scan carries a session across its rows without joining them: ``(order, next, level)``, ``(b,)``
    int64 CPU tensors. ``order``: the rows, every session's later segments first (segment numbers
    descending, stable); ``level``: the segment number of ``order[i]``; ``next``: for each row, the row of
    its session's next segment, -1 for a session's last. A right-to-left scan over the rows in ``order``,
    each starting from the state its ``next`` row ended with, is the scan of each session's segments laid
    end to end. ``validate``: :func:`check_segments` (host reads of the ids only, :func:`host_layout`)."""
    dense, segment_, sessions, segments = host_layout(session, segment, b, validate)
    order = torch.argsort(segment_, descending=True, stable=True)
    table = torch.full((sessions, segments + 1), -1, dtype=torch.long)
    table[dense, segment_] = torch.arange(b)
    return order, table[dense, segment_ + 1], segment_[order].contiguous()


def turn_layout(session, segment, turn_count: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row's turns go in its session's per-turn table, without joining the tokens: ``(b, n)`` the
    flat index (``session * N + turns of the session's earlier segments + k``) of row turn ``k`` in a
    ``(sessions, N)`` table, ``sessions * N`` (a spare slot) for ``k >= turn_count``; ``(sessions,)`` each
    session's turns; ``N`` (at least 1), the most turns of a session. ``turn_count`` ``(b,)`` long, each
    row's turns; ``n`` its per-row table width. Reads the ids and ``N`` on the host (a CPU path; the
    segments are not validated here: :func:`session_rows` does that)."""
    dense_cpu, segment_cpu, sessions, segments = host_layout(session, segment, turn_count.shape[0], False)
    device = turn_count.device
    dense = dense_cpu.to(device)
    order = torch.argsort(dense * max(segments, 1) + segment_cpu.to(device))
    offset, total = _exclusive_sums_in_session(turn_count, order, dense[order], sessions)
    most = max(int(total.max()) if sessions else 0, 1)
    k = torch.arange(n, device=device)
    return torch.where(k < turn_count.unsqueeze(1), (dense * most + offset).unsqueeze(1) + k, sessions * most), total, most


def check_segments(session: torch.Tensor, segment: torch.Tensor) -> None:
    """ValueError naming the rows unless the ``(b,)`` segment numbers of each session (dense ``(b,)``
    CPU ids) are exactly ``0, 1, .., n-1``: no duplicate, no gap, none negative."""
    if bool((segment < 0).any()):
        row = int(torch.nonzero(segment < 0)[0, 0])
        raise ValueError(f"segment: row {row} has segment number {int(segment[row])}; segments are numbered 0, 1, ..")
    order = torch.argsort(session * (int(segment.max()) + 1) + segment, stable=True) if len(segment) else segment
    s, g = session[order], segment[order]
    first = torch.ones_like(s, dtype=torch.bool)
    first[1:] = s[1:] != s[:-1]
    position = torch.arange(len(s))
    rank = position - torch.cummax(torch.where(first, position, 0), 0).values
    bad = torch.nonzero(g != rank)
    if len(bad):
        i = int(bad[0, 0])
        row = int(order[i])
        same = order[s == s[i]].tolist()
        if i > 0 and not first[i] and g[i] == g[i - 1]:
            raise ValueError(f"session of rows {sorted(same)}: rows {int(order[i - 1])} and {row} are both segment {int(g[i])}")
        raise ValueError(
            f"session of rows {sorted(same)}: segments {sorted(segment[same].tolist())}, expected 0..{len(same) - 1} "
            f"(row {row} is segment {int(g[i])} where segment {int(rank[i])} is missing)"
        )


def join_tokens(x: torch.Tensor, join: SessionJoin, fill=0) -> torch.Tensor:
    """``(b, t)`` -> ``(sessions, width)``: each row's non-PAD tokens at their joined positions,
    ``fill`` (0, or -1 for integers) elsewhere: one copy per row on the CPU (``native_join.c``), else one scatter."""
    lib = _compiled() if native.on_cpu(x) and fill in (0, -1) and not (fill and x.dtype.is_floating_point) else None
    if lib is None:
        flat = torch.full((join.sessions * join.width + 1,), fill, dtype=x.dtype, device=x.device)
        flat.scatter_(0, join.target.reshape(-1), x.reshape(-1))
        return flat[:-1].reshape(join.sessions, join.width)
    out = torch.empty(join.sessions, join.width, dtype=x.dtype)
    lib.join_rows(x.data_ptr(), out.data_ptr(), x.element_size(), *x.shape, *_pointers(join.length, join.offset),
                  join.sessions, join.width, join.total.data_ptr(), 0xFF if fill else 0)
    return out


def split_tokens(joined: torch.Tensor, join: SessionJoin) -> torch.Tensor:
    """``(sessions, width)`` -> ``(b, t)``: each row's tokens read back from the joined batch, exactly 0
    on PAD (the inverse of :func:`join_tokens` on non-PAD tokens): one copy per row on the CPU, else one gather."""
    b, t = join.spans.shape
    lib = _compiled() if native.on_cpu(joined) else None
    if lib is None:
        flat = torch.cat([joined.reshape(-1), joined.new_zeros(1)])
        return flat[join.target]
    out = torch.empty(b, t, dtype=joined.dtype)
    lib.split_rows(joined.data_ptr(), out.data_ptr(), joined.element_size(), b, t, *_pointers(join.length, join.offset))
    return out


def join_turn_ids(turn_ids: torch.Tensor, join: SessionJoin) -> torch.Tensor:
    """``(b, t)`` turn ids (-1 on PAD and before a row's first turn) -> the joined rows' ``(sessions,
    width)`` turn ids: each row's ids shifted by its session's earlier turns, -1 on PAD."""
    lib = _compiled() if native.on_cpu(turn_ids) and turn_ids.dtype in (torch.int16, torch.int64) else None
    if lib is None:
        return join_tokens(turn_ids.long() + join.turn_offset.unsqueeze(1), join, -1)
    out = torch.empty(join.sessions, join.width, dtype=turn_ids.dtype)
    lib.join_turn_ids(turn_ids.data_ptr(), out.data_ptr(), turn_ids.element_size(), *turn_ids.shape,
                      *_pointers(join.length, join.offset, join.turn_offset), join.sessions, join.width, join.total.data_ptr())
    return out


def _lengths(spans: torch.Tensor) -> torch.Tensor:
    """``(b,)`` long: each row's tokens before its trailing PAD (read from the row's end in C on the CPU)."""
    lib = _compiled() if native.on_cpu(spans) and spans.dtype == torch.int8 else None
    if lib is None:
        return (spans != SpanKind.PAD).sum(1)
    out = torch.empty(spans.shape[0], dtype=torch.long)
    lib.row_lengths(spans.data_ptr(), *spans.shape, out.data_ptr())
    return out


def _pointers(*tensors: torch.Tensor) -> list[int]:
    """The data pointers of contiguous int64 CPU tensors (the C loops' per-row arguments)."""
    return [x.data_ptr() for x in tensors]


@functools.cache
def _compiled():
    """``native_join.c`` compiled (:func:`masking.native.load`), or None (no compiler: the torch path)."""
    lib = native.load(SOURCE)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.join_rows.argtypes = [p, p, i64, i64, i64, p, p, i64, i64, p, i32]
    lib.join_turn_ids.argtypes = [p, p, i32, i64, i64, p, p, p, i64, i64, p]
    lib.split_rows.argtypes = [p, p, i64, i64, i64, p, p]
    lib.row_lengths.argtypes = [p, i64, i64, p]
    lib.row_turns.argtypes = [p, i64, i64, p, p]
    for function in (lib.join_rows, lib.join_turn_ids, lib.split_rows, lib.row_lengths, lib.row_turns):
        function.restype = None
    return lib


def join_turns(per_turn: torch.Tensor, join: SessionJoin, fill=-1) -> torch.Tensor:
    """``(b, m)`` per-turn entries (turn k of each row in column k) -> ``(sessions, n)`` with each
    row's turns after its session's earlier segments' turns; ``fill`` past a session's last turn.
    ``n`` is the most turns of a session: read on the host for CPU tensors, else ``m`` times the
    most segments (no sync)."""
    b, m = per_turn.shape
    device = per_turn.device
    count = join.turn_count.to(device)
    ends = join.turn_offset.to(device) + count
    n = (int(ends.max()) if b else 0) if not _sync_free(per_turn) else m * join.segments
    n = max(n, 1)
    columns = torch.arange(m, device=device)
    session = join.session.to(device)
    target = torch.where(columns < count.unsqueeze(1), (session * n + join.turn_offset.to(device)).unsqueeze(1) + columns,
                         join.sessions * n)
    flat = torch.full((join.sessions * n + 1,), fill, dtype=per_turn.dtype, device=device)
    flat.scatter_(0, target.reshape(-1), per_turn.reshape(-1))
    return flat[:-1].reshape(join.sessions, n)


def join_rows(per_row: torch.Tensor, join: SessionJoin) -> torch.Tensor:
    """``(b,)`` -> ``(sessions,)``: the value of each session's segment-0 row (a gather)."""
    return per_row[join.first_row]
