"""The transformers backend's sampler per decode step (``agent_loop.backends.hf.sample_tokens``: on a GPU the
whole batch at once on the device; on the CPU row by row, as before) against the loop it replaced (every row's
logits copied to the host, ``torch.multinomial`` with the row's generator, one ``int()`` per row), in one run.
The change is for GPUs: on the CPU both run the same row-by-row draw, and the table shows it costs the same.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_sampling.py                 # CPU (and CUDA when there is one)
    python3 benchmarks/hf_sampling.py --device cuda --vocab 151936 --rows 64     # a GPU machine, no install needed

Both draw the same tokens from the same seeds (checked here on every run: the batched draw is
``multinomial``'s own ``argmax(p / q)``, ``q ~ Exp(1)`` from each row's generator). Reported: milliseconds per
decode step (median of ``--repeats``), and the batch's speed-up over the loop. The loop is what made a training
step of 64 episodes x 256 tokens at Qwen2.5's vocabulary take over 150 s of rollout on an H200 (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout (a GPU machine) has no install
from agent_loop.backends.base import SamplingParams  # noqa: E402
from agent_loop.backends.hf import _filter_logits, sample_tokens  # noqa: E402


def row_by_row(logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """The replaced sampler: the logits on the host, then one ``multinomial`` (or argmax) per row."""
    host = logits.float().cpu()
    log_softmax = torch.log_softmax(host, dim=-1)
    tokens = []
    for row, params in enumerate(sampling):
        if params.temperature <= 0:
            token = int(torch.argmax(host[row]))
        else:
            filtered = _filter_logits(host[row] / params.temperature, params.top_k, params.top_p)
            token = int(torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generators[row]))
        float(log_softmax[row, token])  # the loop read each chosen logprob as a Python float
        tokens.append(token)
    return tokens


def batched(logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    tokens = sample_tokens(logits, sampling, generators)
    torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).tolist()
    return tokens.tolist()


def generators_for(rows: int, device: torch.device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(1000 + row) for row in range(rows)]


def timed(function, logits, sampling, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        generators = generators_for(len(sampling), device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        function(logits, sampling, generators)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", nargs="+", default=None, help="default: cpu, and cuda when there is one")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936], help="SmolLM2's and Qwen2.5's")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    devices = args.device or ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); temperature 1, no top-k/top-p; "
          f"median of {args.repeats} decode steps")
    print("| device | vocabulary | rows | row by row, ms/step | batched, ms/step | speed-up | same tokens (CPU generators) |")
    print("|---|---|---|---|---|---|---|")
    for name in devices:
        device = torch.device(name)
        for vocab in args.vocab:
            for rows in args.rows:
                logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(device)
                sampling = [SamplingParams(max_tokens=1, temperature=1.0, seed=1000 + row) for row in range(rows)]
                same = (row_by_row(logits, sampling, generators_for(rows, torch.device("cpu")))
                        == batched(logits.cpu(), sampling, generators_for(rows, torch.device("cpu"))))
                loop_ms = timed(row_by_row, logits, sampling, torch.device("cpu"), args.repeats)
                batch_ms = timed(batched, logits, sampling, device, args.repeats)
                print(f"| {name} | {vocab:,} | {rows} | {loop_ms:.1f} | {batch_ms:.2f} | {loop_ms / batch_ms:.1f}x | "
                      f"{'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
