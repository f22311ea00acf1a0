"""How long the command line takes to start: ``agent-loop --help`` and each command's ``--help``, against
``python -c pass`` (the interpreter alone), the median of N runs each. A command module imports torch,
transformers, vLLM or Ray only when the command runs, never to list or describe it.

    .venv/bin/python benchmarks/cli_startup.py [--runs 5]

What a slow start imports: ``python -X importtime -m agent_loop.cli --help 2> imports.txt``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

CASES = {
    "python -c pass": ["-c", "pass"],
    "agent-loop --help": ["-m", "agent_loop.cli", "--help"],
    "agent-loop rollout --help": ["-m", "agent_loop.cli", "rollout", "--help"],
    "agent-loop train --help": ["-m", "agent_loop.cli", "train", "--help"],
    "agent-loop inspect --help": ["-m", "agent_loop.cli", "inspect", "--help"],
}
HEAVY = ("torch", "transformers", "vllm", "ray", "aiohttp")


def seconds(argv: list[str], runs: int) -> float:
    """The median wall time of ``python ARGV``."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, *argv], stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def heavy_imports(argv: list[str]) -> list[str]:
    """Which of HEAVY ``python ARGV`` imports (from ``-X importtime``)."""
    err = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True).stderr
    names = {line.split("|")[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    return [name for name in HEAVY if name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    table = Table(title=f"CLI start-up, median of {args.runs} (load average {os.getloadavg()[0]:.1f}, "
                        f"{os.cpu_count()} cores)")
    for column in ("command", "seconds", "x python -c pass", "heavy imports"):
        table.add_column(column)
    base = None
    for name, argv in CASES.items():
        took = seconds(argv, args.runs)
        base = base or took
        table.add_row(name, f"{took:.2f}", f"{took / base:.1f}", ", ".join(heavy_imports(argv)) or "none")
    Console().print(table)


if __name__ == "__main__":
    main()
