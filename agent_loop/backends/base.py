"""The backend contract: token ids in, sampled token ids and their sampling logprobs out (docs/design.md section 6).

A backend subclasses :class:`Backend`: ``generate`` is the one method it must write; the rest of its
lifecycle has defaults. A new backend is one module with one such class (``from_settings`` builds it
from the options every command shares) plus one line in :data:`agent_loop.backends.registry.BACKENDS`.
The servers' options of every command that plays episodes over HTTP are
:class:`agent_loop.backends.server_options.ServerOptions`.
"""

from __future__ import annotations

import abc
import asyncio
import math
from dataclasses import dataclass, field
from typing import NamedTuple

RETRY_DEADLINE_S = 300.0  # the whole wait of one request: longer than a server restart
REQUEST_TIMEOUT_S = 600.0  # one attempt


@dataclass
class SamplingParams:
    """Per-request sampling settings shared by every backend."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


class GenerationResult(NamedTuple):
    """What a backend returns for one request: the sampled ids, their sampling logprobs, and why it stopped.

    finish_reason is "stop" (a stop token was sampled; it is the last id) or "length" (max_tokens reached).
    policy_version: the version of the weights that sampled every token of it, when the backend knows it
    (``agent_loop.runners.producer.VersionedBackend``: weights change between requests, never during one).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int | None = None


class FatalBackendError(RuntimeError):
    """A failure that stops the whole run instead of ending one episode (e.g. every server down for longer
    than the retry deadline): the runners cancel the rest and re-raise it; finished episodes stay written."""


@dataclass
class BackendSettings:
    """What :func:`agent_loop.backends.registry.make_backend` passes every backend; each reads its own fields."""

    servers: list[str] = field(default_factory=list)  # http: server root URLs
    served_model_name: str | None = None  # http: the name the servers serve (default: the model path)
    retry_deadline_s: float = RETRY_DEADLINE_S  # http: the whole wait of one request (all its attempts)
    request_timeout_s: float = REQUEST_TIMEOUT_S  # http: one attempt
    device: str = "cpu"  # hf
    dtype: str | None = None  # hf and vllm: a torch dtype name; None: the backend's own (hf: float32; vllm: float32
    # on a CPU, vLLM's default on a GPU)
    max_batch_size: int = 64  # hf: requests decoded together
    pad_token_id: int = 0  # hf
    threads: int | None = None  # vllm on CPU: the cores its threads are bound to (None: agent_loop.threads' rule)
    engine_log: str | None = None  # vllm: the file its engine's logs go to (None: the terminal; vllm_engine.engine_log)
    lora_rank: int = 0  # vllm: serve one LoRA adapter of up to this rank, pushed by the trainer (0: none)

    @classmethod
    def from_options(cls, options, **overrides) -> "BackendSettings":
        """The http backend's settings from a command's ``ServerOptions`` (those fields only: a command's
        other options, such as train's ``device``, never reach a backend unasked), then ``overrides``."""
        return cls(**{"servers": list(options.server), "served_model_name": options.served_model_name,
                      "retry_deadline_s": options.retry_deadline_s, "request_timeout_s": options.request_timeout_s,
                      **overrides})


class Backend(abc.ABC):
    """Token-in, token-out generation; safe to call concurrently from many asyncio tasks.

    Lifecycle: :meth:`generate` for each request; :meth:`end_run` when a run of rollouts (one event
    loop) ends; :meth:`update_weights` between runs (a trainer's push); :meth:`close` once, for good
    (also on leaving a ``with`` or ``async with`` block).
    """

    retries_itself: bool = False  # True: the agent loop adds no retries of its own (LoopConfig.backend_retries)

    @classmethod
    def from_settings(cls, model, settings: BackendSettings) -> "Backend":
        """The backend over ``model`` (a folder, or for in-process backends a loaded model)."""
        raise NotImplementedError(f"{cls.__name__} cannot be made by name (give the object itself)")

    @abc.abstractmethod
    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        """One continuation of ``prompt_ids``. ``session_id`` names the episode a request belongs to (the same
        for all its turns), so a backend over several servers can keep an episode on one server and reuse its
        prefix cache."""

    @property
    def context_length(self) -> int | None:
        """The most tokens (prompt and completion) one request may hold, when the backend knows it (vLLM's
        ``max_model_len``, the model's ``max_position_embeddings``); None: unknown."""
        return None

    def describe(self, session_id: str | None = None) -> str:
        """Who answered ``session_id``'s last request, for error messages (a server URL for the http backend)."""
        return type(self).__name__

    def update_weights(self, state_dict: dict) -> None:
        """Generate with these weights from now on (between runs); raise if they did not take."""
        raise NotImplementedError(f"{type(self).__name__} cannot take new weights")

    async def end_run(self) -> None:
        """Release what is bound to the event loop of the run that just ended (connection pools); the
        backend reopens them on next use. The runners call it at the end of every run."""

    def close(self) -> None:
        """Shut down for good (engine processes, threads); idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.end_run()
        await asyncio.to_thread(self.close)


def check_backend(backend) -> Backend:
    """``backend`` itself, or TypeError saying what a backend is (anything else fails later, less clearly)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"{type(backend).__name__} is not a backend: subclass agent_loop.backends.base.Backend "
                        "(write its generate(prompt_ids, sampling, session_id))")
    return backend


class BadOutputError(ValueError):
    """A backend answered, but with something no episode may keep (ids outside the vocabulary, NaN logprobs)."""


def check_result(result: GenerationResult, sampling: SamplingParams, vocab_size: int | None) -> GenerationResult:
    """``result`` if it is something an episode may keep, else BadOutputError saying what is wrong: at least
    one and at most ``max_tokens`` ids, each in ``[0, vocab_size)``, one finite logprob <= 0 per id, finish
    ``stop`` or ``length``. The one check of every backend's answer (the loop calls it)."""
    ids, logprobs = result.token_ids, result.logprobs
    if not ids or len(ids) > sampling.max_tokens:
        raise BadOutputError(f"returned {len(ids)} token ids for a request of at most {sampling.max_tokens}")
    if not all(type(i) is int for i in ids):  # noqa: E721  (bools and floats are not token ids)
        bad = next(i for i in ids if type(i) is not int)  # noqa: E721
        raise BadOutputError(f"returned a token id that is not an integer: {bad!r}")
    low, high = min(ids), max(ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        raise BadOutputError(f"returned token id {low if low < 0 else high}, outside the vocabulary "
                             f"[0, {vocab_size if vocab_size is not None else 'inf'})")
    if len(logprobs) != len(ids):
        raise BadOutputError(f"returned {len(logprobs)} logprobs for {len(ids)} token ids")
    bad = next((i for i, p in enumerate(logprobs)  # finite and <= 0, with a little slack for float rounding
                if not (isinstance(p, (int, float)) and math.isfinite(p) and p <= 1e-4)), None)
    if bad is not None:
        raise BadOutputError(f"returned logprob {logprobs[bad]!r} for token {bad} (not a finite number <= 0)")
    if result.finish_reason not in ("stop", "length"):
        raise BadOutputError(f"returned finish_reason {result.finish_reason!r} (not 'stop' or 'length')")
    return result


def is_fatal(error: BaseException) -> bool:
    """Whether ``error`` should stop the whole run instead of ending one episode."""
    return isinstance(error, FatalBackendError)
