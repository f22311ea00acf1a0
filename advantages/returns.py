"""Carry-through discounted returns and GAE for multi-turn trajectories (docs/design.md section 3).

Scanning right to left with a running return ``R`` (0 at the right end):

=============  ========================  ===========
span at t      R becomes                 returns[t]
=============  ========================  ===========
ASSISTANT      ``r_t + gamma * R``       the new R
OBSERVATION    unchanged (carried)       0
PAD            0 (episode boundary)      0
=============  ========================  ===========

Mask-only input (``spans=None``) treats every 0 of ``response_mask`` as OBSERVATION: exactly verl
after PR #7300 (REINFORCE++) and PR #2337 (GAE). PAD only trails a row (``validate=True`` checks
it), so ``R`` is already 0 there and the torch scans need only the mask; with ``validate=False`` an
interior PAD (invalid input) is treated like an OBSERVATION by the torch scans and the compiled
loops, and as a reset by the Triton kernels. The two historical bugs are kept for ablations and inspection:
:func:`returns_reset_at_observation` (verl before PR #7300) and :func:`returns_ignore_mask`.

On CUDA, :mod:`advantages.triton_kernels` runs the same scans as one fused kernel when Triton is
importable; on CPU the compiled loops of :mod:`advantages.native_scans` run (float32/float64, with a
C compiler); everywhere else the torch scans of :mod:`advantages.scan`.
"""

import functools

import torch

from advantages.native_scans import native_gae, native_returns, native_whitened_returns
from advantages.scan import by_row_blocks, carry_scan, fill_from_right
from advantages.stats import WHITEN_EPS, accumulation_dtype, check_whitenable  # defined once there
from masking.spans import SPAN_DTYPE, spans_from_response_mask
from masking.validate import as_dtype, check_same_shape, validate_batch

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GAE_ONE_SCAN_MIN_LAM = 0.5  # GAE in one scan from here: its rounding error grows like 1 / lam (_gae_scan)


def check_discount(name: str, value: float) -> None:
    """Raise ValueError unless ``value`` is a Python number in ``[0, 1]`` (a tensor would need a host sync)."""
    if isinstance(value, torch.Tensor) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def check_batch(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    spans: torch.Tensor | None,
    validate: bool,
    count: bool = False,
) -> int | None:
    """Check a batch before a scan; shapes always (free), values only with ``validate``.

    ``validate`` (:func:`~masking.validate.validate_batch`: one fused pass, one host sync) raises
    ValueError naming row and position for unknown span values, PAD before a non-PAD token, a mask
    that is not 0/1 or disagrees with the spans, NaN/inf rewards, and a nonzero reward on a
    non-ASSISTANT token (it would be lost). With ``count`` (and ``validate``) returns the number
    of ASSISTANT tokens, read in the same sync; else None.
    """
    check_same_shape("response_mask", response_mask, "token_level_rewards", token_level_rewards)
    if spans is not None:
        check_same_shape("spans", spans, "token_level_rewards", token_level_rewards)
    if not validate:
        return None
    if not token_level_rewards.dtype.is_floating_point:
        raise ValueError(f"rewards must be floating point, got {token_level_rewards.dtype}")
    return validate_batch(token_level_rewards, response_mask, spans, count=count)


def assistant_steps(response_mask: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The ASSISTANT mask as 0/1 floats of the scan dtype: float64 stays float64, float32, float16
    and bfloat16 scan in float32. The mask equals ``spans == ASSISTANT`` (validated), so the torch
    scans need only the mask."""
    if not rewards.dtype.is_floating_point:
        raise ValueError(f"rewards must be floating point, got {rewards.dtype}")
    return as_dtype(response_mask, accumulation_dtype(rewards.dtype))


def _spans(response_mask: torch.Tensor, spans: torch.Tensor | None) -> torch.Tensor:
    """int8 spans for the Triton kernels; mask-only input makes every 0 an OBSERVATION."""
    return spans_from_response_mask(response_mask) if spans is None else spans.to(SPAN_DTYPE)


def _triton(x: torch.Tensor):
    """The Triton kernels module when ``x`` is a CUDA tensor it can take, else None (imported lazily)."""
    if not x.is_cuda or x.dtype not in _TRITON_DTYPES:
        return None
    import advantages.triton_kernels as triton_kernels  # imports triton (optional): CUDA tensors only

    return triton_kernels if triton_kernels.triton_available(x) else None


def discounted_returns(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    spans: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Carry-through discounted return of every ASSISTANT token (REINFORCE++, arXiv:2501.03262).

    Args:
        rewards: ``(b, t)`` float token-level rewards, nonzero only on ASSISTANT tokens.
        response_mask: ``(b, t)`` 1 on ASSISTANT tokens, 0 elsewhere.
        gamma: discount in ``[0, 1]``, applied once per ASSISTANT token (observations cost no step).
        spans: optional ``(b, t)`` SpanKind; without it every 0 of the mask is an OBSERVATION
            (verl after PR #7300).
        validate: check spans, mask and rewards first (ValueError naming row and position; one fused
            pass, one host sync); the scan then skips zeroing the rewards off the mask. Pass False in
            the hot path.

    Returns:
        ``(b, t)`` returns in the rewards' dtype and device: the running return ``R`` on ASSISTANT
        tokens, exactly 0 on OBSERVATION and PAD tokens (module docstring table).
    """
    check_discount("gamma", gamma)
    check_batch(rewards, response_mask, spans, validate)
    kernels = _triton(rewards)
    if kernels is not None:
        return kernels.triton_discounted_returns(rewards, _spans(response_mask, spans), gamma)
    return _returns_without_triton(rewards, assistant_steps(response_mask, rewards), gamma, masked=validate)


def whitened_discounted_returns(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    *,
    spans: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages and returns: :func:`discounted_returns`, whitened over every ASSISTANT
    token of the batch (arXiv:2501.03262; verl's ``masked_whiten`` of the returns, eps :data:`WHITEN_EPS`).

    ``(b, t)`` inputs as in :func:`discounted_returns`; returns ``(advantages, returns)``, ``(b, t)``
    in the rewards' dtype, exactly 0 off ASSISTANT tokens. On CUDA the Triton kernel reduces the
    moments per row while it scans, and one elementwise pass whitens; on CPU the compiled loop
    sums each group of rows' moments (in double) just after scanning it, and one more pass whitens
    (:func:`~advantages.native_scans.native_whitened_returns`); where it cannot run, the torch
    scan's returns are whitened by :func:`whiten_zero_off_mask`. No host sync without
    ``validate``. ``validate`` also requires :data:`~advantages.stats.MIN_WHITEN_TOKENS` ASSISTANT
    tokens (in the same sync), raising ``ValueError`` as verl's ``masked_whiten`` does; without it
    such a batch gets advantages exactly 0 everywhere (:mod:`advantages.stats`; every path).
    """
    check_discount("gamma", gamma)
    count = check_batch(token_level_rewards, response_mask, spans, validate, count=True)
    if validate:
        check_whitenable(count)
    kernels = _triton(token_level_rewards)
    if kernels is not None:
        spans8 = _spans(response_mask, spans)
        returns, row_moments = kernels.triton_discounted_returns_with_moments(token_level_rewards, spans8, gamma)
        return kernels.triton_whiten(returns, spans8, row_moments, WHITEN_EPS), returns
    steps = assistant_steps(response_mask, token_level_rewards)
    whitened = native_whitened_returns(token_level_rewards, steps, gamma, WHITEN_EPS)
    if whitened is not None:
        return whitened
    returns = _returns_without_triton(token_level_rewards, steps, gamma, masked=validate)
    return whiten_zero_off_mask(returns, steps, count), returns


def whiten_zero_off_mask(values: torch.Tensor, steps: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """``(values - mean) / sqrt(var + WHITEN_EPS)`` over the steps, exactly 0 elsewhere; ``(b, t)``.

    ``values`` must be exactly 0 off the steps (the scans' outputs are), so the masked sum is a plain
    sum. Two passes for the moments, in the scan dtype (float32 for half precisions): the sum
    (a cascade sum, so the mean is accurate) and the squares of the centred values summed per row
    by a batched dot product, rows added in float64 (Bessel-corrected). Then one in-place pass
    scales the centred values. ``count`` (the number of steps, when known on the host: validated,
    so at least 2) saves a reduction. No host sync. Without ``count``, fewer than 2 steps give
    exactly 0 everywhere (:mod:`advantages.stats`): the divisors are clamped to 1, so the centred
    values are exactly 0 (none, or ``v - v``) and their sum of squares is 0.
    """
    work = as_dtype(values, steps.dtype)
    if count is None:  # on the device; clamped, since 0/0 would make every position NaN
        n = steps.sum()
        tokens, pairs = n.clamp(min=1), (n - 1).clamp_(min=1)
    else:
        tokens, pairs = count, count - 1
    # A non-finite value on a step (unvalidated rewards, or GAE's values) makes the mean or the scale
    # non-finite, and 0 * NaN would reach every position: they are made finite, so off the steps the
    # result stays exactly 0, while the step holding the bad value stays NaN.
    mean = work.sum().div_(tokens).nan_to_num_(0.0, 0.0, 0.0)
    centred = torch.addcmul(work, steps, mean, value=-1)  # values - mean on the steps, 0 elsewhere
    rows = centred.unsqueeze(1)  # (b, 1, t): one dot product per row
    m2 = torch.bmm(rows, rows.transpose(1, 2)).sum(dtype=torch.float64)
    scale = m2.div_(pairs).add_(WHITEN_EPS).rsqrt_().nan_to_num_(0.0, 0.0, 0.0).to(centred.dtype)  # in place: 0-d temporaries cost too
    return as_dtype(centred.mul_(scale), values.dtype)


def _returns_without_triton(rewards: torch.Tensor, steps: torch.Tensor, gamma: float, masked: bool) -> torch.Tensor:
    """Carry-through returns where Triton does not run: on CPU the compiled loop
    (:mod:`advantages.native_scans`) where it takes the tensors, else the torch scan in blocks of rows."""
    returns = native_returns(rewards, steps, gamma)
    if returns is None:
        returns = by_row_blocks(functools.partial(_returns_scan, gamma=gamma, masked=masked), rewards, steps)
    return returns


def _returns_scan(rewards: torch.Tensor, steps: torch.Tensor, gamma: float, masked: bool) -> torch.Tensor:
    """Carry-through returns with the torch scan; ``steps`` is the float ASSISTANT mask; ``masked``:
    the rewards are validated, hence 0 off the steps (the scan then skips zeroing them)."""
    return as_dtype(carry_scan(as_dtype(rewards, steps.dtype), steps, gamma, masked), rewards.dtype)


def returns_reset_at_observation(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """verl's REINFORCE++ returns before PR #7300 (the bug it fixed), for ablations and inspection.

    The reverse loop ``R = r_t + gamma * R; returns[t] = R; R = R * mask_t`` resets ``R`` at every
    0 of the mask, so a reward never reaches an earlier assistant turn. Reproduced value for value,
    including the nonzero returns verl left on a masked token just before an assistant span.

    ``(b, t)`` rewards and mask -> ``(b, t)`` returns in the rewards' dtype. Not validated and
    computed in float64 (it subtracts two unmasked returns: see the code).
    """
    check_discount("gamma", gamma)
    check_same_shape("response_mask", response_mask, "rewards", rewards)
    t = rewards.shape[-1]
    unmasked = returns_ignore_mask(rewards.double(), gamma)
    # The loop restarts from 0 right after each masked token q, so returns[t] is the unmasked return at
    # t minus gamma**(q - t) times the unmasked return at q, where q is the first masked token after t
    # (q = t_max, the row end, if none).
    positions = torch.arange(t, dtype=torch.float64, device=rewards.device).expand(rewards.shape)
    masked = (~response_mask.bool()).double()
    first_masked_plus_one = fill_from_right((positions + 1) * masked, masked)  # 0 where no masked token follows
    after = torch.nn.functional.pad(first_masked_plus_one[:, 1:], (0, 1))
    next_masked = torch.where(after > 0, after - 1, t)
    cut = torch.nn.functional.pad(unmasked, (0, 1)).gather(-1, next_masked.long())
    return (unmasked - torch.pow(gamma, next_masked - positions) * cut).to(rewards.dtype)


def returns_ignore_mask(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """The plain discounted cumulative sum ``R = r_t + gamma * R`` over every position, ignoring spans.

    Wrong for multi-turn agents (observation tokens cost discount steps); kept for ablations and
    inspection. ``(b, t)`` -> ``(b, t)`` in the rewards' dtype.
    """
    check_discount("gamma", gamma)
    every = assistant_steps(torch.ones_like(rewards), rewards)
    return carry_scan(rewards.to(every.dtype), every, gamma).to(rewards.dtype)


def gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    spans: torch.Tensor | None = None,
    whiten: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry-through GAE (Schulman et al. 2015, arXiv:1506.02438; verl PR #2337).

    Right to left over ASSISTANT tokens: ``delta_t = r_t + gamma * V_next - V_t`` where ``V_next`` is
    the value of the next ASSISTANT token (OBSERVATION tokens are skipped, PAD and the row end give
    0), and ``A_t = delta_t + gamma * lam * A_next``, carried unchanged through OBSERVATION tokens.

    ``token_level_rewards``, ``values``, ``response_mask``, optional ``spans``: ``(b, t)``.
    Returns ``(advantages, returns)`` ``(b, t)`` in the rewards' dtype, ``returns = A + V`` on
    ASSISTANT tokens and exactly 0 elsewhere (verl leaves carried values there; its loss masks them).
    With ``whiten`` (verl's default) the advantages are whitened over the batch's ASSISTANT tokens
    after ``returns`` is formed, as in :func:`whitened_discounted_returns` (on CUDA the kernel
    reduces their moments in the same pass; ``validate`` then also requires 2 ASSISTANT tokens, and
    without it fewer than 2 give advantages exactly 0 everywhere).
    Validation as in :func:`discounted_returns`.
    """
    check_discount("gamma", gamma)
    check_discount("lam", lam)
    check_same_shape("values", values, "token_level_rewards", token_level_rewards)
    count = check_batch(token_level_rewards, response_mask, spans, validate, count=whiten)
    if whiten and validate:
        check_whitenable(count)
    kernels = _triton(token_level_rewards)
    if kernels is not None:
        values = values.to(token_level_rewards.dtype)
        spans8 = _spans(response_mask, spans)
        if not whiten:
            return kernels.triton_gae(token_level_rewards, values, spans8, gamma, lam)
        advantages, returns, row_moments = kernels.triton_gae_with_moments(token_level_rewards, values, spans8, gamma, lam)
        return kernels.triton_whiten(advantages, spans8, row_moments, WHITEN_EPS), returns
    steps = assistant_steps(response_mask, token_level_rewards)
    scanned = native_gae(token_level_rewards, as_dtype(values, token_level_rewards.dtype), steps, gamma, lam, WHITEN_EPS if whiten else None)
    if scanned is not None:
        return scanned
    advantages, returns = by_row_blocks(functools.partial(_gae_scan, gamma=gamma, lam=lam), token_level_rewards, values, steps)
    if whiten:
        advantages = whiten_zero_off_mask(advantages, steps, count)
    return advantages, returns


def _gae_scan(rewards, values, steps, gamma, lam):
    """Unwhitened carry-through GAE with the torch scans.

    For ``lam >= GAE_ONE_SCAN_MIN_LAM`` one carry scan: over the steps ``k = 0, 1, ..`` from ``t``,
    ``A_t = sum_k (gamma lam)^k (r_k + gamma V_{k+1} - V_k) = sum_k (gamma lam)^k (r_k + c V_k) - V_t / lam``
    with ``c = (1 - lam) / lam`` (each ``gamma V_{k+1}`` regroups with the next term), so no
    ``V_next`` is needed. Its rounding grows like ``1 / lam``; below the threshold ``V_next`` comes
    from a fill from the right and ``delta`` is scanned as written.
    """
    rewards_ = as_dtype(rewards, steps.dtype)
    # values off the steps are never read (the critic's value there may be anything, even NaN): 0 * NaN is NaN
    values_ = torch.where(steps.bool(), as_dtype(values, steps.dtype), 0.0)
    if lam >= GAE_ONE_SCAN_MIN_LAM:
        advantages = carry_scan(torch.add(rewards_, values_, alpha=(1 - lam) / lam), steps, gamma * lam)
        advantages.addcmul_(values_, steps, value=-1 / lam)
    else:
        next_value = torch.nn.functional.pad(fill_from_right(values_ * steps, steps)[:, 1:], (0, 1))
        advantages = carry_scan(rewards_ + gamma * next_value - values_, steps, gamma * lam)
    returns = (advantages + values_).mul_(steps)
    return as_dtype(advantages, rewards.dtype), as_dtype(returns, rewards.dtype)
