"""Our rollout against the engine's own speed on exactly the same token work (issue 48), per backend and concurrency.

    .venv/bin/python benchmarks/engine_limit.py --model smollm2-135m
    .venv/bin/python benchmarks/engine_limit.py --model tiny --backends vllm http hf --concurrency 1 8 32 64
    .venv/bin/python benchmarks/engine_limit.py --quick          # smoke test: tiny agent, small sizes

Per backend (vLLM in process, vLLM over HTTP through ``agent-loop serve``, transformers) and per concurrency c, one run:

1. **ours**: ``run_rollouts`` (the loop, the tools, the sink writing a JSON Lines file) plays the episodes with c in
   flight; a thin recorder around the backend keeps every request: its episode, prompt token ids, the number of
   tokens generated, and when it was in flight.
2. **engine**: the recorded requests replayed on the same engine with no loop: the same prompt ids, exactly the same
   number of generated tokens (``max_tokens = n``, EOS and stop tokens ignored; each count checked), same sampling
   (temperature, logprobs of the sampled token), c episodes in flight, each episode's turns in their recorded order.
   vLLM in process: ``AsyncLLM.generate`` on the engine's own event loop; HTTP: the server's ``/v1/completions``
   with token-id prompts; transformers: the backend's own batched decode.
3. **ratio** = ours / engine (tokens/s of generated tokens).
4. **where the rest goes** (the loop run): ``busy`` = share of the wall time with at least one request in flight
   (the rest: the engine had nothing to do, the loop's Python was on the critical path); ``in flight`` = mean
   requests in flight / c (below 1: episodes between turns, in our Python or the tools); CPU seconds per
   wall second of the main thread (our loop), the other threads of our process (vLLM's client thread in process,
   the transformers decode thread), and the engine's processes; ``idle cores`` = cores - all of those. With
   ``--profile`` a second loop run under cProfile (main thread only) splits the main thread's time into
   rendering, parsing, tools, sink, engine client, waiting (event-loop poll) and the rest (shares of that run;
   cProfile slows Python, so the shares overstate our Python's cost a little).

Backends run one after the other (never two engines at once), each with a short warm-up. ``--threads`` (default:
all the cores this process may use) is bound for every backend: torch's threads for transformers, vLLM's OpenMP
threads for the engine in process and for ``agent-loop serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from real_model_rollout import agent_loop_serve  # noqa: E402  (benchmarks/real_model_rollout.py)

from agent_loop.backends.base import Backend  # noqa: E402

BACKENDS = ("vllm", "http", "hf", "vllm-autobind")
LABELS = {"vllm": "vLLM in process", "http": "vLLM over HTTP (agent-loop serve)", "hf": "transformers",
          "vllm-autobind": "vLLM in process, vLLM's own binding"}
COLUMNS = ("backend", "concurrency", "episodes", "tokens", "engine tok/s", "ours tok/s", "ratio", "busy", "in flight",
           "main thread cpu", "our other threads cpu", "engine procs cpu", "idle cores")


class RecordingBackend(Backend):
    """Passes every call to ``inner`` and records it: (session, prompt ids, generated count, start, end, seed)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple] = []

    @property
    def context_length(self):
        return self.inner.context_length

    def describe(self, session_id=None):
        return self.inner.describe(session_id)

    async def end_run(self):
        await self.inner.end_run()

    async def generate(self, prompt_ids, sampling, session_id=None):
        started = time.perf_counter()
        result = await self.inner.generate(prompt_ids, sampling, session_id)
        self.calls.append((session_id, list(prompt_ids), len(result.token_ids), started, time.perf_counter(),
                           sampling.seed))
        return result


def interval_stats(calls: list[tuple], started: float, wall: float) -> tuple[float, float]:
    """(share of ``wall`` with >= 1 request in flight, mean requests in flight) of the recorded calls."""
    events = sorted([(c[3], 1) for c in calls] + [(c[4], -1) for c in calls])
    busy = area = 0.0
    level, last = 0, started
    for at, step in events:
        busy += (at - last) if level > 0 else 0.0
        area += (at - last) * level
        level, last = level + step, at
    return busy / wall, area / wall


def reusable_prefix(calls: list[tuple]) -> float:
    """Share of the prompt tokens a prefix cache can skip: each later turn's prompt starts with the turn before's
    prompt and its generated tokens (the loop's token-in/token-out contract), checked on the prompts."""
    reused = 0
    for episode in episodes_of(calls):
        for before, turn in zip(episode, episode[1:]):
            if turn[1][: len(before[1])] != before[1]:
                raise RuntimeError("a turn's prompt does not extend the turn before's")
            reused += len(before[1]) + before[2]
    return reused / max(1, sum(len(call[1]) for call in calls))


def episodes_of(calls: list[tuple]) -> list[list[tuple]]:
    """The recorded calls grouped by episode (session id), each episode's turns in their order."""
    by_session = defaultdict(list)
    for call in sorted(calls, key=lambda c: c[3]):
        by_session[call[0]].append(call)
    return list(by_session.values())


async def replay(episodes: list[list[tuple]], concurrency: int, generate_exact) -> float:
    """Wall seconds to replay ``episodes`` with ``concurrency`` in flight; ``generate_exact(prompt, n, seed)``."""
    todo = iter(episodes)

    async def worker():
        for episode in todo:
            for _, prompt, n, _, _, seed in episode:
                got = await generate_exact(prompt, n, seed)
                if got != n:
                    raise RuntimeError(f"replay generated {got} tokens, asked for exactly {n}")

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(episodes)))))
    return time.perf_counter() - started


class CpuClock:
    """CPU seconds of this process's main thread, its other threads, and its child processes (the engines)."""

    def __init__(self):
        import psutil

        self.process = psutil.Process()
        self.main_id = threading.main_thread().native_id

    def read(self) -> tuple[float, float, float]:
        main = next((t.user_time + t.system_time for t in self.process.threads() if t.id == self.main_id), 0.0)
        times = self.process.cpu_times()  # the whole process, threads that have ended included (the /proc counters)
        whole = times.user + times.system
        children = 0.0
        for child in self.process.children(recursive=True):
            with contextlib.suppress(Exception):
                times = child.cpu_times()
                children += times.user + times.system
        return main, whole - main, children


PROFILE_GROUPS = (  # first match of the function's file path (or built-in's name) wins
    # the event loop's poll, and threads waited on (tools and rewards run on threads of their own, bounded)
    ("wait", ("select.", "selectors.py", "<method 'acquire' of '_thread.lock'")),
    ("engine client", ("/vllm/", "agent_loop/backends/", "aiohttp", "/zmq/", "msgspec", "threading.py")),
    ("rendering", ("agent_loop/episode/chat.py", "agent_loop/episode/tool_formats.py", "/jinja2/", "<template>",
                   "/transformers/", "/tokenizers/", "'tokenizers.", "<method 'encode", "<method 'decode")),
    ("parsing", ("agent_loop/episode/parsers.py", "/json/")),
    ("tools", ("agent_loop/episode/tools.py", "agent_loop/toolsets/", "agent_loop/tasks/", "agent_loop/signals.py",
               "concurrent/futures", "start_new_thread", "_queue.SimpleQueue", "random.py")),
    ("sink", ("agent_loop/runners/", "agent_loop/types.py", "/tqdm/", "agent_loop/files.py", "copy.py",
              "dataclasses.py")),
    ("loop", ("agent_loop/episode/loop.py", "agent_loop/episode/", "asyncio/")),
)


def profile_split(profile: cProfile.Profile) -> dict[str, float]:
    """Shares of the profiled main thread's own time (tottime) per group of PROFILE_GROUPS ("other": the rest)."""
    stats = pstats.Stats(profile)
    totals: dict[str, float] = defaultdict(float)
    for (path, _, name), (_, _, tottime, _, _) in stats.stats.items():
        where = f"{path}:{name}" if path != "~" else name
        group = next((g for g, keys in PROFILE_GROUPS if any(k in where for k in keys)), "other")
        totals[group] += tottime
    whole = sum(totals.values()) or 1.0
    if os.environ.get("ENGINE_LIMIT_SHOW_OTHER"):  # what the groups miss, to refine PROFILE_GROUPS
        other = sorted(((t[2], k) for k, t in stats.stats.items()
                        if next((g for g, keys in PROFILE_GROUPS if any(x in f"{k[0]}:{k[2]}" for x in keys)), None) is None),
                       reverse=True)[:12]
        print("\n".join(f"    other: {t:.3f} s {k}" for t, k in other))
    return {g: totals[g] / whole for g in [g for g, _ in PROFILE_GROUPS] + ["other"]}


async def play(task, backend, tokenizer, config, episodes: int, concurrency: int, *, first: int, out: Path):
    from agent_loop.runners.local import run_rollouts

    trajectories = await run_rollouts(task, backend, tokenizer, range(first, first + episodes), config, seed=0,
                                      concurrency=concurrency, output_path=out, progress=False)
    failed = [t for t in trajectories if t.finish_reason == "error"]
    if failed:  # a dead engine "finishes" episodes fast: never report that as throughput
        raise RuntimeError(f"{len(failed)} episodes ended in an error: "
                           f"{failed[0].metrics.get('backend_error') or failed[0].metrics.get('error')}")
    return trajectories


def measure_level(name, backend, generate_exact, run_on_engine, task, tokenizer, config, args, c: int,
                  first: int, clock: CpuClock, cores: int) -> dict:
    """One concurrency level: the loop run (recorded, timed, CPU split), its replay, optionally a profiled run."""
    episodes = max(args.episodes, c)
    recorder = RecordingBackend(backend)
    with tempfile.TemporaryDirectory(prefix="engine-limit-") as folder:
        before = clock.read()
        started = time.perf_counter()
        trajectories = asyncio.run(play(task, recorder, tokenizer, config, episodes, c, first=first,
                                        out=Path(folder) / "rollouts.jsonl"))
        wall = time.perf_counter() - started
        after = clock.read()
    tokens = sum(call[2] for call in recorder.calls)
    if tokens != sum(t.metrics["assistant_tokens"] for t in trajectories):
        raise RuntimeError("the recorder missed generated tokens")
    busy, in_flight = interval_stats(recorder.calls, started, wall)
    cpu = [(b - a) / wall for a, b in zip(before, after)]
    engine_wall = run_on_engine(replay(episodes_of(recorder.calls), c, generate_exact))
    row = {"backend": LABELS[name], "concurrency": c, "episodes": episodes, "tokens": tokens,
           "engine": tokens / engine_wall, "ours": tokens / wall, "ratio": engine_wall / wall, "busy": busy,
           "in_flight": in_flight / c, "cpu": cpu, "idle_cores": cores - sum(cpu),
           "turns": len(recorder.calls), "prompt_tokens": sum(len(call[1]) for call in recorder.calls),
           "reusable": reusable_prefix(recorder.calls)}
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        try:
            asyncio.run(play(task, backend, tokenizer, config, episodes, c, first=first,
                             out=Path(tempfile.mkdtemp(prefix="engine-limit-")) / "rollouts.jsonl"))
        finally:
            profile.disable()
        row["profile"] = profile_split(profile)
    print(f"  {LABELS[name]}, concurrency {c}: engine {row['engine']:.0f} tok/s, ours {row['ours']:.0f} tok/s, "
          f"ratio {row['ratio']:.2f} ({tokens} tokens in {len(recorder.calls)} turns, {episodes} episodes, "
          f"{row['prompt_tokens']} prompt tokens of which {row['reusable']:.0%} a prefix cache can skip; "
          f"load {os.getloadavg()[0]:.1f})", flush=True)
    return row


@contextlib.contextmanager
def open_backend(name: str, model: str, args):
    """(backend, generate_exact, run_on_engine) for ``name``: the loop's backend, the engine's exact replay call
    (async ``(prompt, n, seed) -> generated count``) and how a replay coroutine is run."""
    temperature = args.temperature
    if name == "hf":
        from agent_loop.backends.base import SamplingParams
        from agent_loop.backends.hf import TransformersBackend

        backend = TransformersBackend(model, max_batch_size=max(args.concurrency))

        async def exact(prompt, n, seed):
            sampling = SamplingParams(max_tokens=n, temperature=temperature, stop_token_ids=[], seed=seed)
            return len((await backend.generate(prompt, sampling)).token_ids)

        yield backend, exact, asyncio.run
    elif name.startswith("vllm"):
        from agent_loop.backends.vllm_engine import VLLMEngineBackend

        if name == "vllm-autobind":  # what the engine did before issue 48: vLLM's "auto" (1 core of 2 reserved)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
        try:
            backend = VLLMEngineBackend(model, seed=0, threads=args.threads, **args.engine_kwargs)
        finally:
            if name == "vllm-autobind":
                del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        with backend:
            from vllm import SamplingParams as VLLMSamplingParams
            from vllm import TokensPrompt
            from vllm.sampling_params import RequestOutputKind

            engine, ids = backend._engine, iter(range(10**9))

            async def exact(prompt, n, seed):  # on the engine's own loop: vLLM's AsyncLLM, no hop, no loop
                params = VLLMSamplingParams(max_tokens=n, min_tokens=n if args.min_tokens else 0, temperature=temperature, seed=seed,
                                            ignore_eos=True, logprobs=0, detokenize=False,
                                            output_kind=RequestOutputKind.FINAL_ONLY)
                (engine_input,) = engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=prompt)])
                final = None
                async for final in engine.generate(engine_input, params, request_id=f"replay-{next(ids)}"):
                    pass
                return len(final.outputs[0].token_ids)

            yield backend, exact, lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, backend._loop).result()
    else:
        import aiohttp

        from agent_loop.backends.openai_http import OpenAIHTTPBackend

        with agent_loop_serve(model, args.threads, Path(tempfile.gettempdir()) / "engine-limit-serve.log") as url:
            backend = OpenAIHTTPBackend([url], "policy")

            pooled = {}

            async def exact(prompt, n, seed):
                payload = {"model": "policy", "prompt": prompt, "max_tokens": n, "min_tokens": n if args.min_tokens else 0,
                           "ignore_eos": True,
                           "temperature": temperature, "seed": seed, "logprobs": 0, "return_token_ids": True}
                async with pooled["http"].post(f"{url}/v1/completions", json=payload) as response:
                    body = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"/v1/completions answered {response.status}: {body}")
                return len(body["choices"][0]["token_ids"])

            async def with_session(coroutine):  # one pooled session per replay, as the backend keeps one
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as pooled["http"]:
                    return await coroutine

            yield backend, exact, lambda coroutine: asyncio.run(with_session(coroutine))


def cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[dict]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        main, others, engine = r["cpu"]
        print(f"| {r['backend']} | {r['concurrency']} | {r['episodes']} | {r['tokens']} | {r['engine']:.0f} | "
              f"{r['ours']:.0f} | {r['ratio']:.2f} | {r['busy']:.2f} | {r['in_flight']:.2f} | {main:.2f} | "
              f"{others:.2f} | {engine:.2f} | {r['idle_cores']:.2f} |")
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        groups = list(profiled[0]["profile"])
        print("\nMain thread's time in the profiled loop run (cProfile, shares):\n")
        print("| backend | concurrency | " + " | ".join(groups) + " |")
        print("|" + "---|" * (len(groups) + 2))
        for r in profiled:
            print(f"| {r['backend']} | {r['concurrency']} | " + " | ".join(f"{r['profile'][g]:.2f}" for g in groups)
                  + " |")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="a model folder or a built-in model name (tiny, smollm2-135m)")
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--episodes", type=int, default=32, help="episodes per level (at least the concurrency)")
    parser.add_argument("--threads", type=int, default=None,
                        help="cores bound for every backend (default: all the cores this process may use)")
    parser.add_argument("--max-tokens", type=int, default=None, help="per assistant turn (default: LoopConfig's)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="a second, cProfiled loop run per level for the main thread's split")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="vLLM in process: enable_prefix_caching (default: vLLM's)")
    parser.add_argument("--min-tokens", action=argparse.BooleanOptionalAction, default=False,
                        help="replay with min_tokens = max_tokens too (without it: no stop tokens and EOS ignored, so "
                             "exactly max_tokens anyway; the count is checked)")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny agent, concurrency 1 and 4, 4 episodes")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.episodes, args.max_tokens = [1, 4], 4, args.max_tokens or 32
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from agent_loop.episode.loop_config import LoopConfig
    from agent_loop.model_folders import model_path
    from agent_loop.tasks.registry import get_task
    from agent_loop.threads import apply_threads, usable_cores

    cores = usable_cores()
    args.threads = args.threads or cores
    apply_threads(args.threads)
    args.engine_kwargs = {} if args.prefix_caching is None else {"enable_prefix_caching": args.prefix_caching}
    model = str(model_path(None if args.model == "tiny" else args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    task = get_task(args.task)
    config = LoopConfig(temperature=args.temperature, **({"max_tokens": args.max_tokens} if args.max_tokens else {}))
    clock, rows, failed = CpuClock(), [], []
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for name in args.backends:
        print(f"{LABELS[name]}:", flush=True)
        try:
            with open_backend(name, model, args) as (backend, exact, run_on_engine):
                asyncio.run(play(task, backend, tokenizer, config, 4, 4, first=10**6,
                                 out=Path(tempfile.mkdtemp(prefix="engine-limit-")) / "warm.jsonl"))  # warm-up
                for c in args.concurrency:
                    rows.append(measure_level(name, backend, exact, run_on_engine, task, tokenizer, config, args, c,
                                              0, clock, cores))
        except Exception as error:  # one backend that cannot run here must not lose the others' numbers
            failed.append(f"{LABELS[name]}: failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}")
            print(failed[-1], flush=True)
    print(f"\nmodel {model}, task {args.task}, temperature {args.temperature}, max_tokens {config.max_tokens}, "
          f"{args.threads} bound core(s) of {cores}, load average at end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print_table(rows)
    if failed:
        print("\n" + "\n".join(failed))
    return rows


if __name__ == "__main__":  # vLLM starts worker processes
    main()
