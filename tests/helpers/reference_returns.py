"""Plain serial references of every return scan: one token at a time, Python floats (float64).

Written for reading, not speed, straight from the table in docs/design.md section 3 and verl's loops.
Inputs are ``(b, t)`` tensors (or nested lists); outputs are ``(b, t)`` float64 tensors. Other
test files import them: ``from tests.helpers.reference_returns import ...``.
"""

import torch

PAD, ASSISTANT, OBSERVATION = 0, 1, 2


def _rows(x) -> list[list[float]]:
    return x.tolist() if isinstance(x, torch.Tensor) else [list(row) for row in x]


def _tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), -1)


def discounted_returns_ref(rewards, spans, gamma: float) -> torch.Tensor:
    """Carry-through returns: ASSISTANT ``R = r + gamma R`` (returned), OBSERVATION carries R
    (returns 0), PAD resets R to 0 (returns 0)."""
    out = []
    for rewards_row, spans_row in zip(_rows(rewards), _rows(spans)):
        running, row = 0.0, [0.0] * len(spans_row)
        for t in reversed(range(len(spans_row))):
            if spans_row[t] == ASSISTANT:
                running = rewards_row[t] + gamma * running
                row[t] = running
            elif spans_row[t] == PAD:
                running = 0.0
        out.append(row)
    return _tensor(out)


def returns_reset_at_observation_ref(rewards, response_mask, gamma: float) -> torch.Tensor:
    """verl before PR #7300, literally: ``R = r + gamma R; returns = R; R = R * mask``."""
    out = []
    for rewards_row, mask_row in zip(_rows(rewards), _rows(response_mask)):
        running, row = 0.0, [0.0] * len(mask_row)
        for t in reversed(range(len(mask_row))):
            running = rewards_row[t] + gamma * running
            row[t] = running
            running = running * mask_row[t]
        out.append(row)
    return _tensor(out)


def returns_ignore_mask_ref(rewards, gamma: float) -> torch.Tensor:
    """The mask-blind discounted sum: ``R = r + gamma R`` at every position."""
    out = []
    for rewards_row in _rows(rewards):
        running, row = 0.0, [0.0] * len(rewards_row)
        for t in reversed(range(len(rewards_row))):
            running = rewards_row[t] + gamma * running
            row[t] = running
        out.append(row)
    return _tensor(out)


def gae_ref(rewards, values, spans, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry-through GAE (verl PR #2337), unwhitened: on ASSISTANT ``delta = r + gamma V_next - V``,
    ``A = delta + gamma lam A``, ``V_next = V``; OBSERVATION carries ``V_next`` and ``A``; PAD resets
    both. Advantages ``A`` and returns ``A + V`` on ASSISTANT tokens, 0 elsewhere."""
    advantages, returns = [], []
    for rewards_row, values_row, spans_row in zip(_rows(rewards), _rows(values), _rows(spans)):
        next_value, running = 0.0, 0.0
        adv_row, ret_row = [0.0] * len(spans_row), [0.0] * len(spans_row)
        for t in reversed(range(len(spans_row))):
            if spans_row[t] == ASSISTANT:
                delta = rewards_row[t] + gamma * next_value - values_row[t]
                running = delta + gamma * lam * running
                next_value = values_row[t]
                adv_row[t], ret_row[t] = running, running + values_row[t]
            elif spans_row[t] == PAD:
                next_value, running = 0.0, 0.0
        advantages.append(adv_row)
        returns.append(ret_row)
    return _tensor(advantages), _tensor(returns)


def whiten_ref(values, spans) -> torch.Tensor:
    """verl's masked_whiten over ASSISTANT tokens, one token at a time: ``(v - mean) / sqrt(var + 1e-8)``
    with the Bessel-corrected variance (two passes, Python floats); 0 off ASSISTANT tokens."""
    rows, kinds = _rows(values), _rows(spans)
    kept = [v for row, kind in zip(rows, kinds) for v, k in zip(row, kind) if k == ASSISTANT]
    mean = sum(kept) / len(kept)
    var = sum((v - mean) ** 2 for v in kept) / (len(kept) - 1)
    scale = (var + 1e-8) ** -0.5
    return _tensor([[(v - mean) * scale if k == ASSISTANT else 0.0 for v, k in zip(row, kind)] for row, kind in zip(rows, kinds)])
