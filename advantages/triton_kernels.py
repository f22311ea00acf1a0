"""Fused Triton kernels for the carry-through scans (docs/design.md section 3, issue 7).

Both scans are linear recurrences run right to left, ``x_t = a_t * x_{t+1} + b_t``, with
``a_t`` in ``{decay, 1, 0}`` picked by the span kind: ASSISTANT steps, OBSERVATION carries the
state through unchanged, PAD resets it. One program owns one row and walks it in chunks of
``block`` tokens from the right; inside a chunk ``tl.associative_scan`` composes the affine maps
``(a, b)`` in reverse, and one scalar carries the state into the next chunk to the left. GAE
scans the pair ``(next_value, gae)`` the same way with 2x2 lower-triangular maps, so it needs no
shifted loads. Every token is read once and written once, so the kernels are bound by memory
bandwidth; accumulation is float32 for bfloat16/float16 inputs. The returns kernel can also
reduce each row's moments of the returns in the same pass (for REINFORCE++ whitening).

CUDA callers dispatch here through :func:`triton_available`; elsewhere ``advantages.returns`` runs
the compiled CPU loops (``advantages.native_scans``) or the torch scan (``advantages.scan``). Under
``TRITON_INTERPRET=1`` (set before ``triton`` is imported) the kernels also run on CPU tensors,
which is how the tests check them.
"""

import os

import torch

from masking.spans import SpanKind

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it CUDA tensors use the torch scan
    triton = None

DISABLE_ENV = "AGENT_LOOP_DISABLE_TRITON"
MAX_BLOCK = 4096  # the returns kernel's chunk at long rows (swept on an H200, issue 20)
MAX_BLOCK_GAE = 2048  # GAE scans five components per token: smaller chunks keep them in registers
DEFAULT_NUM_STAGES = 1  # no prefetching: the H200 sweep found it slower (BENCHMARKS.md, GPU kernel)
SPLIT_BLOCK = 2048  # chunk length when a row is split across programs
DEFAULT_SM_COUNT = 132  # an H100/H200; used when the device cannot be asked (the interpreter)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available(t: torch.Tensor) -> bool:
    """True when ``t`` lives on a CUDA device, Triton imports, and ``AGENT_LOOP_DISABLE_TRITON`` is unset."""
    return t.is_cuda and triton is not None and not os.environ.get(DISABLE_ENV)


if triton is not None:

    @triton.jit
    def _affine_combine(a_right, b_right, a_left, b_left):
        """Compose two maps ``x -> a*x + b`` in a reverse scan: the suffix to the right first, then the left one."""
        return a_right * a_left, a_left * b_right + b_left

    @triton.jit
    def _reverse_affine_scan(a, b, carry):
        """Apply the reverse inclusive scan of ``(a, b)`` to ``carry`` (the state right of the chunk).

        Returns the state at every position and the state at the chunk's first position, which is
        the carry for the chunk to its left.
        """
        a_scan, b_scan = tl.associative_scan((a, b), 0, _affine_combine, reverse=True)
        state = a_scan * carry + b_scan
        first = tl.sum(tl.where(tl.arange(0, a.shape[0]) == 0, state, 0.0), 0)
        return state, first

    @triton.jit
    def _merge_chunk_moments(count, mean, m2, value, keep):
        """Merge a chunk's moments of ``value`` where ``keep`` into the running ``(count, mean, M2)``.

        The chunk's moments about its own mean are merged with Chan et al.'s formula: no large sums
        of squares, so no cancellation in float32.
        """
        chunk_count = tl.sum(keep.to(tl.float32), 0)
        chunk_mean = tl.sum(tl.where(keep, value, 0.0), 0) / tl.maximum(chunk_count, 1.0)
        chunk_m2 = tl.sum(tl.where(keep, (value - chunk_mean) * (value - chunk_mean), 0.0), 0)
        total = count + chunk_count
        shift = chunk_mean - mean
        weight = chunk_count / tl.maximum(total, 1.0)
        return total, mean + shift * weight, m2 + chunk_m2 + shift * shift * count * weight

    @triton.jit
    def _returns_maps(rewards_ptr, spans_ptr, row, offs, t, gamma, ASSISTANT: tl.constexpr, OBSERVATION: tl.constexpr):
        """The affine maps ``state -> a * state + b`` of the tokens at ``offs`` of a row (PAD past its end)."""
        in_row = offs < t
        span = tl.load(spans_ptr + row + offs, mask=in_row, other=0)
        reward = tl.load(rewards_ptr + row + offs, mask=in_row, other=0.0).to(tl.float32)
        assistant = span == ASSISTANT
        a = tl.where(assistant, gamma, tl.where(span == OBSERVATION, 1.0, 0.0))
        b = tl.where(assistant, reward, 0.0)
        return a, b, assistant, in_row

    @triton.jit
    def _discounted_returns_kernel(
        rewards_ptr, spans_ptr, out_ptr, moments_ptr, t, gamma,
        BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr, ASSISTANT: tl.constexpr, OBSERVATION: tl.constexpr,
        MOMENTS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        row = pid * t
        n_chunks = tl.cdiv(t, BLOCK)
        carry = 0.0
        count = 0.0  # with MOMENTS: count, mean and M2 of the row's ASSISTANT returns so far
        mean = 0.0
        m2 = 0.0
        for i in tl.range(n_chunks, num_stages=NUM_STAGES):  # stages > 1 prefetch the next chunks
            offs = (n_chunks - 1 - i) * BLOCK + tl.arange(0, BLOCK)
            a, b, assistant, in_row = _returns_maps(rewards_ptr, spans_ptr, row, offs, t, gamma, ASSISTANT, OBSERVATION)
            running, carry = _reverse_affine_scan(a, b, carry)
            out = tl.where(assistant, running, 0.0)
            tl.store(out_ptr + row + offs, out.to(out_ptr.dtype.element_ty), mask=in_row)
            if MOMENTS:
                count, mean, m2 = _merge_chunk_moments(count, mean, m2, running, assistant)
        if MOMENTS:
            tl.store(moments_ptr + pid * 3, count)
            tl.store(moments_ptr + pid * 3 + 1, mean)
            tl.store(moments_ptr + pid * 3 + 2, m2)

    @triton.jit
    def _returns_chunk_maps_kernel(
        rewards_ptr, spans_ptr, maps_ptr, t, gamma,
        BLOCK: tl.constexpr, ASSISTANT: tl.constexpr, OBSERVATION: tl.constexpr,
    ):
        """Split rows, pass 1: program ``(row, chunk)`` composes its chunk's maps into one ``(A, B)``."""
        row_id, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        a, b, _, _ = _returns_maps(rewards_ptr, spans_ptr, row_id * t, offs, t, gamma, ASSISTANT, OBSERVATION)
        a_scan, b_scan = tl.associative_scan((a, b), 0, _affine_combine, reverse=True)
        first = tl.arange(0, BLOCK) == 0
        slot = maps_ptr + (row_id * tl.num_programs(1) + chunk) * 2
        tl.store(slot, tl.sum(tl.where(first, a_scan, 0.0), 0))
        tl.store(slot + 1, tl.sum(tl.where(first, b_scan, 0.0), 0))

    @triton.jit
    def _returns_split_kernel(
        rewards_ptr, spans_ptr, maps_ptr, out_ptr, moments_ptr, t, gamma,
        BLOCK: tl.constexpr, CHUNKS: tl.constexpr, ASSISTANT: tl.constexpr, OBSERVATION: tl.constexpr,
        MOMENTS: tl.constexpr,
    ):
        """Split rows, pass 2: program ``(row, chunk)`` composes the maps of the chunks to its right
        (a reverse scan over at most ``CHUNKS`` of them) into its carry, then scans its own chunk.
        With ``MOMENTS`` it writes its chunk's count, mean and M2 of the ASSISTANT returns."""
        row_id, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        n_chunks = tl.num_programs(1)
        j = tl.arange(0, CHUNKS)
        right = (j > chunk) & (j < n_chunks)
        maps = maps_ptr + (row_id * n_chunks + j) * 2
        a_right = tl.load(maps, mask=right, other=1.0)  # the identity map elsewhere
        b_right = tl.load(maps + 1, mask=right, other=0.0)
        _, b_scan = tl.associative_scan((a_right, b_right), 0, _affine_combine, reverse=True)
        carry = tl.sum(tl.where(j == 0, b_scan, 0.0), 0)  # the maps right of this chunk applied to 0
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        row = row_id * t
        a, b, assistant, in_row = _returns_maps(rewards_ptr, spans_ptr, row, offs, t, gamma, ASSISTANT, OBSERVATION)
        running, _ = _reverse_affine_scan(a, b, carry)
        tl.store(out_ptr + row + offs, tl.where(assistant, running, 0.0).to(out_ptr.dtype.element_ty), mask=in_row)
        if MOMENTS:
            count, mean, m2 = _merge_chunk_moments(0.0, 0.0, 0.0, running, assistant)
            slot = moments_ptr + (row_id * n_chunks + chunk) * 3
            tl.store(slot, count)
            tl.store(slot + 1, mean)
            tl.store(slot + 2, m2)

    @triton.jit
    def _gae_combine(p_r, q_r, s_r, u_r, w_r, p_l, q_l, s_l, u_l, w_l):
        """Compose two maps of the GAE state ``(next_value, gae)`` in a reverse scan, right one first.

        A map is ``next_value' = p*next_value + u``, ``gae' = q*next_value + s*gae + w``: a lower
        triangular 2x2 matrix ``[[p, 0], [q, s]]`` plus an offset ``(u, w)``, closed under composition.
        """
        return (
            p_l * p_r,
            q_l * p_r + s_l * q_r,
            s_l * s_r,
            p_l * u_r + u_l,
            q_l * u_r + s_l * w_r + w_l,
        )

    @triton.jit
    def _gae_maps(rewards_ptr, values_ptr, spans_ptr, row, offs, t, gamma, lam, ASSISTANT: tl.constexpr, OBSERVATION: tl.constexpr):
        """The maps ``(p, q, s, u, w)`` of :func:`_gae_combine` of the tokens at ``offs`` of a row (PAD
        past its end), and their values, ASSISTANT flags and in-row flags.

        ASSISTANT: ``next_value' = v``, ``gae' = (r - v) + gamma*next_value + gamma*lam*gae``;
        OBSERVATION: the identity map; PAD: the zero map (both reset).
        """
        in_row = offs < t
        span = tl.load(spans_ptr + row + offs, mask=in_row, other=0)
        reward = tl.load(rewards_ptr + row + offs, mask=in_row, other=0.0).to(tl.float32)
        value = tl.load(values_ptr + row + offs, mask=in_row, other=0.0).to(tl.float32)
        assistant = span == ASSISTANT
        carried = tl.where(span == OBSERVATION, 1.0, 0.0)
        p = carried
        q = tl.where(assistant, gamma, 0.0)
        s = tl.where(assistant, gamma * lam, carried)
        u = tl.where(assistant, value, 0.0)
        w = tl.where(assistant, reward - value, 0.0)
        return p, q, s, u, w, value, assistant, in_row

    @triton.jit
    def _gae_kernel(
        rewards_ptr, values_ptr, spans_ptr, adv_ptr, ret_ptr, moments_ptr, t, gamma, lam,
        BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr, ASSISTANT: tl.constexpr, OBSERVATION: tl.constexpr,
        MOMENTS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        row = pid * t
        n_chunks = tl.cdiv(t, BLOCK)
        first = tl.arange(0, BLOCK) == 0
        next_value_carry = 0.0
        gae_carry = 0.0
        count = 0.0  # with MOMENTS: count, mean and M2 of the row's ASSISTANT advantages so far
        mean = 0.0
        m2 = 0.0
        for i in tl.range(n_chunks, num_stages=NUM_STAGES):
            offs = (n_chunks - 1 - i) * BLOCK + tl.arange(0, BLOCK)
            p, q, s, u, w, value, assistant, in_row = _gae_maps(
                rewards_ptr, values_ptr, spans_ptr, row, offs, t, gamma, lam, ASSISTANT, OBSERVATION
            )
            p, q, s, u, w = tl.associative_scan((p, q, s, u, w), 0, _gae_combine, reverse=True)
            next_value = p * next_value_carry + u
            gae = q * next_value_carry + s * gae_carry + w
            next_value_carry = tl.sum(tl.where(first, next_value, 0.0), 0)
            gae_carry = tl.sum(tl.where(first, gae, 0.0), 0)
            advantage = tl.where(assistant, gae, 0.0)
            ret = tl.where(assistant, gae + value, 0.0)
            tl.store(adv_ptr + row + offs, advantage.to(adv_ptr.dtype.element_ty), mask=in_row)
            tl.store(ret_ptr + row + offs, ret.to(ret_ptr.dtype.element_ty), mask=in_row)
            if MOMENTS:
                count, mean, m2 = _merge_chunk_moments(count, mean, m2, gae, assistant)
        if MOMENTS:
            tl.store(moments_ptr + pid * 3, count)
            tl.store(moments_ptr + pid * 3 + 1, mean)
            tl.store(moments_ptr + pid * 3 + 2, m2)

    @triton.jit
    def _gae_chunk_maps_kernel(
        rewards_ptr, values_ptr, spans_ptr, maps_ptr, t, gamma, lam,
        BLOCK: tl.constexpr, ASSISTANT: tl.constexpr, OBSERVATION: tl.constexpr,
    ):
        """Split rows, pass 1: program ``(row, chunk)`` composes its chunk's GAE maps into one ``(p, q, s, u, w)``."""
        row_id, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        p, q, s, u, w, _, _, _ = _gae_maps(rewards_ptr, values_ptr, spans_ptr, row_id * t, offs, t, gamma, lam, ASSISTANT, OBSERVATION)
        p, q, s, u, w = tl.associative_scan((p, q, s, u, w), 0, _gae_combine, reverse=True)
        first = tl.arange(0, BLOCK) == 0
        slot = maps_ptr + (row_id * tl.num_programs(1) + chunk) * 5
        tl.store(slot, tl.sum(tl.where(first, p, 0.0), 0))
        tl.store(slot + 1, tl.sum(tl.where(first, q, 0.0), 0))
        tl.store(slot + 2, tl.sum(tl.where(first, s, 0.0), 0))
        tl.store(slot + 3, tl.sum(tl.where(first, u, 0.0), 0))
        tl.store(slot + 4, tl.sum(tl.where(first, w, 0.0), 0))

    @triton.jit
    def _gae_split_kernel(
        rewards_ptr, values_ptr, spans_ptr, maps_ptr, adv_ptr, ret_ptr, moments_ptr, t, gamma, lam,
        BLOCK: tl.constexpr, CHUNKS: tl.constexpr, ASSISTANT: tl.constexpr, OBSERVATION: tl.constexpr,
        MOMENTS: tl.constexpr,
    ):
        """Split rows, pass 2 (GAE): compose the maps of the chunks to the right into the carried
        ``(next_value, gae)`` (the maps applied to ``(0, 0)``), then scan this chunk. With
        ``MOMENTS`` write this chunk's count, mean and M2 of the ASSISTANT advantages."""
        row_id, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        n_chunks = tl.num_programs(1)
        j = tl.arange(0, CHUNKS)
        right = (j > chunk) & (j < n_chunks)
        maps = maps_ptr + (row_id * n_chunks + j) * 5
        p_right = tl.load(maps, mask=right, other=1.0)  # the identity map elsewhere
        q_right = tl.load(maps + 1, mask=right, other=0.0)
        s_right = tl.load(maps + 2, mask=right, other=1.0)
        u_right = tl.load(maps + 3, mask=right, other=0.0)
        w_right = tl.load(maps + 4, mask=right, other=0.0)
        _, _, _, u_scan, w_scan = tl.associative_scan((p_right, q_right, s_right, u_right, w_right), 0, _gae_combine, reverse=True)
        next_value_carry = tl.sum(tl.where(j == 0, u_scan, 0.0), 0)
        gae_carry = tl.sum(tl.where(j == 0, w_scan, 0.0), 0)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        row = row_id * t
        p, q, s, u, w, value, assistant, in_row = _gae_maps(rewards_ptr, values_ptr, spans_ptr, row, offs, t, gamma, lam, ASSISTANT, OBSERVATION)
        p, q, s, u, w = tl.associative_scan((p, q, s, u, w), 0, _gae_combine, reverse=True)
        gae = q * next_value_carry + s * gae_carry + w
        tl.store(adv_ptr + row + offs, tl.where(assistant, gae, 0.0).to(adv_ptr.dtype.element_ty), mask=in_row)
        tl.store(ret_ptr + row + offs, tl.where(assistant, gae + value, 0.0).to(ret_ptr.dtype.element_ty), mask=in_row)
        if MOMENTS:
            count, mean, m2 = _merge_chunk_moments(0.0, 0.0, 0.0, gae, assistant)
            slot = moments_ptr + (row_id * n_chunks + chunk) * 3
            tl.store(slot, count)
            tl.store(slot + 1, mean)
            tl.store(slot + 2, m2)

    @triton.jit
    def _whitening_stats_kernel(moments_ptr, stats_ptr, b, eps, ROWS: tl.constexpr):
        """One program: the batch's mean and whitening scale ``1 / sqrt(var + eps)`` (Bessel-corrected;
        0 below 2 tokens, so the whitened values are 0: advantages/stats.py) from per-row ``(count, mean, M2)``, merged in float64 a block of rows at a
        time (Chan et al.)."""
        count = tl.zeros((), tl.float64)
        mean = tl.zeros((), tl.float64)
        m2 = tl.zeros((), tl.float64)
        for start in range(0, b, ROWS):
            rows = start + tl.arange(0, ROWS)
            keep = rows < b
            row_count = tl.load(moments_ptr + rows * 3, mask=keep, other=0.0).to(tl.float64)
            row_mean = tl.load(moments_ptr + rows * 3 + 1, mask=keep, other=0.0).to(tl.float64)
            row_m2 = tl.load(moments_ptr + rows * 3 + 2, mask=keep, other=0.0).to(tl.float64)
            block_count = tl.sum(row_count, 0)
            block_mean = tl.sum(row_count * row_mean, 0) / tl.maximum(block_count, 1.0)
            block_m2 = tl.sum(row_m2 + row_count * (row_mean - block_mean) * (row_mean - block_mean), 0)
            total = count + block_count
            shift = block_mean - mean
            weight = block_count / tl.maximum(total, 1.0)
            mean = mean + shift * weight
            m2 = m2 + block_m2 + shift * shift * count * weight
            count = total
        scale = 1.0 / tl.sqrt(m2 / (count - 1.0) + eps)
        scale = tl.where(count >= 2.0, scale, 0.0)
        tl.store(stats_ptr, mean.to(tl.float32))
        tl.store(stats_ptr + 1, scale.to(tl.float32))

    @triton.jit
    def _whiten_kernel(values_ptr, spans_ptr, out_ptr, stats_ptr, size, BLOCK: tl.constexpr, ASSISTANT: tl.constexpr):
        """``(value - mean) * scale`` on ASSISTANT tokens, exactly 0 elsewhere."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < size
        mean = tl.load(stats_ptr)
        scale = tl.load(stats_ptr + 1)
        value = tl.load(values_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        span = tl.load(spans_ptr + offs, mask=keep, other=0)
        whitened = tl.where(span == ASSISTANT, (value - mean) * scale, 0.0)
        tl.store(out_ptr + offs, whitened.to(out_ptr.dtype.element_ty), mask=keep)


def launch_config(
    t: int, block: int | None = None, num_warps: int | None = None, num_stages: int | None = None, max_block: int = MAX_BLOCK
):
    """Chunk length, warps and pipeline depth for rows of length ``t``; ``None`` picks the default.

    Longer chunks keep more bytes in flight per program (one program per row leaves most of the
    GPU's latency hiding to each program); ``num_stages > 1`` prefetches later chunks with
    asynchronous copies while the current one is scanned. Defaults from ``benchmarks/gpu_returns.py
    --sweep`` on an H200 (issue 20): chunks up to ``max_block`` (4096 for the returns kernel,
    :data:`MAX_BLOCK_GAE` for GAE), 8 warps above 1024 tokens, 1 stage.
    """
    block = block or min(max_block, max(16, triton.next_power_of_2(t)))
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    num_warps = num_warps or (4 if block <= 1024 else 8)
    num_stages = num_stages or DEFAULT_NUM_STAGES
    return block, num_warps, num_stages


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (:data:`DEFAULT_SM_COUNT` elsewhere)."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def use_split(b: int, t: int, block: int, device: torch.device) -> bool:
    """Whether to split rows across programs: when the rows are fewer than the GPU's SMs (one
    program per row would leave most of them idle) and each row spans at least 4 chunks of
    :data:`SPLIT_BLOCK`. The split reads the inputs twice, so it is kept for few long rows."""
    return b < sm_count(device) and t >= 4 * SPLIT_BLOCK


def _check_inputs(spans: torch.Tensor, **floats: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch scan in advantages.returns")
    if spans.dim() != 2 or spans.dtype != torch.int8:
        raise ValueError(f"spans must be a (b, t) int8 tensor, got {spans.dtype} of shape {tuple(spans.shape)}")
    for name, x in floats.items():
        if x.shape != spans.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, spans has {tuple(spans.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
        if x.device != spans.device:
            raise ValueError(f"{name} is on {x.device}, spans on {spans.device}")
    if not spans.is_cuda and not os.environ.get("TRITON_INTERPRET"):
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 before importing triton), got {spans.device}")


def triton_discounted_returns(
    rewards: torch.Tensor,
    spans: torch.Tensor,
    gamma: float,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """Carry-through discounted returns (REINFORCE++), one fused pass.

    ``rewards`` ``(b, t)`` float32/bfloat16/float16 and ``spans`` ``(b, t)`` int8 SpanKind ->
    returns ``(b, t)`` in the rewards' dtype (float32 accumulation). Right to left with ``R = 0``:
    ASSISTANT ``R = r_t + gamma * R`` and returns ``R``; OBSERVATION keeps ``R`` and returns 0;
    PAD sets ``R = 0`` and returns 0. Span values other than the three kinds act as PAD; the
    caller validates them. ``block``, ``num_warps``, ``num_stages``: see :func:`launch_config`.
    ``split`` runs each row as chunks of ``block`` (default :data:`SPLIT_BLOCK`) on separate
    programs (pass 1: each chunk's composed map; pass 2: each chunk composes the maps to its right
    into its carry and scans itself); ``None`` picks it by :func:`use_split`.
    """
    return _launch_returns(rewards, spans, gamma, False, block, num_warps, num_stages, split)[0]


def triton_discounted_returns_with_moments(
    rewards: torch.Tensor,
    spans: torch.Tensor,
    gamma: float,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`triton_discounted_returns` plus, in the same pass, each row's moments for whitening.

    Returns ``(returns, moments)``: ``moments`` is ``(b, 3)`` float32, per row the count, mean and
    sum of squared deviations (M2) of the float32 returns on ASSISTANT tokens. Whitening over the
    batch (REINFORCE++) is then :func:`triton_whiten`: the rows' moments merged by one program and
    one elementwise pass, instead of two more reductions over ``(b, t)``. Split rows merge their
    chunks' moments per row (no host sync).
    """
    return _launch_returns(rewards, spans, gamma, True, block, num_warps, num_stages, split)


WHITEN_BLOCK = 4096  # tokens per program of the whitening pass
STATS_ROWS = 1024  # rows' moments merged at a time by the one-program stats kernel


def triton_whiten(values: torch.Tensor, spans: torch.Tensor, moments: torch.Tensor, eps: float) -> torch.Tensor:
    """Whiten ``(b, t)`` ``values`` over the batch's ASSISTANT tokens from their per-row moments.

    ``moments`` is ``(b, 3)`` float32 per-row ``(count, mean, M2)`` of ``values`` on ASSISTANT tokens
    (from :func:`triton_discounted_returns_with_moments` or :func:`triton_gae_with_moments`). Returns
    ``(values - mean) / sqrt(var + eps)`` (Bessel-corrected) on ASSISTANT tokens, exactly 0
    elsewhere, in ``values``' dtype (float32 arithmetic); below 2 ASSISTANT tokens 0 everywhere
    (:mod:`advantages.stats` says why). Two launches, no host sync: one program merges the rows'
    moments in float64 (Chan et al.), then one elementwise pass.
    """
    _check_inputs(spans, values=values)
    values, spans = values.contiguous(), spans.contiguous()
    out = torch.empty_like(values)
    if values.numel():
        stats = torch.empty(2, dtype=torch.float32, device=values.device)  # mean, scale
        _whitening_stats_kernel[(1,)](moments.float().contiguous(), stats, spans.shape[0], float(eps), ROWS=STATS_ROWS)
        grid = (triton.cdiv(values.numel(), WHITEN_BLOCK),)
        _whiten_kernel[grid](values, spans, out, stats, values.numel(), BLOCK=WHITEN_BLOCK, ASSISTANT=int(SpanKind.ASSISTANT))
    return out


def merge_moments(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(count, mean, M2)`` ``(b, 3)`` -> the batch's count, mean and Bessel-corrected
    variance (0-d float64 tensors; no host sync). The variance is NaN when count < 2."""
    count, mean, m2 = moments.double().unbind(-1)
    total = count.sum()
    batch_mean = (count * mean).sum() / total
    batch_m2 = m2.sum() + (count * (mean - batch_mean) ** 2).sum()
    return total, batch_mean, batch_m2 / (total - 1)


def merge_row_moments(moments: torch.Tensor) -> torch.Tensor:
    """``(b, k, 3)`` moments of ``k`` parts of each row -> ``(b, 3)`` float32 (Chan et al.), no host sync."""
    count, mean, m2 = moments.unbind(-1)
    total = count.sum(-1)
    row_mean = (count * mean).sum(-1) / total.clamp(min=1.0)
    row_m2 = m2.sum(-1) + (count * (mean - row_mean.unsqueeze(-1)) ** 2).sum(-1)
    return torch.stack([total, row_mean, row_m2], -1)


def _launch_returns(rewards, spans, gamma, moments, block, num_warps, num_stages, split):
    _check_inputs(spans, rewards=rewards)
    b, t = spans.shape
    if split is None:
        split = use_split(b, t, block or SPLIT_BLOCK, spans.device)
    block, num_warps, num_stages = launch_config(t, block or (SPLIT_BLOCK if split else None), num_warps, num_stages)
    rewards, spans = rewards.contiguous(), spans.contiguous()
    returns = torch.empty_like(rewards)
    kinds = dict(ASSISTANT=int(SpanKind.ASSISTANT), OBSERVATION=int(SpanKind.OBSERVATION))
    if not split:
        row_moments = torch.empty(b, 3, dtype=torch.float32, device=rewards.device)  # written only with moments
        if b and t:
            _discounted_returns_kernel[(b,)](
                rewards, spans, returns, row_moments, t, float(gamma),
                BLOCK=block, NUM_STAGES=num_stages, MOMENTS=moments, num_warps=num_warps, **kinds,
            )
        return returns, row_moments
    n_chunks = triton.cdiv(t, block)
    maps = torch.empty(b, n_chunks, 2, dtype=torch.float32, device=rewards.device)
    chunk_moments = torch.empty(b, n_chunks, 3, dtype=torch.float32, device=rewards.device)
    if b and t:
        grid = (b, n_chunks)
        _returns_chunk_maps_kernel[grid](rewards, spans, maps, t, float(gamma), BLOCK=block, num_warps=num_warps, **kinds)
        _returns_split_kernel[grid](
            rewards, spans, maps, returns, chunk_moments, t, float(gamma),
            BLOCK=block, CHUNKS=max(2, triton.next_power_of_2(n_chunks)), MOMENTS=moments, num_warps=num_warps, **kinds,
        )
    return returns, merge_row_moments(chunk_moments) if moments else chunk_moments


def triton_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    spans: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry-through GAE (verl PR #2337), one fused pass; advantages are not whitened.

    ``rewards``, ``values`` ``(b, t)`` float and ``spans`` ``(b, t)`` int8 SpanKind ->
    ``(advantages, returns)`` ``(b, t)`` in the rewards' dtype (float32 accumulation). Right to
    left with ``next_value = gae = 0``: ASSISTANT ``delta = r_t + gamma * next_value - v_t``,
    ``gae = delta + gamma * lam * gae``, ``next_value = v_t``; OBSERVATION carries both; PAD
    resets both to 0. Advantages are ``gae`` and returns ``gae + v_t`` on ASSISTANT tokens, the
    same values as verl's loop there; every other position gets exactly 0 (verl leaves the carried
    values there, which its loss masks out). ``split``: rows as chunks on separate programs, as in
    :func:`triton_discounted_returns` (the carried state is the pair ``(next_value, gae)``).
    """
    return _launch_gae(rewards, values, spans, gamma, lam, False, block, num_warps, num_stages, split)[:2]


def triton_gae_with_moments(
    rewards: torch.Tensor,
    values: torch.Tensor,
    spans: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`triton_gae` plus, in the same pass, each row's ``(count, mean, M2)`` ``(b, 3)`` float32
    of the float32 advantages on ASSISTANT tokens (for ``gae(whiten=True)``; see :func:`triton_whiten`)."""
    return _launch_gae(rewards, values, spans, gamma, lam, True, block, num_warps, num_stages, split)


def _launch_gae(rewards, values, spans, gamma, lam, moments, block, num_warps, num_stages, split=None):
    _check_inputs(spans, rewards=rewards, values=values)
    b, t = spans.shape
    if split is None:
        split = use_split(b, t, block or SPLIT_BLOCK, spans.device)
    block, num_warps, num_stages = launch_config(
        t, block or (SPLIT_BLOCK if split else None), num_warps, num_stages, max_block=MAX_BLOCK_GAE
    )
    rewards, values, spans = rewards.contiguous(), values.contiguous(), spans.contiguous()
    advantages = torch.empty_like(rewards)
    returns = torch.empty_like(rewards)
    kinds = dict(ASSISTANT=int(SpanKind.ASSISTANT), OBSERVATION=int(SpanKind.OBSERVATION))
    scalars = (t, float(gamma), float(lam))
    if not split:
        row_moments = torch.empty(b, 3, dtype=torch.float32, device=rewards.device)  # written only with moments
        if b and t:
            _gae_kernel[(b,)](
                rewards, values, spans, advantages, returns, row_moments, *scalars,
                BLOCK=block, NUM_STAGES=num_stages, MOMENTS=moments, num_warps=num_warps, **kinds,
            )
        return advantages, returns, row_moments
    n_chunks = triton.cdiv(t, block)
    maps = torch.empty(b, n_chunks, 5, dtype=torch.float32, device=rewards.device)
    chunk_moments = torch.empty(b, n_chunks, 3, dtype=torch.float32, device=rewards.device)
    if b and t:
        grid = (b, n_chunks)
        _gae_chunk_maps_kernel[grid](rewards, values, spans, maps, *scalars, BLOCK=block, num_warps=num_warps, **kinds)
        _gae_split_kernel[grid](
            rewards, values, spans, maps, advantages, returns, chunk_moments, *scalars,
            BLOCK=block, CHUNKS=max(2, triton.next_power_of_2(n_chunks)), MOMENTS=moments, num_warps=num_warps, **kinds,
        )
    return advantages, returns, merge_row_moments(chunk_moments) if moments else chunk_moments
