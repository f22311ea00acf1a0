"""The transformers backend's static batches as they were before continuous batching (agent_loop/backends/hf.py
until 2026-12-06): requests that arrive while a batch decodes wait for the whole batch, the batch runs until its
longest row ends, and every turn is prefilled from scratch. The baseline of benchmarks/real_model_rollout.py's
``hf-static`` and the reference of tests/backends/test_hf_continuous.py; only ``generate`` differs (sampling is
the backend's own ``sample_tokens``)."""

from __future__ import annotations

import asyncio

import torch
from transformers import DynamicCache

from agent_loop.backends.base import GenerationResult, SamplingParams
from agent_loop.backends.hf import TransformersBackend, sample_tokens


class _Request:
    def __init__(self, prompt_ids: list[int], sampling: SamplingParams, future: asyncio.Future):
        self.prompt_ids, self.sampling, self.future = prompt_ids, sampling, future
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None


class StaticBatchBackend(TransformersBackend):
    """:class:`TransformersBackend` with the old static batches (``batch_sizes``: the size of every batch run)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: list[_Request] = []
        self._worker: asyncio.Task | None = None

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       session_id: str | None = None) -> GenerationResult:
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
                await asyncio.to_thread(self._decode_static, batch)
            except Exception as error:
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(error)
                continue
            for request in batch:
                if not request.future.done():
                    request.future.set_result(
                        GenerationResult(request.token_ids, request.logprobs, request.finish_reason))

    @torch.inference_mode()
    def _decode_static(self, batch: list[_Request]) -> None:
        with self.weights_lock:
            self.batch_sizes.append(len(batch))
            longest = max(len(r.prompt_ids) for r in batch)
            input_ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)
            attention = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, request in enumerate(batch):  # left padding: every prompt ends at the same column
                input_ids[row, longest - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
                attention[row, longest - len(request.prompt_ids) :] = 1
            generators = []
            for request in batch:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(request.sampling.seed if request.sampling.seed is not None else torch.seed())
                generators.append(generator)

            input_ids, attention = input_ids.to(self.device), attention.to(self.device)
            cache = DynamicCache()
            step_ids = input_ids
            for _ in range(max(r.sampling.max_tokens for r in batch)):
                position_ids = (attention.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
                out = self.model(input_ids=step_ids, attention_mask=attention, position_ids=position_ids,
                                 past_key_values=cache, use_cache=True, logits_to_keep=1)
                active = [row for row, request in enumerate(batch) if request.finish_reason is None]
                logits = out.logits[active, -1, :].float()
                tokens = sample_tokens(logits, [batch[row].sampling for row in active],
                                       [generators[row] for row in active])
                chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
                token_list, chosen_list = tokens.tolist(), chosen.tolist()
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
