"""The transformers backend's static batches as they were before continuous batching (agent_loop/backends/hf.py
until 2026-12-06): requests that arrive while a batch decodes wait for the whole batch, the batch runs until its
longest row ends, and every turn is prefilled from scratch. The baseline of benchmarks/real_model_rollout.py's
``hf-static`` and the reference of tests/backends/test_hf_continuous.py; only the batching differs (each step's
tokens are drawn and recorded by the backend's own ``_sample``)."""

from __future__ import annotations

import asyncio

import torch
from transformers import DynamicCache

from agent_loop.backends.base import GenerationResult, SamplingParams
from agent_loop.backends.hf import TransformersBackend


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
                tokens = self._sample([batch[row] for row in active], [generators[row] for row in active],
                                      out.logits[active, -1, :].float())  # drawn and recorded as the backend does
                next_ids = torch.full((len(batch),), self.pad_token_id, dtype=torch.long, device=self.device)
                next_ids[active] = tokens
                if all(r.finish_reason is not None for r in batch):
                    break
                step_ids = next_ids.unsqueeze(1)
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
