"""transformers backend: batches concurrent requests from many trajectories into one decode loop.

Requests that arrive while a batch is running wait for the next batch. Sampling is done here (not by
``model.generate``) so that each request has its own seeded generator, its own stop tokens and
``max_tokens``, and its sampled tokens' logprobs come back without a second forward pass.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from agent_loop.backends.base import Backend, BackendSettings, GenerationResult, SamplingParams


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


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


class TransformersBackend(Backend):
    """``Backend`` over a local causal LM (CPU and float32 by default; ``device="cuda"``, ``dtype=torch.bfloat16``
    on a GPU; ``update_weights`` casts the pushed weights to ``dtype``).

    Logprobs are those of the model's own distribution (temperature 1, before top-k/top-p), which is
    what vLLM returns by default (``raw_logprobs``) and what the trainer recomputes.
    """

    def __init__(self, model, device: str | torch.device = "cpu", max_batch_size: int = 64, pad_token_id: int = 0,
                 dtype: torch.dtype = torch.float32):
        if isinstance(model, str) or hasattr(model, "__fspath__"):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model = model.to(device=device, dtype=dtype).eval()
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self._pending: list[_Request] = []
        self._worker: asyncio.Task | None = None
        self.weights_lock = threading.Lock()  # held while a batch decodes; a trainer takes it to swap weights
        self.batch_sizes: list[int] = []  # size of every batch run, for metrics and tests

    @classmethod
    def from_settings(cls, model, settings: BackendSettings) -> "TransformersBackend":
        return cls(model, device=settings.device, dtype=getattr(torch, settings.dtype),
                   max_batch_size=settings.max_batch_size, pad_token_id=settings.pad_token_id)

    @property
    def context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (positions beyond it are not trained, or not there at all)."""
        config = getattr(self.model, "config", None)
        value = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
        return value if isinstance(value, int) and value > 0 else None

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new policy weights (the trainer's push after each step); waits for a running batch."""
        with self.weights_lock, torch.no_grad():
            self.model.load_state_dict(state_dict)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        request = _Request(list(prompt_ids), sampling, asyncio.get_running_loop().create_future())
        self._pending.append(request)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run_batches())
        return await request.future

    async def _run_batches(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # let requests issued in the same tick join this batch
            batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
            try:
                await asyncio.to_thread(self._decode, batch)
            except Exception as error:  # surface to every waiting caller; the loop maps it to finish "error"
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(error)
                continue
            for request in batch:
                if not request.future.done():  # a caller cancelled (e.g. a closed producer): the rest still get theirs
                    request.future.set_result(
                        GenerationResult(request.token_ids, request.logprobs, request.finish_reason)
                    )

    @torch.inference_mode()
    def _decode(self, batch: list[_Request]) -> None:
        with self.weights_lock:
            self.batch_sizes.append(len(batch))
            longest = max(len(r.prompt_ids) for r in batch)
            input_ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)
            attention = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, request in enumerate(batch):  # left padding: every prompt ends at the same column
                input_ids[row, longest - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
                attention[row, longest - len(request.prompt_ids) :] = 1
            generators = []
            for request in batch:  # on the model's device: the draws stay there (no host round trip per row)
                generator = torch.Generator(device=self.device)
                generator.manual_seed(request.sampling.seed if request.sampling.seed is not None else torch.seed())
                generators.append(generator)

            input_ids, attention = input_ids.to(self.device), attention.to(self.device)
            cache = DynamicCache()
            step_ids = input_ids
            for _ in range(max(r.sampling.max_tokens for r in batch)):
                position_ids = (attention.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
                out = self.model(  # logits of the last position only: a prompt's (p, vocab) logits would be GiBs
                    input_ids=step_ids, attention_mask=attention, position_ids=position_ids,
                    past_key_values=cache, use_cache=True, logits_to_keep=1,
                )
                active = [row for row, request in enumerate(batch) if request.finish_reason is None]
                logits = out.logits[active, -1, :].float()
                tokens = sample_tokens(logits, [batch[row].sampling for row in active], [generators[row] for row in active])
                chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
                token_list, chosen_list = tokens.tolist(), chosen.tolist()  # the one host transfer of a decode step
                if -1 in token_list:
                    raise RuntimeError("probability tensor contains either inf or nan (the model's logits)")
                next_ids = torch.full((len(batch),), self.pad_token_id, dtype=torch.long)
                for row, token, logprob in zip(active, token_list, chosen_list):
                    request = batch[row]
                    next_ids[row] = token
                    request.token_ids.append(token)
                    request.logprobs.append(logprob)
                    if token in request.sampling.stop_token_ids:
                        request.finish_reason = "stop"
                    elif len(request.token_ids) >= request.sampling.max_tokens:
                        request.finish_reason = "length"
                if all(r.finish_reason is not None for r in batch):
                    break
                step_ids = next_ids.unsqueeze(1).to(self.device)
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)


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
