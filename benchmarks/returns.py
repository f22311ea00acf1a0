"""Speed of the carry-through scans and whole estimators on the CPU (advantages.discounted_returns,
advantages.gae, advantages.reinforce_plus_plus).

For each shape ``(b, t)``, float32, gamma 0.99 and 1.0, with spans, it times four calls twice: the
default call (``validate=True``: the fused checks, one sync) and the hot path (``validate=False``):

* REINFORCE++ returns (``discounted_returns``) and GAE (lambda 0.95, ``whiten=False``), against a
  per-token reverse loop written like verl's (after PR #7300 / PR #2337);
* the whole estimators ``reinforce_plus_plus`` (whitened) and ``gae(whiten=True)``, against verl's
  whole function: the same loop plus ``masked_whiten`` written as verl writes it.

"speedup" is verl's time over ours (default call, and hot path); "valid. cost" is default over hot.
A large tensor copy gives the memory floor of a single pass over the inputs and outputs (bytes in
+ out / copy bandwidth): "% of floor" for the hot path (100% = bandwidth bound). The outputs are
compared (max |difference| against verl's). Medians of ``--repeats`` rounds, the default call and
the hot path timed in turn; verl's loop at the start of a few of those rounds (7, 3 on the biggest shape; then two
untimed calls of each of ours, as the loop leaves the caches cold), so that a busy spell on a
shared machine falls on ours and verl's alike. Times are the process's CPU time by default (robust on a
shared machine, where wall time also counts the time other processes hold the core); ``--wall``
measures wall-clock time instead. The "faults" column counts the page faults per call of ours.

First the process frees one 16 MiB tensor, as a training process has done many times: glibc's
malloc then raises its dynamic mmap and trim thresholds and keeps freed memory for reuse. In a
process that never freed a large block, big calls get their temporaries as fresh pages from the
kernel, and page faults (about 3 us each on a small VM) outweigh the arithmetic; ``--cold-allocator``
skips the warm-up to measure that case. Usage::

    python benchmarks/returns.py            # the four shapes of issue 2, one thread, CPU time
    python benchmarks/returns.py --quick    # two small shapes, a few seconds
    python benchmarks/returns.py --shapes 8x4096,64x8192 --gammas 0.99    # the shapes of issue 20's targets
    python benchmarks/returns.py --threads 2
    python benchmarks/returns.py --cold-allocator
    AGENT_LOOP_NATIVE=0 python benchmarks/returns.py    # the torch paths (no compiled C loops: masking/native.py)
"""

import argparse
import resource
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from advantages import discounted_returns, gae, reinforce_plus_plus
from masking.spans import SpanKind

SHAPES = ((1, 1024), (8, 4096), (64, 8192), (256, 16384))
QUICK_SHAPES = ((1, 1024), (8, 4096))
GAMMAS = (0.99, 1.0)
LAM = 0.95


def multi_turn_batch(b: int, t: int, seed: int = 0):
    """Rows of 2-6 assistant turns separated by observation spans, then trailing padding; an outcome
    reward on each row's last assistant token; random values."""
    generator = torch.Generator().manual_seed(seed)
    spans = torch.full((b, t), int(SpanKind.PAD), dtype=torch.int8)
    rewards = torch.zeros(b, t)
    for row in range(b):
        used = int(t * (0.6 + 0.4 * torch.rand(1, generator=generator)))
        turns = int(torch.randint(2, 7, (1,), generator=generator))
        bounds = torch.linspace(0, used, 2 * turns + 1).long().tolist()
        for k in range(2 * turns):
            kind = SpanKind.ASSISTANT if k % 2 == 0 else SpanKind.OBSERVATION
            spans[row, bounds[k] : bounds[k + 1]] = int(kind)
        last_assistant = bounds[2 * turns - 1] - 1
        rewards[row, last_assistant] = float(torch.randn(1, generator=generator))
    values = torch.randn(b, t, generator=generator)
    return rewards, values, (spans == SpanKind.ASSISTANT).float(), spans


def verl_returns_loop(token_level_rewards, response_mask, gamma):
    """REINFORCE++ returns the way verl writes them (a reverse loop over tokens), carrying the
    running return through masked tokens as after PR #7300."""
    returns = torch.zeros_like(token_level_rewards)
    running_return = torch.zeros(token_level_rewards.shape[0])
    for t in reversed(range(token_level_rewards.shape[1])):
        mask_t = response_mask[:, t]
        running_return = mask_t * (token_level_rewards[:, t] + gamma * running_return) + (1 - mask_t) * running_return
        returns[:, t] = running_return * mask_t
    return returns


def verl_gae_loop(token_level_rewards, values, response_mask, gamma, lam):
    """verl's compute_gae_advantage_return loop after PR #2337 (unwhitened), zeroed off the mask."""
    nextvalues, lastgaelam = 0.0, 0.0
    advantages_reversed = []
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages * response_mask, (advantages + values) * response_mask


def verl_masked_whiten(values, mask):
    """verl's ``masked_whiten`` (verl/utils/torch_functional.py: masked_sum/mean/var with the Bessel
    correction and its two host checks of ``mask.sum()``), as verl writes it."""

    def masked_sum(values, mask):
        return (torch.where(mask.bool(), values, 0.0) * mask).sum()

    def masked_mean(values, mask):
        return masked_sum(values, mask) / (mask.sum() + 1e-8)

    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    if mask_sum == 0 or mask_sum == 1:
        raise ValueError("verl needs at least 2 unmasked tokens")
    variance = variance * (mask_sum / (mask_sum - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_reinforce_plus_plus(token_level_rewards, response_mask, gamma):
    """verl's whole compute_reinforce_plus_plus_outcome_advantage (carry-through loop, then whitening)."""
    returns = verl_returns_loop(token_level_rewards, response_mask, gamma)
    advantages = verl_masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def verl_gae_whitened(token_level_rewards, values, response_mask, gamma, lam):
    """verl's whole compute_gae_advantage_return (loop, returns = advantages + values, then whitening)."""
    advantages, returns = verl_gae_loop(token_level_rewards, values, response_mask, gamma, lam)
    return verl_masked_whiten(advantages, response_mask) * response_mask, returns


def median_seconds(fn, repeats: int, clock) -> tuple[float, object]:
    result = fn()  # warm-up, and the output to compare
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times), result


def interleaved_seconds(fns, repeats: int, clock, slow=None, slow_repeats: int = 1):
    """Medians of ``fns`` timed in turn, ``repeats`` rounds (so a busy spell on a shared machine
    falls on all of them alike), each one's output and page faults per call; and, if given, the
    median and output of ``slow``, timed at the start of ``slow_repeats`` evenly spread rounds and
    followed by two untimed calls of each of ``fns`` (it leaves the caches cold)."""
    results = [fn() for fn in fns]  # warm-up, and the outputs to compare
    slow_result = None if slow is None else slow()
    times, faults, slow_times = [[] for _ in fns], [0] * len(fns), []
    stride = -(-repeats // slow_repeats)
    for round_ in range(repeats):
        if slow is not None and round_ % stride == 0:
            start = clock()
            slow()
            slow_times.append(clock() - start)
            for fn in fns:
                fn()
                fn()
        for fn, samples, i in zip(fns, times, range(len(fns))):
            faults_before = page_faults()
            start = clock()
            fn()
            samples.append(clock() - start)
            faults[i] += page_faults() - faults_before
    medians = [statistics.median(samples) for samples in times]
    slow_median = statistics.median(slow_times) if slow_times else None
    return medians, results, [count / repeats for count in faults], (slow_median, slow_result)


def page_faults() -> int:
    """Minor page faults of this process so far (fresh memory touched for the first time)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def warm_allocator() -> None:
    """Free a 16 MiB block, so glibc raises its mmap threshold to 16 MiB and its trim threshold to
    32 MiB (the dynamic thresholds; blocks above 32 MiB leave them alone), as in a process that
    has freed model-sized tensors before."""
    del_me = torch.ones(2**22)
    del del_me


def copy_bandwidth(repeats: int, clock) -> float:
    """Bytes per second of a 256 MiB tensor copy (read + write), the memory floor's yardstick."""
    source = torch.ones(64 * 2**20)
    target = torch.empty_like(source)
    seconds, _ = median_seconds(lambda: target.copy_(source), repeats, clock)
    return 2 * source.numel() * source.element_size() / seconds


def _shapes(text: str) -> list[tuple[int, int]]:
    """``"8x4096,64x8192"`` -> ``[(8, 4096), (64, 8192)]``."""
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="only the two small shapes, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of the scans (default 20, quick 7)")
    parser.add_argument("--shapes", type=_shapes, default=None, help="comma-separated BxT shapes (default: all four)")
    parser.add_argument("--gammas", type=lambda text: [float(g) for g in text.split(",")], default=GAMMAS, help="comma-separated")
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of process CPU time")
    parser.add_argument("--cold-allocator", action="store_true", help="skip warm_allocator (see the docstring)")
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown (for BENCHMARKS.md)")
    args = parser.parse_args()
    if not args.cold_allocator:
        warm_allocator()
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (7 if args.quick else 20)
    clock = time.perf_counter if args.wall else time.process_time
    bandwidth = copy_bandwidth(repeats, clock)

    table = Table(
        title=f"carry-through returns and estimators, float32, spans, {args.threads} thread(s), "
        f"{'wall' if args.wall else 'process CPU'} time, {'cold' if args.cold_allocator else 'warm'} allocator, "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    columns = (
        "estimator", "(b, t)", "gamma", "default ms", "hot ms", "valid. cost", "verl ms", "speedup default",
        "speedup hot", "floor ms", "% of floor (hot)", "faults", "max |diff|",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "estimator" else "right")
    for b, t in args.shapes or (QUICK_SHAPES if args.quick else SHAPES):
        rewards, values, mask, spans = multi_turn_batch(b, t)
        loop_repeats = 3 if b * t >= 2**22 else 7  # verl's loop runs in every few rounds of ours
        for gamma in args.gammas:
            cases = {
                # bytes per token: rewards, mask (+ values) and spans in; returns (+ advantages) out
                "REINFORCE++ returns": (
                    lambda validate: discounted_returns(rewards, mask, gamma, spans=spans, validate=validate),
                    lambda: verl_returns_loop(rewards, mask, gamma),
                    3 * 4 + 1,
                ),
                "GAE (lam 0.95)": (
                    lambda validate: gae(rewards, values, mask, gamma, LAM, spans=spans, whiten=False, validate=validate),
                    lambda: verl_gae_loop(rewards, values, mask, gamma, LAM),
                    5 * 4 + 1,
                ),
                "reinforce_plus_plus (whitened)": (
                    lambda validate: reinforce_plus_plus(rewards, mask, gamma, spans=spans, validate=validate),
                    lambda: verl_reinforce_plus_plus(rewards, mask, gamma),
                    4 * 4 + 1,
                ),
                "gae(whiten=True)": (
                    lambda validate: gae(rewards, values, mask, gamma, LAM, spans=spans, validate=validate),
                    lambda: verl_gae_whitened(rewards, values, mask, gamma, LAM),
                    5 * 4 + 1,
                ),
            }
            for name, (ours, loop, bytes_per_token) in cases.items():
                (default_s, hot_s), (ours_out, _), (default_faults, hot_faults), (loop_s, loop_out) = interleaved_seconds(
                    [lambda: ours(True), lambda: ours(False)], repeats, clock, loop, loop_repeats
                )
                faults = (default_faults + hot_faults) / 2
                floor_s = b * t * bytes_per_token / bandwidth
                pairs = zip(ours_out, loop_out) if isinstance(ours_out, tuple) else [(ours_out, loop_out)]
                diff = max(float((x - y).abs().max()) for x, y in pairs)
                table.add_row(
                    name, f"{b} x {t}", f"{gamma}", f"{default_s * 1e3:.3f}", f"{hot_s * 1e3:.3f}", f"{default_s / hot_s:.2f}x",
                    f"{loop_s * 1e3:.1f}", f"{loop_s / default_s:.0f}x", f"{loop_s / hot_s:.0f}x", f"{floor_s * 1e3:.3f}",
                    f"{100 * floor_s / hot_s:.0f}%", f"{faults:.0f}", f"{diff:.1e}",
                )
    Console(width=200).print(table)
    if args.markdown:
        print("| " + " | ".join(column.replace("|", "\\|") for column in columns) + " |")  # "max |diff|"
        print("|" + "---|" * len(columns))
        for row in zip(*(column._cells for column in table.columns)):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
