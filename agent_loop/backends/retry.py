"""The wait between retries, in one place: the agent loop's backend retries and the HTTP backend's request and
start-up retries all back off by :func:`backoff_delay`."""

from __future__ import annotations


def backoff_delay(attempt: int, *, base_s: float, cap_s: float | None = None) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (0: the first) before the next one:
    ``base_s * 2**attempt``, at most ``cap_s`` (None: no cap)."""
    delay = base_s * 2**attempt
    return delay if cap_s is None else min(cap_s, delay)
