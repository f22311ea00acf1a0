"""Rollout throughput and memory as a run grows: 5k (the baseline) / 10k / 50k / 100k scripted episodes.

Each size runs in a fresh child process (so peak RSS is that run's own): the arithmetic task on the
tiny agent's tokenizer, a ScriptedBackend that answers like a good agent (a calculator call with the
question's expression, then the tool's result as the answer; 2 turns, ~100 tokens per episode),
concurrency 256, every Trajectory streamed to a JSON Lines file as the CLI does
(:func:`agent_loop.runners.local.stream_rollouts`). The backend's call log (a test aid that keeps every
prompt) is switched off so the numbers are the runner's. On a shared machine wall-clock episodes/s
follows the load of the moment; the CPU time per episode (this process's user + system time) does
not, so its ratio is the one to read for "flat". Goal (issue 15): episodes/s at 100k within
20% of 5k, peak RSS under 600 MB.

    .venv/bin/python benchmarks/scale.py [--sizes 5000 10000 50000 100000] [--concurrency 256] [--progress]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


class _NoLog(list):
    def append(self, item) -> None:  # ScriptedBackend.calls: keep nothing
        pass


def child(episodes: int, concurrency: int, progress: bool) -> dict:
    """Play ``episodes`` episodes in this process; episodes/s, success, lines written and peak RSS."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from agent_loop.backends.scripted import ScriptedBackend
    from agent_loop.runners.local import stream_rollouts
    from agent_loop.runners.spec import RunSpec
    from agent_loop.tasks.registry import get_task
    from agent_loop.tiny import tiny_agent_path

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_agent_path()))
    tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")
    end_response = tokenizer.convert_tokens_to_ids("</tool_response>")

    def script(prompt_ids: list[int]) -> list[int]:
        if tool_response not in prompt_ids:  # turn 1: call the calculator on the question's expression
            question = re.findall(r"What is (.*?)\?", tokenizer.decode(prompt_ids[-40:]))[-1]
            call = {"name": "calculator", "arguments": {"expression": question}}
            return tokenizer.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        start = len(prompt_ids) - 1 - prompt_ids[::-1].index(tool_response)
        result = tokenizer.decode(prompt_ids[start + 1: prompt_ids.index(end_response, start)]).strip()
        return tokenizer.encode(f"The answer is {result}.")

    backend = ScriptedBackend(script)
    backend.calls = _NoLog()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rollouts.jsonl"
        started, cpu_started = time.perf_counter(), time.process_time()
        spec = RunSpec(get_task("arithmetic"), tokenizer, range(episodes), output_path=out, progress=progress)
        stats, _ = asyncio.run(stream_rollouts(spec, backend, concurrency=concurrency))
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        with open(out, "rb") as f:
            lines = sum(1 for _ in f)
        size_mb = out.stat().st_size / 2**20
    return {"episodes": episodes, "seconds": seconds, "episodes_per_s": episodes / seconds,
            "cpu_ms_per_episode": 1000 * cpu_seconds / episodes,
            "success": stats.success_rate, "lines": lines, "file_mb": size_mb,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[5000, 10000, 50000, 100000],
                        help="episode counts; the first is the baseline of the ratio column")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--progress", action="store_true", help="show the progress bar (on stderr) while running")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.concurrency, args.progress)))
        return

    rows = []
    for size in args.sizes:
        command = [sys.executable, __file__, "--child", str(size), "--concurrency", str(args.concurrency)]
        command += ["--progress"] if args.progress else []
        done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=os.environ)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr)

    table = Table(title=f"scripted rollouts, concurrency {args.concurrency}, streamed to JSONL")
    for column in ("episodes", "seconds", "episodes/s", f"ratio vs {args.sizes[0]}", "CPU ms / episode",
                   f"CPU ratio vs {args.sizes[0]}", "peak RSS MB", "file MB", "success"):
        table.add_column(column, justify="right")
    base, base_cpu = rows[0]["episodes_per_s"], rows[0]["cpu_ms_per_episode"]
    for row in rows:
        assert row["lines"] == row["episodes"], f"{row['lines']} lines written for {row['episodes']} episodes"
        table.add_row(f"{row['episodes']:,}", f"{row['seconds']:.1f}", f"{row['episodes_per_s']:.0f}",
                      f"{row['episodes_per_s'] / base:.2f}", f"{row['cpu_ms_per_episode']:.2f}",
                      f"{base_cpu / row['cpu_ms_per_episode']:.2f}", f"{row['peak_rss_mb']:.0f}", f"{row['file_mb']:.0f}",
                      f"{row['success']:.3f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
