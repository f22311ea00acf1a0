"""torch threads per process: one option (``--threads``) and one default rule for every command.

The rule (measured on 2 cores: docs/platform.md, ``benchmarks/threads.py``): ``--threads N`` when given;
else ``OMP_NUM_THREADS`` when set; else the cores this process may use divided among the processes that
share them (torchrun's ``LOCAL_WORLD_SIZE``) and capped at the cores left idle by the load already on
the machine, at least 1. A thread more than there are free cores costs far more than it gains: torch's
threads wait for each other at every operation, so one descheduled thread stalls them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

RULE = ("unset: OMP_NUM_THREADS when set, else the usable cores / processes sharing them (torchrun's "
        "LOCAL_WORLD_SIZE), at most the cores the machine's load leaves idle, at least 1 (docs/platform.md)")


@dataclass
class ThreadOptions:
    """How many torch threads a command's process uses (declared once: every command takes ``--threads``)."""

    threads: Annotated[int | None, Field(ge=1, description="compute threads per process (torch's intra-op threads; "
                                         f"agent-loop serve: the cores vLLM's CPU threads are bound to); {RULE}")] = None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and ``taskset`` narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads(*, cores: int | None = None, processes: int | None = None, load: float | None = None) -> int:
    """The rule's number of threads (arguments: for tests; unset, they are read from this machine)."""
    cores = usable_cores() if cores is None else cores
    if processes is None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    idle = cores - int(load + 0.5)  # runnable processes already competing for the cores
    return max(1, min(cores // max(1, processes), idle))


def resolve_threads(threads: int | None) -> int:
    """``threads`` when given, else ``OMP_NUM_THREADS`` when it is a whole number >= 1, else the rule."""
    if threads is not None:
        return threads
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) >= 1 else default_threads()


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads by the rule (and one inter-op thread: our models run one op at a time);
    returns the number used. The one place a command sets them."""
    import torch  # torch: the rollout path imports this module without it

    count = resolve_threads(threads)
    torch.set_num_threads(count)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # only settable before the first inter-op parallel work; then it stays
            pass
    return count
