"""Our rollout against the engine's own speed on exactly the same token work (issues 48, 56), per backend and
concurrency.

    .venv/bin/python benchmarks/engine_limit.py --model smollm2-135m
    .venv/bin/python benchmarks/engine_limit.py --model tiny --backends vllm http hf --concurrency 1 8 32 64
    .venv/bin/python benchmarks/engine_limit.py --quick          # smoke test: tiny agent, small sizes

Multi-turn work (issue 56 item 4: SmolLM2 warm-started on arithmetic plays 2 turns per episode, a tool call and the
answer; 32 episodes at concurrency 32, against both replays). The warm start is made once (minutes of CPU), then:

    agent-loop warmstart --model smollm2-135m --task arithmetic --output-dir /tmp/warm-arithmetic
    .venv/bin/python benchmarks/engine_limit.py --model /tmp/warm-arithmetic/model --task arithmetic \
        --backends vllm http --concurrency 32 --episodes 32 --replay turns episodes

(``--max-turns N`` caps the turns per episode; the table's ``turns / episode`` says what the episodes played.)

Per backend (vLLM in process, vLLM over HTTP through ``agent-loop serve``, transformers) and per concurrency c, one run:

1. **ours**: ``run_rollouts`` (the loop, the tools, the sink writing a JSON Lines file) plays the episodes with c in
   flight; a thin recorder around the backend keeps every request: its episode, prompt token ids, the number of
   tokens generated, and when it was in flight.
2. **engine**: the recorded requests replayed on the same engine with no loop: the same prompt ids, exactly the same
   number of generated tokens (``max_tokens = n``, EOS and stop tokens ignored; each count checked), same sampling
   (temperature, logprobs of the sampled token, seed). ``--replay`` picks how (one or both, in one run, on the same
   recorded requests; the table has tok/s and ratio for each):

   - ``episodes`` (the default): c episodes in flight, each episode's turns one after the other in their recorded
     order (an episode's next turn starts the moment its last ended: the loop with zero time between turns).
   - ``turns``: turn by turn with barriers: every episode's first request (up to c in flight at once), wait until
     all have ended, then every second request, and so on (an episode with fewer turns drops out).

   Each turn's prompt extends the one before's, so in both the engine's own prefix cache skips the earlier context
   as it does for the loop (vLLM's ``enable_prefix_caching``, on by default; transformers: its kept caches, the
   replay passes each episode's session id). vLLM in process: ``AsyncLLM.generate`` on the engine's own event loop;
   HTTP: the server's ``/v1/completions`` with token-id prompts; transformers: the backend's own batched decode.
   With ``--reset-cache`` (the default) the engine's prefix cache is emptied before the loop run, before each
   replay and before the profiled run (vLLM: ``reset_prefix_cache``, ``/reset_prefix_cache`` for ``agent-loop
   serve``; transformers: its kept caches), so no run reuses blocks an earlier run of the same prompts computed
   (before issue 56 none was emptied: a replay found the loop run's prompts cached).
3. **ratio** = ours / engine (tokens/s of generated tokens), per replay.
4. **where the rest goes** (the loop run): ``busy`` = share of the wall time with at least one request in flight
   (the rest: the engine had nothing to do, the loop's Python was on the critical path); ``in flight`` = mean
   requests in flight / c (below 1: episodes between turns, in our Python or the tools); ``below c`` = share of the
   wall time with fewer than c requests in flight (the engine's batch was not full: episodes between turns, or the
   level's last episodes running with fewer beside them); CPU seconds per wall second of the main thread (our loop),
   the other threads of our process (vLLM's client thread in process, the transformers decode thread), and the
   engine's processes; ``idle cores`` = cores - all of those.
   **Between turns** (a second table): per episode, each gap from a request's end to the same episode's next
   request's start (the time in our loop between its turns: parsing the reply, the tools, rendering the
   observation, tokenising it, and waiting for the event loop's main thread when other episodes hold it), their
   count, mean and p90 (nearest rank) in ms; ``tools ms / gap`` = the episodes' ``tools_s`` (time in tool calls) summed,
   over the number of gaps (the rest of a gap is our Python and the event loop); and ``in flight`` / ``below c`` of each replay beside the
   loop's, so a gap between the loop's and a replay's batch fill shows directly.
   With ``--profile`` a second loop run under cProfile (main thread only) splits the main thread's time into
   rendering, parsing, tools, sink, engine client, waiting (event-loop poll) and the rest (shares of that run;
   cProfile slows Python, so the shares overstate our Python's cost a little).

Backends run one after the other (never two engines at once), each with a short warm-up (the engine's start and
first requests are outside every timing). ``--threads`` (default: all the cores this process may use) is bound for
every backend: torch's threads for transformers, vLLM's OpenMP threads for the engine in process and for
``agent-loop serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import math
import os
import pstats
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from real_model_rollout import agent_loop_serve  # noqa: E402  (benchmarks/real_model_rollout.py)

from agent_loop.backends.base import Backend  # noqa: E402

BACKENDS = ("vllm", "http", "hf", "vllm-autobind")
LABELS = {"vllm": "vLLM in process", "http": "vLLM over HTTP (agent-loop serve)", "hf": "transformers",
          "vllm-autobind": "vLLM in process, vLLM's own binding"}
REPLAYS = ("episodes", "turns")  # how the recorded requests are replayed on the engine (the module's docstring)


def columns(replays=("episodes",)) -> tuple[str, ...]:
    """The main table's columns for ``replays`` (each: its tok/s and ours / its tok/s)."""
    return ("backend", "concurrency", "episodes", "turns / episode", "tokens",
            *[c for mode in replays for c in (f"{mode} replay tok/s", f"ours / {mode} replay")], "ours tok/s",
            "busy", "in flight", "below c", "main thread cpu", "our other threads cpu", "engine procs cpu",
            "idle cores")


def gap_columns(replays=("episodes",)) -> tuple[str, ...]:
    """The between-turns table's columns for ``replays``."""
    return ("backend", "concurrency", "turns / episode", "gaps", "gap mean ms", "gap p90 ms", "tools ms / gap",
            "in flight: ours", *[f"in flight: {m} replay" for m in replays], "below c: ours",
            *[f"below c: {m} replay" for m in replays])


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


def in_flight_stats(spans, started: float, wall: float, concurrency: int) -> tuple[float, float, float]:
    """Of the requests in flight over [started, started + wall] (``spans``: (start, end) pairs): (share of the time
    with >= 1 in flight, mean number in flight, share of the time with fewer than ``concurrency`` in flight)."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    busy = area = full = 0.0
    level, last = 0, started
    for at, step in events:
        busy += (at - last) if level > 0 else 0.0
        area += (at - last) * level
        full += (at - last) if level >= concurrency else 0.0
        level, last = level + step, at
    return busy / wall, area / wall, 1.0 - full / wall


def turn_gaps(calls: list[tuple]) -> list[float]:
    """Seconds from each recorded request's end to the same episode's next request's start (the loop between turns)."""
    return [turn[3] - before[4] for episode in episodes_of(calls) for before, turn in zip(episode, episode[1:])]


def p90(values: list[float]) -> float | None:
    """The 90th percentile of ``values`` (nearest rank), None for none."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)] if ordered else None


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


async def replay(episodes: list[list[tuple]], concurrency: int, generate_exact, mode: str = "episodes",
                 spans: list | None = None) -> float:
    """Wall seconds to replay the recorded ``episodes`` (:func:`episodes_of`) with up to ``concurrency`` requests in
    flight, by ``mode`` (:data:`REPLAYS`): ``episodes``, c episodes at once, each one's turns in order; ``turns``,
    every episode's k-th request (c at once), all ended before any k+1-th starts. ``generate_exact(prompt, n, seed,
    session)`` returns the generated count (checked against n); each request's (start, end), in seconds from the
    replay's start, is appended to ``spans``."""
    spans = [] if spans is None else spans

    async def pool(groups: list[list[tuple]]) -> None:  # up to `concurrency` groups at once, each one's calls in order
        todo = iter(groups)

        async def worker():
            for group in todo:
                for session, prompt, n, _, _, seed in group:
                    at = time.perf_counter()
                    got = await generate_exact(prompt, n, seed, session)
                    spans.append((at - started, time.perf_counter() - started))
                    if got != n:
                        raise RuntimeError(f"replay generated {got} tokens, asked for exactly {n}")

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(groups)))))

    if mode not in REPLAYS:
        raise ValueError(f"replay mode {mode!r}: one of {', '.join(REPLAYS)}")
    started = time.perf_counter()
    if mode == "episodes":
        await pool(episodes)
    else:
        for k in range(max(map(len, episodes), default=0)):  # the barrier: pool returns when turn k's all ended
            await pool([[episode[k]] for episode in episodes if len(episode) > k])
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


@dataclass
class Engine:
    """One backend opened for a level's runs: the loop's ``backend``; ``exact``, the engine's exact replay call
    (async ``(prompt, n, seed, session) -> generated count``); ``run``, how a replay coroutine is run (on the engine's
    own event loop where it has one); ``reset``, empties the engine's prefix cache (kept caches) for the next run."""

    backend: Backend
    exact: object
    run: object
    reset: object = lambda: None


def measure_level(name, engine: Engine, task, tokenizer, config, args, c: int, first: int, clock: CpuClock,
                  cores: int) -> dict:
    """One concurrency level: the loop run (recorded, timed, CPU split), its replays, optionally a profiled run."""
    episodes = max(args.episodes, c)
    recorder = RecordingBackend(engine.backend)
    reset = engine.reset if args.reset_cache else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="engine-limit-") as folder:
        reset()
        before = clock.read()
        started = time.perf_counter()
        trajectories = asyncio.run(play(task, recorder, tokenizer, config, episodes, c, first=first,
                                        out=Path(folder) / "rollouts.jsonl"))
        wall = time.perf_counter() - started
        after = clock.read()
    tokens = sum(call[2] for call in recorder.calls)
    if tokens != sum(t.metrics["assistant_tokens"] for t in trajectories):
        raise RuntimeError("the recorder missed generated tokens")
    busy, in_flight, below = in_flight_stats([call[3:5] for call in recorder.calls], started, wall, c)
    cpu = [(b - a) / wall for a, b in zip(before, after)]
    gaps = turn_gaps(recorder.calls)
    tools_s = sum(t.metrics.get("tools_s", 0.0) for t in trajectories)
    replays = {}
    for mode in args.replay:
        reset()
        spans: list = []
        replay_wall = engine.run(replay(episodes_of(recorder.calls), c, engine.exact, mode, spans))
        _, replay_in_flight, replay_below = in_flight_stats(spans, 0.0, replay_wall, c)
        replays[mode] = {"tok_s": tokens / replay_wall, "ratio": replay_wall / wall, "wall": replay_wall,
                         "in_flight": replay_in_flight / c, "below": replay_below}
    first_replay = replays[args.replay[0]]
    row = {"backend": LABELS[name], "concurrency": c, "episodes": episodes, "tokens": tokens,
           "engine": first_replay["tok_s"], "ours": tokens / wall, "ratio": first_replay["ratio"], "replays": replays,
           "wall": wall, "busy": busy, "in_flight": in_flight / c, "below": below, "cpu": cpu,
           "idle_cores": cores - sum(cpu), "turns": len(recorder.calls),
           "turns_per_episode": len(recorder.calls) / len(episodes_of(recorder.calls)),
           "gaps": len(gaps), "gap_mean_ms": 1000 * sum(gaps) / len(gaps) if gaps else None,
           "gap_p90_ms": 1000 * p90(gaps) if gaps else None,
           "tools_ms_per_gap": 1000 * tools_s / len(gaps) if gaps else None,
           "prompt_tokens": sum(len(call[1]) for call in recorder.calls),
           "reusable": reusable_prefix(recorder.calls)}
    if args.profile:
        reset()
        profile = cProfile.Profile()
        profile.enable()
        try:
            asyncio.run(play(task, engine.backend, tokenizer, config, episodes, c, first=first,
                             out=Path(tempfile.mkdtemp(prefix="engine-limit-")) / "rollouts.jsonl"))
        finally:
            profile.disable()
        row["profile"] = profile_split(profile)
    against = ", ".join(f"{mode} replay {r['tok_s']:.0f} tok/s (ratio {r['ratio']:.2f})" for mode, r in replays.items())
    gap = (f"gap between turns {row['gap_mean_ms']:.0f} ms mean, {row['gap_p90_ms']:.0f} ms p90; " if gaps else "")
    print(f"  {LABELS[name]}, concurrency {c}: ours {row['ours']:.0f} tok/s, {against} ({tokens} tokens in "
          f"{len(recorder.calls)} turns, {episodes} episodes, {row['turns_per_episode']:.2f} turns / episode; {gap}"
          f"{row['prompt_tokens']} prompt tokens of which {row['reusable']:.0%} a prefix cache can skip; "
          f"load {os.getloadavg()[0]:.1f})", flush=True)
    return row


def post(url: str, timeout_s: float = 60.0) -> None:
    """An empty POST to ``url``; an HTTP error raises."""
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout_s):
        pass


@contextlib.contextmanager
def open_backend(name: str, model: str, args):
    """The :class:`Engine` of backend ``name``, opened (and closed after)."""
    temperature = args.temperature
    if name == "hf":
        from agent_loop.backends.base import SamplingParams
        from agent_loop.backends.hf import TransformersBackend

        backend = TransformersBackend(model, max_batch_size=max(args.concurrency))

        async def exact(prompt, n, seed, session):  # the session: the episode's kept cache, as the loop's turns use it
            sampling = SamplingParams(max_tokens=n, temperature=temperature, stop_token_ids=[], seed=seed)
            return len((await backend.generate(prompt, sampling, session)).token_ids)

        yield Engine(backend, exact, asyncio.run, lambda: asyncio.run(backend.end_run()))
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

            async def exact(prompt, n, seed, session):  # on the engine's own loop: vLLM's AsyncLLM, no hop, no loop
                params = VLLMSamplingParams(max_tokens=n, min_tokens=n if args.min_tokens else 0, temperature=temperature, seed=seed,
                                            ignore_eos=True, logprobs=0, detokenize=False,
                                            output_kind=RequestOutputKind.FINAL_ONLY)
                (engine_input,) = engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=prompt)])
                final = None
                async for final in engine.generate(engine_input, params, request_id=f"replay-{next(ids)}"):
                    pass
                return len(final.outputs[0].token_ids)

            def on_engine(coroutine):
                return asyncio.run_coroutine_threadsafe(coroutine, backend._loop).result()

            def reset():
                if not on_engine(engine.reset_prefix_cache()):
                    raise RuntimeError("the engine did not reset its prefix cache")

            yield Engine(backend, exact, on_engine, reset)
    else:
        import aiohttp

        from agent_loop.backends.openai_http import OpenAIHTTPBackend

        with agent_loop_serve(model, args.threads, Path(tempfile.gettempdir()) / "engine-limit-serve.log") as url:
            backend = OpenAIHTTPBackend([url], "policy")

            pooled = {}

            async def exact(prompt, n, seed, session):
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

            # agent-loop serve runs vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1), /reset_prefix_cache among them
            yield Engine(backend, exact, lambda coroutine: asyncio.run(with_session(coroutine)),
                         lambda: post(f"{url}/reset_prefix_cache"))


def cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[dict], replays=("episodes",)) -> None:
    print("| " + " | ".join(columns(replays)) + " |")
    print("|" + "---|" * len(columns(replays)))
    for r in rows:
        main, others, engine = r["cpu"]
        against = "".join(f"{r['replays'][m]['tok_s']:.0f} | {r['replays'][m]['ratio']:.2f} | " for m in replays)
        print(f"| {r['backend']} | {r['concurrency']} | {r['episodes']} | {r['turns_per_episode']:.2f} | {r['tokens']} | "
              f"{against}{r['ours']:.0f} | {r['busy']:.2f} | {r['in_flight']:.2f} | {r['below']:.2f} | {main:.2f} | "
              f"{others:.2f} | {engine:.2f} | {r['idle_cores']:.2f} |")
    print("\nBetween turns in the loop run (gap: a request's end to its episode's next request's start), and how full "
          "the engine's batch was, ours against each replay:\n")
    print("| " + " | ".join(gap_columns(replays)) + " |")
    print("|" + "---|" * len(gap_columns(replays)))
    for r in rows:
        print(f"| {r['backend']} | {r['concurrency']} | {r['turns_per_episode']:.2f} | {r['gaps']} | "
              f"{cell(r['gap_mean_ms'], '.1f')} | {cell(r['gap_p90_ms'], '.1f')} | {cell(r['tools_ms_per_gap'], '.1f')} | "
              f"{r['in_flight']:.2f} | " + "".join(f"{r['replays'][m]['in_flight']:.2f} | " for m in replays)
              + f"{r['below']:.2f} | " + "".join(f"{r['replays'][m]['below']:.2f} | " for m in replays).rstrip())
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
    parser.add_argument("--max-turns", type=int, default=None,
                        help="assistant turns per episode at most (default: LoopConfig's); the table's turns / episode "
                             "says how many the episodes played")
    parser.add_argument("--replay", nargs="+", choices=REPLAYS, default=["episodes"],
                        help="how the engine replays the recorded requests, one or more on the same recording: "
                             "episodes (c episodes in flight, each one's turns in order) or turns (every episode's "
                             "turn k, c at once, all ended before any turn k+1); the first is the row's engine/ratio")
    parser.add_argument("--reset-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="empty the engine's prefix cache (transformers: kept caches) before the loop run and "
                             "before each replay, so none reuses what an earlier run of the same prompts computed")
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
    args.replay = list(dict.fromkeys(args.replay))  # each replay once, in the order asked
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
    config = LoopConfig(temperature=args.temperature, **({"max_tokens": args.max_tokens} if args.max_tokens else {}),
                        **({"max_turns": args.max_turns} if args.max_turns else {}))
    clock, rows, failed = CpuClock(), [], []
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for name in args.backends:
        print(f"{LABELS[name]}:", flush=True)
        try:
            with open_backend(name, model, args) as engine:
                asyncio.run(play(task, engine.backend, tokenizer, config, 4, 4, first=10**6,
                                 out=Path(tempfile.mkdtemp(prefix="engine-limit-")) / "warm.jsonl"))  # warm-up
                for c in args.concurrency:
                    rows.append(measure_level(name, engine, task, tokenizer, config, args, c, 0, clock, cores))
        except Exception as error:  # one backend that cannot run here must not lose the others' numbers
            failed.append(f"{LABELS[name]}: failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}")
            print(failed[-1], flush=True)
    print(f"\nmodel {model}, task {args.task}, temperature {args.temperature}, max_tokens {config.max_tokens}, "
          f"max_turns {config.max_turns}, replays {' '.join(args.replay)}, prefix cache reset before each run: "
          f"{'yes' if args.reset_cache else 'no'}, {args.threads} bound core(s) of {cores}, load average at end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print_table(rows, args.replay)
    if failed:
        print("\n" + "\n".join(failed))
    return rows


if __name__ == "__main__":  # vLLM starts worker processes
    main()
