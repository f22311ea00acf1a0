"""transformers backend: continuous batching over a local causal LM, each episode's KV cache kept between its turns.

One decode thread serves every request, from whatever event loop it comes. Between two decode steps it admits
the requests waiting (at most ``max_batch_size`` rows decode together; requests issued in the same event-loop
tick are admitted together), so a request never waits for the longest row of a batch:

- **Kept caches.** A finished request's keys and values (its prompt and its sampled tokens but the last, which was
  never fed) are kept under its ``session_id`` (one per episode: ``agent_loop.types.episode_session_id``). If the
  session's next prompt extends exactly those tokens, only its new tokens are prefilled, on top of them; any other
  prompt is prefilled from scratch. Kept caches are bounded (``kept_cache_bytes``, the least recently used
  session dropped first) and all dropped by a weight update (they hold the old weights' keys) and by ``end_run``.
- **Joining.** A request is prefilled alone (one row, no padding: the same computation as a request decoded
  alone), samples its first token, then joins the running batch: the shorter cache is left-padded along time,
  with attention mask 0 on the padding; position ids count a row's real tokens (the mask's cumsum), as if alone.
  Each decode step feeds every row its last sampled token ``(b, 1)`` and samples the next; a finished row leaves
  the batch at once and the columns no remaining row needs are cut.

Weights change only between requests: ``update_weights`` stops admissions, waits for the running rows to finish,
then loads under ``weights_lock`` (which every step holds) and drops the kept caches.

Sampling is done here (not by ``model.generate``) so that each request has its own seeded generator, its own stop
tokens and ``max_tokens``, and its sampled tokens' logprobs come back without a second forward pass. What is and
is not bit-identical to a request decoded alone: :class:`TransformersBackend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from agent_loop.backends.base import Backend, BackendSettings, GenerationResult, SamplingParams

KEPT_CACHE_BYTES = 1 << 30  # default bound of the kept caches: 1 GiB (SmolLM2-135M: 46 KB a token, ~23k tokens)

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (b, heads, t, head_dim)


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    session_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False  # the caller gave up (set on its event loop, read by the decode thread)


@dataclass
class _Kept:
    """A session's kept cache: ``layers`` (1, heads, t, head_dim) hold the keys and values of ``ids`` (t tokens)."""

    ids: list[int]
    layers: Layers
    nbytes: int


class _KeptCaches:
    """The sessions' kept caches, least recently used first; safe to use from any thread. ``nbytes``: their size."""

    def __init__(self):
        self._lock = threading.Lock()
        self._caches: OrderedDict[str, _Kept] = OrderedDict()
        self.nbytes = 0

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._caches)

    def take(self, request: _Request) -> _Kept | None:
        """The session's kept cache if ``request``'s prompt strictly extends its tokens (it leaves the store: the
        request's own cache replaces it when it ends); else None, and a cache that does not fit is dropped."""
        if request.session_id is None:
            return None
        with self._lock:
            kept = self._caches.pop(request.session_id, None)
            if kept is not None:
                self.nbytes -= kept.nbytes
        prompt = request.prompt_ids
        if kept is None or len(kept.ids) >= len(prompt) or prompt[: len(kept.ids)] != kept.ids:
            return None
        return kept

    def keep(self, request: _Request, layers: Layers, limit: int) -> int:
        """Keep a copy of ``layers`` (1, heads, t, head_dim), the keys and values of ``request``'s prompt and its
        tokens but the last, for its session's next turn; drop the least recently used sessions beyond ``limit``
        bytes (0: keep nothing). Returns how many sessions were dropped."""
        if limit <= 0 or request.session_id is None or request.cancelled:
            return 0
        ids = request.prompt_ids + request.token_ids[:-1]
        if layers[0][0].shape[2] != len(ids):  # the rows' bookkeeping is wrong: never reuse such a cache
            raise RuntimeError(f"kept cache of {layers[0][0].shape[2]} positions for {len(ids)} tokens")
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > limit:
            return 0
        layers = [(k.clone(), v.clone()) for k, v in layers]  # its own memory, not a view of the batch's buffers
        evicted = 0
        with self._lock:
            old = self._caches.pop(request.session_id, None)
            self.nbytes += nbytes - (old.nbytes if old is not None else 0)
            self._caches[request.session_id] = _Kept(ids, layers, nbytes)
            while self.nbytes > limit:
                _, dropped = self._caches.popitem(last=False)
                self.nbytes -= dropped.nbytes
                evicted += 1
        return evicted

    def clear(self) -> None:
        with self._lock:
            self._caches.clear()
            self.nbytes = 0


@dataclass
class _Batch:
    """The rows decoding together. ``lengths[r]``: tokens in row r's cache, its last ``lengths[r]`` columns (no
    holes: rows are left-padded only); ``attention`` (b, T) marks them; ``pending`` (b,) is each row's last sampled
    token, not yet in the cache; ``cache`` holds (b, heads, T, head_dim) keys and values per layer (None: no rows).
    The same cache object grows across decode steps; it is rebuilt only when rows leave or join."""

    requests: list[_Request] = field(default_factory=list)
    generators: list[torch.Generator] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    attention: torch.Tensor | None = None
    pending: torch.Tensor | None = None

    def decode(self, model) -> torch.Tensor:
        """Feed every row its pending token (b, 1) through ``model`` (the cache grows in place); returns the logits
        of each row's next token (b, v), float32. The caller samples them into ``pending``."""
        attention = torch.cat([self.attention, torch.ones_like(self.attention[:, :1])], dim=1)  # (b, T + 1)
        position_ids = attention.sum(-1, keepdim=True) - 1  # (b, 1): the row's own position, padding not counted
        out = model(input_ids=self.pending[:, None], attention_mask=attention, position_ids=position_ids,
                    past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.attention = attention
        self.lengths = [length + 1 for length in self.lengths]
        return out.logits[:, -1, :].float()

    def row_cache(self, row: int) -> Layers:
        """Row ``row``'s cache, (1, heads, lengths[row], head_dim) per layer: views of its own columns."""
        start = self.attention.shape[1] - self.lengths[row]
        return [(k[row : row + 1, :, start:], v[row : row + 1, :, start:]) for k, v in _layers_of(self.cache)]

    def drop(self, rows: list[int]) -> None:
        """Take ``rows`` out of the batch and cut the columns that only they needed."""
        if not rows:
            return
        leaving = set(rows)
        keep = [r for r in range(len(self.requests)) if r not in leaving]
        self.requests = [self.requests[r] for r in keep]
        self.generators = [self.generators[r] for r in keep]
        self.lengths = [self.lengths[r] for r in keep]
        if not keep:
            self.cache = self.attention = self.pending = None
            return
        width, index = max(self.lengths), torch.tensor(keep, device=self.attention.device)
        self.cache = _cache_of([(k[index, :, k.shape[2] - width :], v[index, :, v.shape[2] - width :])
                                for k, v in _layers_of(self.cache)])
        self.attention = self.attention[index, self.attention.shape[1] - width :]
        self.pending = self.pending[index]

    def join(self, joining: list[tuple[_Request, torch.Generator, Layers]], device: torch.device) -> None:
        """Merge prefilled rows (each with its generator and its cache (1, heads, len(prompt), head_dim) per layer,
        on ``device``) into the batch: every cache left-padded to the longest along time."""
        lengths = self.lengths + [len(request.prompt_ids) for request, _, _ in joining]
        width = max(lengths)
        parts = ([_pad_left(_layers_of(self.cache), width)] if self.cache is not None else []) + [
            _pad_left(layers, width) for _, _, layers in joining]
        self.cache = _cache_of([(torch.cat([part[i][0] for part in parts]), torch.cat([part[i][1] for part in parts]))
                                for i in range(len(parts[0]))])
        self.attention = _left_mask(lengths, width, device)
        pending = [torch.tensor([request.token_ids[-1]], device=device) for request, _, _ in joining]
        self.pending = torch.cat(([self.pending] if self.pending is not None else []) + pending)
        self.requests = self.requests + [request for request, _, _ in joining]
        self.generators = self.generators + [generator for _, generator, _ in joining]
        self.lengths = lengths


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k / top-p (nucleus) filtering of one row of logits (v,), as in HF's warpers."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class _GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with room to grow along time: a decode step
    writes its token in place, where ``DynamicLayer`` copies the whole layer (``torch.cat``: every layer's keys
    and values of every row, at every step). Full buffers grow by a quarter (at least ``ROOM`` positions, at least
    what is written); the views are what attention reads, as before."""

    ROOM = 64

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.length = keys.shape[2]
        self.key_buffer, self.value_buffer = self._with_room(keys), self._with_room(values)
        self._views()

    def _with_room(self, states: torch.Tensor, needed: int = 0) -> torch.Tensor:
        """(b, heads, t, head_dim) copied into a buffer of t + max(needed, room) positions."""
        b, heads, t, dim = states.shape
        buffer = states.new_empty((b, heads, t + max(needed, self.ROOM, t // 4), dim))
        buffer[:, :, :t] = states
        return buffer

    def _views(self) -> None:
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[2]
        if self.length + new > self.key_buffer.shape[2]:
            self.key_buffer, self.value_buffer = self._with_room(self.keys, new), self._with_room(self.values, new)
        self.key_buffer[:, :, self.length : self.length + new] = key_states
        self.value_buffer[:, :, self.length : self.length + new] = value_states
        self.length += new
        self._views()
        return self.keys, self.values


def _cache_of(layers: Layers | None) -> DynamicCache:
    """A ``DynamicCache`` over ``layers`` (copied into :class:`_GrowingLayer` buffers; empty for None)."""
    cache = DynamicCache()
    if layers is not None:
        cache.layers = [_GrowingLayer(keys, values) for keys, values in layers]
    return cache


def _layers_of(cache: DynamicCache) -> Layers:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(layers: Layers, length: int) -> Layers:
    """Each (b, heads, t, head_dim) tensor left-padded with zeros along time to ``length``."""
    return [(F.pad(k, (0, 0, length - k.shape[2], 0)), F.pad(v, (0, 0, length - v.shape[2], 0))) for k, v in layers]


def _left_mask(lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """(b, width) long attention mask: 1 on each row's last ``lengths[r]`` columns, 0 on its left padding."""
    starts = width - torch.tensor(lengths, device=device)
    return (torch.arange(width, device=device)[None, :] >= starts[:, None]).long()


def _deliver(request: _Request, result: GenerationResult | None, error: BaseException | None) -> None:
    """Settle ``request``'s future on its own event loop (from the decode thread); nothing if that loop is gone."""
    def settle() -> None:
        if not request.future.done():  # a caller that cancelled (e.g. a closed producer) gets nothing
            request.future.set_exception(error) if error is not None else request.future.set_result(result)

    try:
        request.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # its event loop has closed: nobody waits for it any more
        pass


class _DecodeThread:
    """The requests waiting to decode, and the one thread that decodes them.

    ``submit`` queues a request from its event loop; the requests of one event-loop tick reach the thread together.
    Between two steps the thread admits the requests waiting (at most ``max_batch_size`` rows decode together;
    none while a weight update is :meth:`paused`) and calls ``step(batch, admitted)`` under ``weights_lock``, in
    inference mode. A step that raises delivers its error to every request of the batch and to those admitted, and
    the batch starts empty. The thread ends once no request runs or waits; the next request starts another.
    """

    def __init__(self, step: Callable[[_Batch, list[_Request]], None], weights_lock: threading.Lock,
                 max_batch_size: int):
        self.step = step
        self.weights_lock = weights_lock
        self.max_batch_size = max_batch_size
        self.state = threading.Condition()  # guards everything below; the decode thread waits on it
        self.incoming: list[_Request] = []  # issued in this event-loop tick, not yet visible to the decode thread
        self.queue: list[_Request] = []  # waiting for admission
        self.running = 0  # rows in the batch after the last step
        self.swaps_waiting = 0  # weight updates waiting for the running rows to finish
        self.thread: threading.Thread | None = None

    def submit(self, request: _Request) -> None:
        with self.state:
            self.incoming.append(request)
        request.loop.call_soon(self._hand_over)  # after the other requests of this tick: they are admitted together

    @contextlib.contextmanager
    def paused(self):
        """No request is admitted inside the block, which starts once the running rows have finished."""
        with self.state:
            self.swaps_waiting += 1
            self.state.wait_for(lambda: self.running == 0)
        try:
            yield
        finally:
            with self.state:
                self.swaps_waiting -= 1
                self.state.notify_all()

    def _hand_over(self) -> None:
        """Make the requests issued so far visible to the decode thread; start it if it is not running."""
        with self.state:
            if not self.incoming:
                return
            self.queue.extend(self.incoming)
            self.incoming.clear()
            self.state.notify_all()
            if self.thread is None:
                # not a daemon: the interpreter's exit waits for its step (it ends once no request is left, and a
                # cancelled one leaves at the next step); a daemon still computing while the interpreter tears
                # torch down aborted a stopped train ("terminate called without an active exception")
                self.thread = threading.Thread(target=self._serve, name="hf-decode")
                self.thread.start()

    def _serve(self) -> None:
        """Admit, step, deliver, until no request is running or waiting (then the thread ends)."""
        batch = _Batch()
        while True:
            admitted = self._admissions(len(batch.requests))
            if admitted is None:
                return
            try:
                with self.weights_lock, torch.inference_mode():
                    self.step(batch, admitted)
            except Exception as error:  # surface to every caller in the batch; the loop maps it to finish "error"
                for request in batch.requests + admitted:
                    _deliver(request, None, error)
                batch = _Batch()
            with self.state:
                self.running = len(batch.requests)
                self.state.notify_all()

    def _admissions(self, running: int) -> list[_Request] | None:
        """The requests to admit now (none while a weight update waits, none past ``max_batch_size``); None: nothing
        runs or waits, the thread ends."""
        with self.state:
            while True:
                self.queue = [r for r in self.queue if not r.loop.is_closed()]  # cancelled: leave after a step
                room = self.max_batch_size - running
                if self.queue and room > 0 and not self.swaps_waiting:
                    admitted, self.queue = self.queue[:room], self.queue[room:]
                    self.running = running + len(admitted)  # from now on a weight update waits for them
                    return admitted
                if running:
                    return []
                if not self.queue:
                    self.thread = None
                    return None
                self.state.wait()  # a weight update is under way


class TransformersBackend(Backend):
    """``Backend`` over a local causal LM (CPU and float32 by default; ``device="cuda"``, ``dtype=torch.bfloat16``
    on a GPU; ``update_weights`` casts the pushed weights to ``dtype``).

    Logprobs are those of the model's own distribution (temperature 1, before top-k/top-p), which is
    what vLLM returns by default (``raw_logprobs``) and what the trainer recomputes.

    Exactness. Each request has its own generator, seeded at admission and drawn once per sampled token, so its
    draws depend only on its seed and its logits. A request decoded alone with no kept cache runs the same
    operations as the static batches this backend ran before continuous batching (one row prefilled, then
    ``(1, 1)`` steps): the same tokens and logprobs, bit for bit (tests/backends/test_hf_continuous.py). In a
    batch with others, or on top of a kept cache, its logits can differ in the last float32 bits: matmuls over b
    rows, attention over padded columns and an earlier turn's keys computed step by step round differently from
    one row's (as a static batch's rows always did; at most 4e-6 in the tiny agent's logprobs, 48 sampled
    episodes). A draw that such a difference flips can differ, so sampled tokens cannot be promised identical to
    the static batches' (on those 48 episodes at concurrency 1 and 12 every token was the same).

    Metrics: ``batch_sizes`` gets one entry per admission, the rows decoding together once the admitted joined (a
    static batch's size before; a request that joins a running batch of 1 appends 2). ``stats``: ``decode_steps``
    (batched decode forwards), ``prefilled_tokens`` (tokens run through the model in prefills) and
    ``reused_tokens`` (prompt tokens taken from kept caches instead), ``evicted_sessions`` (kept caches dropped
    for the bound).
    """

    def __init__(self, model, device: str | torch.device = "cpu", max_batch_size: int = 64, pad_token_id: int = 0,
                 dtype: torch.dtype = torch.float32, kept_cache_bytes: int = KEPT_CACHE_BYTES):
        if isinstance(model, str) or hasattr(model, "__fspath__"):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model = model.to(device=device, dtype=dtype).eval()
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id  # unused since rows are never padded with tokens; kept for from_settings
        self.kept_cache_bytes = kept_cache_bytes
        self.weights_lock = threading.Lock()  # held by every decode step; update_weights takes it to swap weights
        self.batch_sizes: list[int] = []  # rows decoding together after each admission, for metrics and tests
        self.stats = {"decode_steps": 0, "prefilled_tokens": 0, "reused_tokens": 0, "evicted_sessions": 0}
        self._kept = _KeptCaches()
        self._decode_thread = _DecodeThread(self._step, self.weights_lock, max_batch_size)

    @classmethod
    def from_settings(cls, model, settings: BackendSettings) -> "TransformersBackend":
        return cls(model, device=settings.device, dtype=getattr(torch, settings.dtype or "float32"),
                   max_batch_size=settings.max_batch_size, pad_token_id=settings.pad_token_id)

    @property
    def context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (positions beyond it are not trained, or not there at all)."""
        config = getattr(self.model, "config", None)
        value = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
        return value if isinstance(value, int) and value > 0 else None

    @property
    def kept_sessions(self) -> list[str]:
        """The sessions whose cache is kept, least recently used first."""
        return self._kept.sessions()

    @property
    def kept_bytes(self) -> int:
        return self._kept.nbytes

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new policy weights (the trainer's push after each step). No request is admitted meanwhile; the
        running rows finish on the old weights first; the kept caches (old weights' keys) are dropped."""
        with self._decode_thread.paused(), self.weights_lock, torch.no_grad():
            self.model.load_state_dict(state_dict)
            self._kept.clear()

    async def end_run(self) -> None:
        """A run of rollouts ended: its episodes' kept caches are of no further use."""
        self._kept.clear()

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), sampling, loop.create_future(), loop, session_id)
        request.future.add_done_callback(lambda future: setattr(request, "cancelled", future.cancelled()))
        self._decode_thread.submit(request)
        return await request.future

    def _step(self, batch: _Batch, admitted: list[_Request]) -> None:
        """One decode step of the running rows, then the admitted requests prefilled and joined (the decode thread
        runs it under ``weights_lock``); the requests that end are delivered and their caches kept."""
        batch.drop([r for r, request in enumerate(batch.requests)
                    if request.cancelled or request.loop.is_closed()])  # nobody waits for these
        if batch.requests:
            logits = batch.decode(self.model)
            self.stats["decode_steps"] += 1
            batch.pending = self._sample(batch.requests, batch.generators, logits)
            done = [r for r, request in enumerate(batch.requests) if request.finish_reason is not None]
            self._retire([(batch.requests[r], batch.row_cache(r)) for r in done])
            batch.drop(done)
        joining = [self._prefill(request) for request in admitted]
        self._retire([(request, layers) for request, _, layers in joining
                      if request.finish_reason is not None])  # its first token ended it
        joining = [row for row in joining if row[0].finish_reason is None]
        if joining:
            batch.join(joining, self.device)
        if admitted:
            self.batch_sizes.append(len(batch.requests))

    def _prefill(self, request: _Request) -> tuple[_Request, torch.Generator, Layers]:
        """Run ``request``'s prompt as one row on top of its session's kept cache (if its prompt extends it) and
        sample its first token. Returns the request, its generator and its cache (1, heads, len(prompt), head_dim)."""
        generator = torch.Generator(device=self.device)  # on the model's device: the draws stay there
        generator.manual_seed(request.sampling.seed if request.sampling.seed is not None else torch.seed())
        kept = self._kept.take(request)
        reused = len(kept.ids) if kept is not None else 0
        new = request.prompt_ids[reused:]  # at least one token: a kept cache is a strict prefix
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)
        attention = torch.ones((1, len(request.prompt_ids)), dtype=torch.long, device=self.device)
        position_ids = torch.arange(reused, len(request.prompt_ids), device=self.device)[None, :]
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                         past_key_values=_cache_of(kept.layers if kept is not None else None), use_cache=True,
                         logits_to_keep=1)  # the last position only: a prompt's (p, vocab) logits would be GiBs
        self.stats["prefilled_tokens"] += len(new)
        self.stats["reused_tokens"] += reused
        self._sample([request], [generator], out.logits[:, -1, :].float())
        return request, generator, _layers_of(out.past_key_values)

    def _sample(self, requests: list[_Request], generators: list[torch.Generator], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row of ``logits`` (b, v) and record it, its logprob and any finish. Returns the
        tokens (b,) on the model's device."""
        tokens = sample_tokens(logits, [r.sampling for r in requests], generators)
        chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
        token_list, chosen_list = tokens.tolist(), chosen.tolist()  # the one host transfer of a decode step
        if -1 in token_list:
            raise RuntimeError("probability tensor contains either inf or nan (the model's logits)")
        for request, token, logprob in zip(requests, token_list, chosen_list):
            request.token_ids.append(token)
            request.logprobs.append(logprob)
            if token in request.sampling.stop_token_ids:
                request.finish_reason = "stop"
            elif len(request.token_ids) >= request.sampling.max_tokens:
                request.finish_reason = "length"
        return tokens.to(self.device)

    def _retire(self, finished: list[tuple[_Request, Layers]]) -> None:
        """Keep the ended requests' caches (each (1, heads, t, head_dim) per layer) and deliver their results."""
        for request, layers in finished:
            self.stats["evicted_sessions"] += self._kept.keep(request, layers, self.kept_cache_bytes)
            _deliver(request, GenerationResult(request.token_ids, request.logprobs, request.finish_reason), None)


def sample_tokens(logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator], *,
                  batched: bool | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (b, v), float32 on the model's device: argmax where the row's temperature is
    0, else a draw from softmax(filtered logits / temperature) with the row's own generator (on that device).
    Returns (b,) long on the same device; -1 marks a sampled row whose probabilities are not finite (the caller
    raises after its one transfer of the tokens, as ``torch.multinomial`` raises on the CPU).

    On the CPU each row is drawn whole in turn (``torch.multinomial``): a row stays in the cache through its
    softmax, draw, division and argmax, which batch-wide passes over (b, v) would not (benchmarks/hf_sampling.py).
    On a GPU the batch is drawn at once (:func:`draw_batch`), so no row leaves the device: the loop it replaced
    copied every decode step's logits to the host and sampled there. ``batched`` picks the path (default: by the
    device); both give the same tokens from the same generators.
    """
    if not (logits.device.type != "cpu" if batched is None else batched):
        return torch.tensor([_draw_row(logits[row], params, generator)
                             for row, (params, generator) in enumerate(zip(sampling, generators))], dtype=torch.long)
    sampled = [params.temperature > 0 for params in sampling]  # on the host: no sync to read them
    divisor = torch.tensor([params.temperature if row else 1.0 for params, row in zip(sampling, sampled)],
                           device=logits.device)
    scaled = logits / divisor[:, None]
    for row, params in enumerate(sampling):  # top-k / top-p: rows that ask for it (off by default)
        if sampled[row] and (params.top_k > 0 or params.top_p < 1.0):
            scaled[row] = _filter_logits(scaled[row], params.top_k, params.top_p)
    drawn = draw_batch(torch.softmax(scaled, dim=-1), sampled, generators)
    if all(sampled):
        return drawn
    return torch.where(torch.tensor(sampled, device=logits.device), drawn, torch.argmax(logits, dim=-1))


def _draw_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    filtered = _filter_logits(logits / params.temperature, params.top_k, params.top_p)
    return int(torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator))


def draw_batch(probs: torch.Tensor, sampled: list[bool], generators: list[torch.Generator]) -> torch.Tensor:
    """``torch.multinomial(probs[r], 1, generator=generators[r])`` for every row ``r`` where ``sampled[r]``, at
    once: multinomial's own one-sample draw, ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn from the row's generator
    over the row, so the tokens are the same (tests/backends/test_hf_backend.py). Only ``q`` is drawn row by row.
    A row that is not finite gives -1 (its argmax is a NaN). ``probs`` (b, v) is overwritten."""
    noise = torch.ones_like(probs)
    for row, generator in enumerate(generators):
        if sampled[row]:
            noise[row].exponential_(generator=generator)
    ratio = probs.div_(noise)
    drawn = torch.argmax(ratio, dim=-1)  # a NaN anywhere in a row is its argmax
    invalid = ratio.gather(1, drawn[:, None]).squeeze(1).isnan() & torch.tensor(sampled, device=probs.device)
    return torch.where(invalid, -1, drawn)
