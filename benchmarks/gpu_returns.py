"""GPU check and benchmark of the fused Triton return scans (issue 7), one prepared script.

    python benchmarks/gpu_returns.py --out gpu_returns.md      # H100/H200: a few minutes
    # on a bare checkout (no install), keeping every table and the log under $OUT (4-6 minutes at
    # most, of which 2-3 compile the 147 kernel variants):
    python3 -u benchmarks/gpu_returns.py --sweep --out $OUT/gpu_returns.md 2>&1 | tee $OUT/log.txt
    python benchmarks/gpu_returns.py --quick                   # fewer repetitions, gamma 0.99 only
    python benchmarks/gpu_returns.py --sweep                   # also tune block/warps/stages at the largest shape
    python benchmarks/gpu_returns.py --interpret-smoke         # no GPU: the same logic on CPU, tiny shapes

1. Correctness: the Triton kernels and the torch scan (``advantages.discounted_returns`` and
   ``advantages.gae`` with the Triton dispatch off) against a float64 per-token loop on random
   multi-turn batches of every benchmark shape (observation spans, trailing padding, an
   all-ASSISTANT row, an all-PAD row), float32 and bfloat16. Every output buffer is poisoned with
   NaN first (freed NaN tensors the caching allocator hands out again), and a NaN anywhere fails.
   Exits 1 when a check fails, after printing everything.
   The fused moments (``triton_discounted_returns_with_moments``) are checked against the mean and
   variance of the reference returns over ASSISTANT tokens.
   Rows longer than 16384 are checked against the float64 torch scan instead of the (slow) loop.
   The whole estimators (``reinforce_plus_plus`` whitened, ``gae(whiten=True)``, ``validate=False``)
   are checked against the loop plus whitening in float64.
   On a GPU they are also captured in a CUDA graph ("triton, CUDA graph"): captured on other
   inputs of the same shape, then replayed on these, copied into the captured buffers, so a host
   sync, a CPU fallback or an output baked in at capture fails the check.
2. Speed at every shape of SHAPES, gamma 0.99 (lambda 0.95): the Triton kernels (and the whole
   estimators on them) vs the torch scan vs a per-token loop written like verl's (small shapes only), median of
   CUDA-event timings with the L2 cache flushed before each run, and the fraction of the HBM floor:
   (bytes read + written) / (bandwidth of a large device-to-device copy measured in the same run).
   ``returns+moments`` is what REINFORCE++ whitening needs before its last elementwise pass: the
   returns plus their mean and variance over ASSISTANT tokens (torch: returns, masked mean, var).
   "triton, 1 program/row" times the returns and GAE kernels with the row split turned off.
   Times are GPU time between CUDA events; the L2 flush queued before the start event lets the host
   run up to its length (~65 us) ahead, so a whole estimator's launches are mostly hidden.
3. ``--sweep``: launch configs (block, warps, stages) of the returns, GAE and fused-moments kernels
   at (256, 16384), and of the returns and GAE kernels on long rows (block, warps; split across
   programs or one program per row) at (1, 262144) and (16, 65536); each config's outputs are
   compared with the default config's ("max rel. diff from default";
   over twice the tolerance fails).

Each table is printed, and ``--out`` rewritten, as soon as its part is done, so a run cut short
keeps what it measured. ``--out`` must not exist yet (an earlier result is never overwritten).
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout (the GPU machine) has no install
from masking.spans import SpanKind  # noqa: E402

SHAPES = ((1, 1024), (8, 4096), (64, 8192), (256, 16384), (512, 32768), (4096, 1024), (16, 65536), (1, 262144))
SWEEP_SHAPE = (256, 16384)  # launch configs of the one-program-per-row kernels
SPLIT_SWEEP_SHAPES = ((1, 262144), (16, 65536))  # rows split across programs
SMOKE_SHAPES = ((1, 40), (3, 150))
SMOKE_SPLIT_SHAPES = ((1, 150),)
LOOP_MAX_TOKENS = 8 * 4096  # the per-token loop is timed on the small shapes only
LOOP_CHECK_MAX_T = 16384  # longer rows are checked against the float64 torch scan (itself checked in tests)
GAMMA, LAM = 0.99, 0.95
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # max |error| / max(1, max |reference|)
A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)
DISABLE_ENV = "AGENT_LOOP_DISABLE_TRITON"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the results as a markdown table to this file")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions; check gamma 0.99 only")
    parser.add_argument("--sweep", action="store_true", help="time launch configs (block, warps, stages) at the largest shape")
    parser.add_argument("--interpret-smoke", action="store_true", help="no GPU: run the logic on CPU under TRITON_INTERPRET=1, tiny shapes")
    parser.add_argument("--reps", type=int, help="timed repetitions per measurement (default 100, --quick 20)")
    return parser.parse_args()


# --- inputs and the per-token loops ---

def make_batch(b, t, dtype, device, generator):
    """A multi-turn batch: alternating ASSISTANT/OBSERVATION spans (mean length 48), trailing PAD
    (row lengths uniform in [t/2, t]), row 0 all ASSISTANT and the last row all PAD (when b > 2)."""
    turn_starts = torch.rand(b, t, generator=generator) < 1 / 48
    kinds = torch.where(turn_starts.cumsum(1) % 2 == 0, A, O)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=generator)
    if b > 2:
        kinds[0] = A
        lengths[0], lengths[-1] = t, 0
    spans = torch.where(torch.arange(t) < lengths[:, None], kinds, P).to(torch.int8)
    rewards = torch.randn(b, t, generator=generator) * (spans == A)
    values = torch.randn(b, t, generator=generator)
    return rewards.to(device, dtype), values.to(device, dtype), spans.to(device)


def loop_returns(rewards, spans, gamma):
    """Reverse loop over tokens like verl's REINFORCE++ (carry-through), vectorised over rows only."""
    assistant, observation = spans == A, spans == O
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for s in reversed(range(rewards.shape[1])):
        running = torch.where(assistant[:, s], rewards[:, s] + gamma * running, running * observation[:, s])
        out[:, s] = running * assistant[:, s]
    return out


def loop_gae(rewards, values, spans, gamma, lam):
    """Reverse loop over tokens like verl's GAE after PR #2337, vectorised over rows only."""
    assistant, observation = spans == A, spans == O
    next_value = torch.zeros_like(rewards[:, 0])
    gae = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for s in reversed(range(rewards.shape[1])):
        delta = rewards[:, s] + gamma * next_value - values[:, s]
        gae = torch.where(assistant[:, s], delta + gamma * lam * gae, gae * observation[:, s])
        next_value = torch.where(assistant[:, s], values[:, s], next_value * observation[:, s])
        advantages[:, s] = gae * assistant[:, s]
    return advantages, (advantages + values) * assistant


# --- the implementations under test ---

@contextmanager
def triton_dispatch_off():
    old = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = old


def whiten64(x, s):
    """verl's masked_whiten over ASSISTANT tokens in float64 (Bessel-corrected, eps 1e-8), 0 elsewhere."""
    kept = x[s == A]
    return torch.where(s == A, (x - kept.mean()) * torch.rsqrt(kept.var() + 1e-8), 0.0)


def graphed(fn):
    """``fn`` (a whole estimator: two outputs) captured in a CUDA graph on other inputs of the same
    shape (random values, the spans shifted by one), then replayed on the given ones, copied into
    the captured buffers. A failed capture is printed and gives NaN outputs (a failed check)."""

    def run(r, v, s, gamma, lam):
        generator = torch.Generator(device=r.device).manual_seed(1)
        static = [torch.randn(r.shape, generator=generator, device=r.device).to(r.dtype),
                  torch.randn(v.shape, generator=generator, device=v.device).to(v.dtype), s.roll(1, dims=1)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: Triton compiles here
            for _ in range(2):
                fn(*static, gamma, lam)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = fn(*static, gamma, lam)
        except Exception as error:  # e.g. a host sync while capturing (or a Triton error): a failed check
            print(f"CUDA graph capture failed at {tuple(r.shape)}, {r.dtype}: {error}")
            return torch.full_like(r, float("nan")), torch.full_like(r, float("nan"))
        for buffer, x in zip(static, (r, v, s), strict=True):
            buffer.copy_(x)
        graph.replay()
        return tuple(output.clone() for output in outputs)

    return run


def implementations(kernels, config, cuda_graphs=False):
    """name -> kind -> callable(rewards, values, spans, gamma, lam) returning a tuple of outputs;
    with ``cuda_graphs`` also the whole estimators replayed from a CUDA graph (checked, not timed)."""
    import advantages

    def torch_returns(r, v, s, gamma, lam):
        with triton_dispatch_off():
            return (advantages.discounted_returns(r, s == A, gamma, spans=s, validate=False),)

    def torch_gae(r, v, s, gamma, lam):
        with triton_dispatch_off():
            return advantages.gae(r, v, s == A, gamma, lam, spans=s, whiten=False, validate=False)

    def torch_moments(r, v, s, gamma, lam):
        """What REINFORCE++ whitening needs: the returns and their mean and variance over ASSISTANT tokens."""
        (returns,) = torch_returns(r, v, s, gamma, lam)
        return returns, advantages.masked_mean(returns, s == A), advantages.masked_var(returns, s == A, check=False)

    def triton_moments(r, v, s, gamma, lam):
        returns, moments = kernels.triton_discounted_returns_with_moments(r, s, gamma, **config)
        return returns, *kernels.merge_moments(moments)[1:]

    def estimator_rpp(r, v, s, gamma, lam):
        return advantages.reinforce_plus_plus(r, s == A, gamma, spans=s, validate=False)

    def estimator_gae(r, v, s, gamma, lam):
        return advantages.gae(r, v, s == A, gamma, lam, spans=s, validate=False)

    def off(fn):
        def run(*args):
            with triton_dispatch_off():
                return fn(*args)

        return run

    def loop_rpp(r, v, s, gamma, lam):
        returns = loop_returns(r, s, gamma)
        return whiten64(returns, s), returns

    def loop_gae_whitened(r, v, s, gamma, lam):
        adv, returns = loop_gae(r, v, s, gamma, lam)
        return whiten64(adv, s), returns

    impls = {
        "triton": {
            "returns": lambda r, v, s, gamma, lam: (kernels.triton_discounted_returns(r, s, gamma, **config),),
            "gae": lambda r, v, s, gamma, lam: kernels.triton_gae(r, v, s, gamma, lam, **config),
            "returns+moments": triton_moments,
            "reinforce_plus_plus": estimator_rpp,
            "gae(whiten=True)": estimator_gae,
        },
        "torch scan": {
            "returns": torch_returns, "gae": torch_gae, "returns+moments": torch_moments,
            "reinforce_plus_plus": off(estimator_rpp), "gae(whiten=True)": off(estimator_gae),
        },
        "per-token loop": {
            "returns": lambda r, v, s, gamma, lam: (loop_returns(r, s, gamma),),
            "gae": lambda r, v, s, gamma, lam: loop_gae(r, v, s, gamma, lam),
            "reinforce_plus_plus": loop_rpp,
            "gae(whiten=True)": loop_gae_whitened,
        },
        "triton, 1 program/row": {
            "returns": lambda r, v, s, gamma, lam: (kernels.triton_discounted_returns(r, s, gamma, split=False, **config),),
            "gae": lambda r, v, s, gamma, lam: kernels.triton_gae(r, v, s, gamma, lam, split=False, **config),
        },
    }
    if cuda_graphs:
        impls[GRAPHED] = {"reinforce_plus_plus": graphed(estimator_rpp), "gae(whiten=True)": graphed(estimator_gae)}
    return impls


KINDS = ("returns", "gae", "returns+moments", "reinforce_plus_plus", "gae(whiten=True)")
GRAPHED = "triton, CUDA graph"  # checked for correctness, not timed (each call captures anew)


def bytes_moved(kind, b, t, dtype):
    """The minimum traffic: rewards (+ values) and spans in, returns (+ advantages) out."""
    floats = {"returns": 2, "returns+moments": 2, "reinforce_plus_plus": 3, "gae": 4, "gae(whiten=True)": 4}[kind]
    return b * t * (floats * dtype.itemsize + 1)


# --- timing ---

class Timer:
    """Median time of ``fn()`` in seconds: CUDA events with L2 flushed (a 256 MiB read) before each
    run, or perf_counter on CPU."""

    def __init__(self, device, reps):
        self.device, self.reps = device, reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn, reps=None):
        reps = reps or self.reps
        fn()  # compile / warm up
        times = []
        for _ in range(reps):
            if self.flush is None:
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
                continue
            self.flush.max()  # read, not written: dirty lines left in L2 would be written back during the timed run
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


def copy_bandwidth(timer, device, nbytes):
    """Bytes per second of a device-to-device copy (read + write) of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src), reps=max(5, timer.reps // 5))


# --- the two parts ---

def check_correctness(impls, shapes, dtypes, gammas, device, generator):
    """Rows of (impl, kind, shape, dtype, gamma, relative error, ok) against float64 references:
    the per-token loops up to LOOP_CHECK_MAX_T tokens per row, the float64 torch scan above."""
    import advantages

    rows = []
    for b, t in shapes:
        for dtype in dtypes:
            r, v, s = make_batch(b, t, dtype, device, generator)
            for gamma in gammas:
                if t <= LOOP_CHECK_MAX_T:
                    returns = loop_returns(r.double(), s, gamma)
                    gae_pair = loop_gae(r.double(), v.double(), s, gamma, LAM)
                else:
                    with triton_dispatch_off():
                        returns = advantages.discounted_returns(r.double(), s == A, gamma, spans=s, validate=False)
                        gae_pair = advantages.gae(r.double(), v.double(), s == A, gamma, LAM, spans=s, whiten=False, validate=False)
                assistant_returns = returns[s == A]
                expected = {
                    "returns": (returns,),
                    "gae": gae_pair,
                    "returns+moments": (returns, assistant_returns.mean(), assistant_returns.var()),
                    "reinforce_plus_plus": (whiten64(returns, s), returns),
                    "gae(whiten=True)": (whiten64(gae_pair[0], s), gae_pair[1]),
                }
                for name in ("triton", "torch scan", "triton, 1 program/row", GRAPHED):
                    for kind, want in expected.items():
                        if kind not in impls.get(name, {}):
                            continue
                        poison_allocator(b, t, dtype, device)
                        got = impls[name][kind](r, v, s, gamma, LAM)
                        error = relative_error(got, want)
                        per_token = [g for g in got if g.dim() == 2]
                        exact_zeros = all(bool((g[s != A] == 0).all()) for g in per_token)
                        ok = error <= TOLERANCE[dtype] and exact_zeros and all(g.dtype == dtype for g in per_token)
                        rows.append((name, kind, (b, t), dtype, gamma, error, ok))
    return rows


def poison_allocator(b, t, dtype, device):
    """On CUDA, free a few NaN-filled ``(b, t)`` tensors: the caching allocator hands their blocks to
    the next outputs, so a kernel that skips a store leaves NaN (a failed check), not an earlier result."""
    if device.type == "cuda":
        poisoned = [torch.full((b, t), float("nan"), dtype=dtype, device=device) for _ in range(4)]
        del poisoned


def max_error(errors):
    """The largest of some 0-d error tensors, NaN if any is NaN (Python's ``max`` keeps a NaN only when it comes first)."""
    values = [float(error) for error in errors]
    return float("nan") if any(value != value for value in values) else max(values)


def relative_error(got, want):
    """The largest ``max |g - w| / max(1, max |w|)`` over paired outputs, in float64; NaN if any is NaN."""
    return max_error([(g.double() - w.double()).abs().max() / w.double().abs().max().clamp(min=1.0) for g, w in zip(got, want, strict=True)])


def benchmark(impls, shapes, dtypes, device, generator, timer, bandwidth):
    """Rows of (kind, shape, dtype, {impl: seconds}, floor seconds)."""
    rows = []
    for kind in KINDS:
        for b, t in shapes:
            for dtype in dtypes:
                r, v, s = make_batch(b, t, dtype, device, generator)
                seconds = {}
                for name, fns in impls.items():
                    if kind not in fns or name == GRAPHED or (name == "per-token loop" and b * t > LOOP_MAX_TOKENS):
                        continue
                    fn = fns[kind]
                    seconds[name] = timer(lambda fn=fn: fn(r, v, s, GAMMA, LAM), reps=5 if name == "per-token loop" else None)
                rows.append((kind, (b, t), dtype, seconds, bytes_moved(kind, b, t, dtype) / bandwidth))
    return rows


def config_diff(fn, reference, shape, dtype, device):
    """Largest relative difference of ``fn()``'s outputs from ``reference`` (the default config's),
    the outputs poisoned first; NaN if any is NaN."""
    poison_allocator(*shape, dtype, device)
    got = fn()
    return relative_error(got if isinstance(got, tuple) else (got,), reference)


def sweep(kernels, shape, dtypes, device, generator, timer, bandwidth, blocks_and_warps):
    """Rows of (kind, shape, dtype, (block, warps, stages), seconds, floor fraction, difference from
    the default config) at one shape: the returns, GAE and fused-moments kernels, one program per row."""
    configs = [(block, warps, stages) for block, warps in blocks_and_warps for stages in (1, 2, 3)]
    rows = []
    for kind in ("returns", "returns+moments", "gae", "gae+moments"):
        for dtype in dtypes:
            r, v, s = make_batch(*shape, dtype, device, generator)
            run = {
                "returns": lambda **config: kernels.triton_discounted_returns(r, s, GAMMA, split=False, **config),
                "returns+moments": lambda **config: kernels.triton_discounted_returns_with_moments(r, s, GAMMA, split=False, **config),
                "gae": lambda **config: kernels.triton_gae(r, v, s, GAMMA, LAM, split=False, **config),
                "gae+moments": lambda **config: kernels.triton_gae_with_moments(r, v, s, GAMMA, LAM, split=False, **config),
            }[kind]
            reference = run()
            reference = reference if isinstance(reference, tuple) else (reference,)
            for block, warps, stages in configs:
                fn = lambda config=dict(block=block, num_warps=warps, num_stages=stages): run(**config)  # noqa: E731
                seconds = timer(fn)
                moved = bytes_moved(kind.removesuffix("+moments") if kind.startswith("gae") else kind, *shape, dtype)
                diff = config_diff(fn, reference, shape, dtype, device)
                rows.append((kind, shape, dtype, (block, warps, stages), seconds, moved / bandwidth / seconds, diff))
    return rows


def split_sweep(kernels, shapes, dtypes, device, generator, timer, bandwidth, blocks_and_warps):
    """Rows like :func:`sweep` for the returns and GAE kernels on long rows: split across programs
    (chunks of ``block``) or one program per row, the first dtype only."""
    rows = []
    for shape in shapes:
        dtype = dtypes[0]
        r, v, s = make_batch(*shape, dtype, device, generator)
        for kind in ("returns", "gae"):
            if kind == "returns":
                run = lambda **config: (kernels.triton_discounted_returns(r, s, GAMMA, **config),)  # noqa: E731
            else:
                run = lambda **config: kernels.triton_gae(r, v, s, GAMMA, LAM, **config)  # noqa: E731
            reference = run()
            for split in (True, False):
                for block, warps in blocks_and_warps:
                    fn = lambda config=dict(block=block, num_warps=warps, num_stages=1, split=split): run(**config)  # noqa: E731
                    seconds = timer(fn)
                    name = f"{kind}, split" if split else f"{kind}, 1 program/row"
                    diff = config_diff(fn, reference, shape, dtype, device)
                    moved = bytes_moved(kind, *shape, dtype)
                    rows.append((name, shape, dtype, (block, warps, 1), seconds, moved / bandwidth / seconds, diff))
    return rows


# --- output ---

def fmt_time(seconds):
    return f"{seconds * 1e6:,.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def speed_table(rows):
    header = ["kind", "(b, t)", "dtype", "triton", "triton, 1 program/row", "torch scan", "per-token loop", "triton vs torch scan", "triton vs loop", "HBM floor", "triton % of floor"]
    body = []
    for kind, shape, dtype, seconds, floor in rows:
        tri = seconds["triton"]
        loop = seconds.get("per-token loop")
        unsplit = seconds.get("triton, 1 program/row")
        body.append([
            kind, str(shape), dtype_name(dtype), fmt_time(tri), fmt_time(unsplit) if unsplit else "-", fmt_time(seconds["torch scan"]),
            fmt_time(loop) if loop else "not timed",
            f"{seconds['torch scan'] / tri:,.1f}x", f"{loop / tri:,.0f}x" if loop else "-",
            fmt_time(floor), f"{100 * floor / tri:.0f}%",
        ])
    return header, body


def correctness_table(rows):
    """One line per (impl, kind, dtype): the worst case over shapes and gammas."""
    groups = {}
    for name, kind, shape, dtype, gamma, error, ok in rows:
        groups.setdefault((name, kind, dtype), []).append((error, shape, gamma, ok))
    header = ["impl", "kind", "dtype", "cases", "max rel. error", "worst at (b, t), gamma", "all ok"]
    body = []
    for (name, kind, dtype), cases in groups.items():
        error, shape, gamma, _ = max(cases, key=lambda case: float("inf") if case[0] != case[0] else case[0])
        ok = all(case[3] for case in cases)
        body.append([name, kind, dtype_name(dtype), str(len(cases)), f"{error:.1e}", f"{shape}, {gamma}", "yes" if ok else "NO"])
    return header, body


def sweep_table(rows):
    header = ["kind", "(b, t)", "dtype", "block, warps, stages", "time", "% of floor", "max rel. diff from default", "ok"]
    body = [
        [kind, str(shape), dtype_name(dtype), str(config), fmt_time(seconds), f"{100 * fraction:.0f}%", f"{diff:.1e}",
         "yes" if sweep_ok(dtype, diff) else "NO"]
        for kind, shape, dtype, config, seconds, fraction, diff in rows
    ]
    return header, body


def sweep_ok(dtype, diff):
    """A config agrees with the default one within twice the tolerance against the reference (False for NaN)."""
    return diff <= 2 * TOLERANCE[dtype]


def print_table(console, title, header, body):
    table = Table(title=title)
    for column in header:
        table.add_column(column)
    for row in body:
        table.add_row(*row)
    console.print(table)


def markdown(title, header, body):
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    if args.out is not None and (args.out.exists() or not args.out.parent.is_dir()):
        sys.exit(f"--out {args.out}: " + ("exists (choose a new name)" if args.out.exists() else "its folder does not exist"))
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
    elif not torch.cuda.is_available():
        sys.exit(
            "gpu_returns.py needs an NVIDIA GPU (H100/H200 class) with a CUDA build of torch; "
            "torch.cuda.is_available() is False here. For a CPU dry run of the script's logic use --interpret-smoke."
        )
    try:
        import triton
    except ImportError:
        sys.exit("gpu_returns.py needs triton (pip install triton)")
    from advantages import triton_kernels

    device = torch.device("cpu" if args.interpret_smoke else "cuda")
    if device.type == "cuda":  # the "triton" estimator rows must not fall back to the torch scan unseen
        import advantages.returns

        if advantages.returns._triton(torch.zeros(1, device=device)) is None:
            sys.exit("the estimators do not take the Triton path on this GPU (advantages.returns._triton)")
    shapes = SMOKE_SHAPES if args.interpret_smoke else SHAPES
    config = dict(block=32) if args.interpret_smoke else {}  # several chunks per row in the smoke run
    dtypes = (torch.float32, torch.bfloat16)
    gammas = (GAMMA,) if args.quick else (0.5, GAMMA, 1.0)
    reps = args.reps or (3 if args.interpret_smoke else 20 if args.quick else 100)
    device_name = "CPU (Triton interpreter smoke run)" if args.interpret_smoke else torch.cuda.get_device_name()
    generator = torch.Generator().manual_seed(0)
    console = Console(width=200)  # the speed table is wide
    impls = implementations(triton_kernels, config, cuda_graphs=device.type == "cuda")
    timer = Timer(device, reps)

    started = time.perf_counter()
    console.print(f"[bold]{device_name}[/bold], torch {torch.__version__}, triton {triton.__version__}")
    bandwidth = copy_bandwidth(timer, device, 2**20 if args.interpret_smoke else 2**30)
    console.print(f"device-to-device copy: {bandwidth / 1e9:,.0f} GB/s (read + write)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"## Fused Triton returns on {device_name} ({stamp})\n\n"
        f"`python benchmarks/gpu_returns.py {' '.join(sys.argv[1:])}`; torch {torch.__version__}, triton {triton.__version__}; "
        f"device-to-device copy {bandwidth / 1e9:,.0f} GB/s; the floor is bytes in + out at that bandwidth.\n\n"
    )
    sections = []

    def report(title, header, body):
        """Print a finished part and rewrite --out with every part so far (a cut-short run keeps them)."""
        sections.append((title, header, body))
        print_table(console, title, header, body)
        if args.out:
            args.out.write_text(head + "\n".join(markdown(*section) for section in sections))

    checks = check_correctness(impls, shapes, dtypes, gammas, device, generator)
    title = f"Correctness against a float64 per-token loop (tolerance {', '.join(f'{dtype_name(d)} {t:g}' for d, t in TOLERANCE.items())})"
    report(title, *correctness_table(checks))
    failed = not all(ok for *_, ok in checks)
    speed = benchmark(impls, shapes, dtypes, device, generator, timer, bandwidth)
    report(f"Speed, gamma {GAMMA} (GAE lambda {LAM}), median of {reps} runs", *speed_table(speed))
    if args.sweep:
        blocks_and_warps = ((32, 1), (64, 2)) if args.interpret_smoke else ((1024, 4), (2048, 4), (2048, 8), (4096, 8))
        sweep_shape = shapes[-1] if args.interpret_smoke else SWEEP_SHAPE
        rows = sweep(triton_kernels, sweep_shape, dtypes, device, generator, timer, bandwidth, blocks_and_warps)
        split_shapes = SMOKE_SPLIT_SHAPES if args.interpret_smoke else SPLIT_SWEEP_SHAPES
        split_configs = ((16, 1), (32, 1)) if args.interpret_smoke else ((1024, 4), (2048, 4), (2048, 8), (4096, 8))
        rows += split_sweep(triton_kernels, split_shapes, dtypes, device, generator, timer, bandwidth, split_configs)
        report("Launch configs", *sweep_table(rows))
        failed |= not all(sweep_ok(dtype, diff) for _, _, dtype, *_, diff in rows)
    console.print(f"done in {time.perf_counter() - started:.0f} s" + (f"; wrote {args.out}" if args.out else ""))
    if failed:
        sys.exit("correctness check FAILED (see the tables)")


if __name__ == "__main__":
    main()
