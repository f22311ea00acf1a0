"""Rollout speed of ``--rollout-dtype fp32`` against ``bf16`` on the in-process vLLM engine (issue 57 item 2).

    .venv/bin/python benchmarks/rollout_dtype.py                       # SmolLM2-135M, 32 episodes, 2 rounds
    .venv/bin/python benchmarks/rollout_dtype.py --model tiny --episodes 8 --rounds 1   # smoke test

Each round runs ``agent-loop rollout --backend vllm`` once per precision (fp32 first, then bf16; the engine eager
in both, as our CPU engine runs), each in a fresh process, and reads the warm generation throughput the command
prints (assistant tokens/s from the first request to the last episode's end; engine start-up excluded). The ratio
bf16 / fp32 is per round, so both sides of a ratio share the machine's state. The mismatch bf16 sampling opens
against an fp32 trainer is measured by benchmarks/sampler_mismatch.py (BENCHMARKS.md, issue 31).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

WARM = re.compile(r"([\d.]+) assistant tokens/s warm")


def warm_tokens_per_s(model: str, dtype: str, episodes: int, folder: Path) -> float:
    """One ``rollout`` run's printed warm assistant tokens/s."""
    out = folder / f"{dtype}-{len(list(folder.iterdir()))}.jsonl"
    command = [sys.executable, "-m", "agent_loop.cli", "rollout", "--model", model, "--backend", "vllm",
               "--rollout-dtype", dtype, "--episodes", str(episodes), "--concurrency", str(episodes), "--out", str(out)]
    printed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    found = WARM.search(" ".join(printed.split()))
    if found is None:
        raise RuntimeError(f"no warm tokens/s in the output of {' '.join(command)}:\n{printed[-2000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print("| round | fp32 tok/s | bf16 tok/s | bf16 / fp32 |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            fp32, bf16 = (warm_tokens_per_s(args.model, dtype, args.episodes, Path(folder)) for dtype in ("fp32", "bf16"))
            print(f"| {round_ + 1} | {fp32:.1f} | {bf16:.1f} | {bf16 / fp32:.2f} |", flush=True)


if __name__ == "__main__":
    main()
