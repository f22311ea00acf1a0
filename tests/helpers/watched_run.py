"""A command run with a time bound that, when it hangs, says where: every Python process of it prints its threads'
stacks before it is killed, and the test fails with them (CI keeps only what the failure prints)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest


def run_watched(argv: list[str], *, env: dict[str, str], timeout_s: float,
                logs: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)`` bounded by ``timeout_s``. Past it, each process
    of the command (its children first: torchrun's workers die with their launcher) gets SIGABRT, on which
    Python's faulthandler (``PYTHONFAULTHANDLER``) prints every thread's stack; then the test fails with the tail
    of stdout, stderr (those stacks) and of each file in ``logs`` (a server's log)."""
    process = subprocess.Popen(argv, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            launcher = psutil.Process(process.pid)
            family = [*reversed(launcher.children(recursive=True)), launcher]
        except psutil.NoSuchProcess:  # it ended meanwhile
            family = []
        for member in family:
            try:
                member.send_signal(signal.SIGABRT)
            except psutil.NoSuchProcess:
                pass
            time.sleep(2)  # its stacks written before the next one dies
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        tails = "".join(f"\n--- {path} (tail) ---\n{path.read_text(errors='replace')[-4000:]}"
                        for path in logs if path.exists())
        pytest.fail(f"{' '.join(argv[:6])} ... did not end within {timeout_s:g} s\n--- stdout (tail) ---\n"
                    f"{stdout[-4000:]}\n--- stderr with every process's stacks (tail) ---\n{stderr[-30000:]}{tails}")
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
