"""The policy's view of a batch: per-token logprobs, entropy and (for GAE) values of the response tokens.

The output head runs in pieces of ``LOGITS_CHUNK_TOKENS`` tokens (:func:`chunked_head`): at a real vocabulary
the float32 logits of a whole micro-batch, ``(b, t, v)``, would be the largest tensor of a step (b=8, t=1024,
v=49,152: 1.6 GB, and log-softmax and its gradient as much again). The policy's forward, the old-logprob
recompute and the reference model's logprobs (the KL) all go through it (``PolicyModel``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

from advantages import entropy_from_logits
from agent_loop.training.checkpoint import check_finite
from agent_loop.training.lora import load_adapter_weights, wrap_with_lora
from masking.batch import Batch
from masking.kinds import SpanKind


class ValueHead(nn.Module):
    """A linear critic on the policy's last hidden states (shares the trunk; used by GAE).

    Starts at exactly 0 so the first advantages are the plain returns.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(b, t, h)`` hidden states -> ``(b, t)`` values."""
        return self.linear(hidden).squeeze(-1)


class ResponseInputs(NamedTuple):
    """The batch tensors a forward reads (a ``Batch`` has them too)."""

    prompts: torch.Tensor  # (b, p) left-padded
    input_ids: torch.Tensor  # (b, p + t)
    attention_mask: torch.Tensor  # (b, p + t)
    position_ids: torch.Tensor  # (b, p + t)
    responses: torch.Tensor  # (b, t) right-padded


def shared_prefix_length(batch: Batch | ResponseInputs) -> int:
    """How many leading prompt tokens every row shares (the system prompt with the tool schemas, for
    example), capped at the shortest prompt minus one so that each row's last prompt token is its own.

    ``prompts`` (b, p) are left-padded; ``attention_mask`` (b, p + t) tells where each prompt starts.
    """
    prompts = batch.prompts
    width = prompts.shape[1]
    lengths = batch.attention_mask[:, :width].sum(1)
    shortest = int(lengths.min())
    columns = (width - lengths).unsqueeze(1) + torch.arange(max(shortest - 1, 0), device=prompts.device)
    aligned = prompts.gather(1, columns)  # (b, shortest - 1): each row's prompt, left-aligned
    same = (aligned == aligned[:1]).all(0)
    return int(same.long().cumprod(0).sum())


def response_hidden(model, batch: Batch | ResponseInputs, share_prefix: bool = True) -> torch.Tensor:
    """The decoder's last hidden states ``(b, t, h)`` at the positions that predict each response token.

    ``batch`` holds ``prompts`` (b, p), ``input_ids``, ``attention_mask``, ``position_ids`` (b, p + t)
    and ``responses`` (b, t) as collated (prompts left-padded, responses right-padded).

    With ``share_prefix``, the prompt prefix all rows share runs once (batch 1) and the rest of every
    row attends to its key/value cache; copies of the prefix inside a row's slice are masked out.
    Gradients flow through the cache, so the result and its gradient are those of the plain forward
    (up to float rounding), for a fraction of the work when the shared prefix is long.
    """
    t = batch.responses.shape[1]
    decoder = model.get_decoder()
    prefix = shared_prefix_length(batch) if share_prefix else 0
    if prefix == 0:
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids, use_cache=False).last_hidden_state
    else:
        prompts, attention = batch.prompts, batch.attention_mask
        width = prompts.shape[1]
        lengths = attention[:, :width].sum(1)
        first = width - int(lengths[0])
        cache = decoder(input_ids=prompts[:1, first : first + prefix], use_cache=True).past_key_values
        cache.batch_repeat_interleave(prompts.shape[0])
        start = width - (int(lengths.max()) - prefix)  # the columns holding every row's unshared prompt tokens
        positions = batch.position_ids[:, start:]
        own = attention[:, start:] * (positions >= prefix)  # a row's copy of the shared prefix is masked out
        hidden = decoder(
            input_ids=batch.input_ids[:, start:], position_ids=positions, past_key_values=cache, use_cache=True,
            attention_mask=torch.cat([torch.ones_like(attention[:, :prefix]), own], dim=1),
        ).last_hidden_state
    return hidden[:, -t - 1 : -1]  # position i predicts token i + 1


def response_forward(
    model, batch: Batch | ResponseInputs, value_head: ValueHead | None = None, share_prefix: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits ``(b, t, v)`` float32 predicting each response token (:func:`response_hidden`), and the values
    ``(b, t)`` of the states before them (None without ``value_head``). This holds all the logits at once:
    the trainer uses :func:`chunked_head` instead; this is the plain form it must equal."""
    hidden = response_hidden(model, batch, share_prefix)
    logits = model.get_output_embeddings()(hidden).float()
    values = value_head(hidden).float() if value_head is not None else None
    return logits, values


# Tokens per piece of the output head: a piece's float32 logits are LOGITS_CHUNK_TOKENS x vocabulary x 4 bytes
# (48 MiB at SmolLM2's 49,152 tokens), a few of them alive at once; the whole (b, t, v) never is.
LOGITS_CHUNK_TOKENS = 256


def _head_piece(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, entropy: bool):
    """``(n, h)`` hidden states, ``(n,)`` token ids -> their logprobs ``(n,)`` and entropies ``(n,)`` (or None)."""
    logits = head(hidden).float()
    return token_logprobs(logits, tokens), entropy_from_logits(logits) if entropy else None


def chunked_head(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, *, entropy: bool = True,
                 chunk: int = LOGITS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output head's logprobs of ``tokens`` and (with ``entropy``) its entropies, both ``(b, t)`` float32, from
    ``hidden`` ``(b, t, h)``, computed ``chunk`` tokens at a time, so that no more than one piece's float32
    logits ``(chunk, v)`` exist at once. Exact: the same per-token computation as on the whole ``(b, t, v)``
    logits, the same values to float32 rounding. With gradient, each piece is checkpointed
    (``torch.utils.checkpoint``): backward recomputes its logits instead of keeping them, so the gradient
    (of the hidden states and the head's weights) is also that of the plain computation."""
    b, t, h = hidden.shape
    flat_hidden, flat_tokens = hidden.reshape(b * t, h), tokens.reshape(b * t)
    keep_graph = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    pieces = []
    for start in range(0, b * t, chunk):
        piece = (head, flat_hidden[start : start + chunk], flat_tokens[start : start + chunk], entropy)
        pieces.append(checkpoint(_head_piece, *piece, use_reentrant=False) if keep_graph else _head_piece(*piece))
    if not pieces:  # no response token
        empty = hidden.new_zeros(b, t, dtype=torch.float32)
        return empty, empty.clone() if entropy else None
    logprobs = torch.cat([p[0] for p in pieces]).view(b, t)
    return logprobs, torch.cat([p[1] for p in pieces]).view(b, t) if entropy else None


class PolicyModel(nn.Module):
    """The trainer's whole forward as one module call: the causal LM (and the value head) from batch tensors
    to the per-token logprobs, entropy and values of the response tokens.

    Data-parallel wrappers hook a module's ``forward``: ``DistributedDataParallel`` arms its gradient
    reduction there, and ``fully_shard`` on this root gathers the parameters outside the decoder layers
    (embeddings, final norm, output head, value head) there. ``response_forward`` calls the decoder (twice,
    with the shared-prompt cache) and the head separately, so the policy is wrapped as this module, and
    every forward of the trainer goes through it (agent_loop/training/distributed.py).
    """

    def __init__(self, model, value_head: ValueHead | None = None, share_prefix: bool = True,
                 logits_chunk: int = LOGITS_CHUNK_TOKENS):
        super().__init__()
        self.model = model
        self.value_head = value_head
        self.share_prefix = share_prefix
        self.logits_chunk = logits_chunk  # tokens per piece of the output head (chunked_head)

    def forward(self, prompts, input_ids, attention_mask, position_ids, responses, *, entropy: bool = True):
        """The batch tensors of ``response_forward`` -> ``(logprobs, entropy, values)``, each ``(b, t)`` float32
        (``entropy`` None unless asked for, ``values`` None without a value head)."""
        inputs = ResponseInputs(prompts, input_ids, attention_mask, position_ids, responses)
        hidden = response_hidden(self.model, inputs, self.share_prefix)
        logprobs, entropies = chunked_head(self.model.get_output_embeddings(), hidden, responses, entropy=entropy,
                                           chunk=self.logits_chunk)
        values = self.value_head(hidden).float() if self.value_head is not None else None
        return logprobs, entropies, values


def policy_outputs(model: nn.Module, batch: Batch, *, entropy: bool = True):
    """``(logprobs, entropy, values)`` of ``batch``'s response tokens from a ``PolicyModel`` or its wrapper
    (DDP, fully_shard), called as a module so that the wrapper's hooks run."""
    return model(batch.prompts, batch.input_ids, batch.attention_mask, batch.position_ids, batch.responses,
                 entropy=entropy)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``(b, t, v)`` logits, ``(b, t)`` token ids -> ``(b, t)`` log-probabilities of those tokens."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


RESPONSE_KEYS = ("responses", "spans", "response_mask", "turn_ids", "old_logprobs", "token_level_rewards",
                 "advantages", "returns", "values", "rollout_logprobs", "rollout_is_weights", "loss_mask")
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def micro_batches(batch: Batch, rows: torch.Tensor, size: int, *, shard: tuple[int, int] = (0, 1)):
    """Yield ``(part, micro)``: the rows ``rows`` of ``batch`` in micro-batches of at most ``size`` rows,
    shortest responses first, each cut to its own longest response (less padding through the model).
    ``part`` holds the micro-batch's row numbers in ``batch``.

    ``shard=(rank, world_size)`` yields only the micro-batches ``rank, rank + world_size, ...`` of that
    sequence: data-parallel ranks split the work into the very micro-batches one process would run, so
    every micro-batch's numbers are the same whatever the number of ranks (agent_loop/training/distributed.py). A rank
    with fewer of them than rank 0 then gets the sequence's first micro-batch with ``part`` None, to run
    at zero weight: every rank runs as many forwards and backwards, so that the wrappers' collectives
    (DDP's gradient all-reduce, FSDP's parameter all-gathers) pair up across the ranks."""
    rank, world_size = shard
    lengths = (batch.spans != SpanKind.PAD).sum(1)
    rows = rows[torch.argsort(lengths[rows], stable=True)]
    parts = rows.split(size)
    mine = [(part, part) for part in parts[rank::world_size]]
    mine += [(None, parts[0])] * (-(-len(parts) // world_size) - len(mine))
    for part, taken in mine:
        yield part, _rows(batch, taken, int(lengths[taken].max()))


def _rows(batch: Batch, part: torch.Tensor, t: int) -> Batch:
    """The rows ``part`` of ``batch``, responses cut to ``t`` columns."""
    prompt_width = batch.prompts.shape[1]
    fields = {}
    for name, value in batch.items():
        value = value[part]
        if name in RESPONSE_KEYS:
            value = value[:, :t]
        elif name in SEQUENCE_KEYS:
            value = value[:, : prompt_width + t]
        fields[name] = value
    return Batch(**fields)


@torch.no_grad()
def batch_logprobs(
    model: nn.Module, batch: Batch, micro_batch_size: int, *, values: bool = False, shard: tuple[int, int] = (0, 1),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``(b, t)`` of the ASSISTANT tokens (and, with ``values``, the value head's values ``(b, t)``),
    in micro-batches, without gradient; 0 elsewhere, as the sampler's ``old_logprobs``. ``model`` is a
    ``PolicyModel`` or its wrapper. With ``shard=(rank, world_size)`` only that rank's micro-batches
    (``micro_batches``) are filled in, the other rows are 0."""
    b, t = batch.responses.shape
    device = batch.responses.device
    logprobs = torch.zeros(b, t, device=device)
    values = torch.zeros(b, t, device=device) if values else None
    for part, micro in micro_batches(batch, torch.arange(b, device=device), micro_batch_size, shard=shard):
        micro_logprobs, _, micro_values = policy_outputs(model, micro, entropy=False)
        if part is None:  # a stand-in that keeps the ranks' forwards paired
            continue
        width = micro.responses.shape[1]
        assistant = micro.spans == SpanKind.ASSISTANT
        logprobs[part, :width] = torch.where(assistant, micro_logprobs, 0.0)
        if values is not None:
            values[part, :width] = torch.where(assistant, micro_values, 0.0)
    return logprobs, values


def load_policy(start, *, lora: dict | None, needs_values: bool, reference_dtype: torch.dtype | None, device):
    """The policy to train, its value head and the frozen reference, from a run's :class:`~agent_loop.training.resume.Start`.

    The policy loads from ``start.policy_path`` in float32; ``lora`` (``rank``, ``alpha``, ``target_modules``)
    wraps it in LoRA adapters, a resumed run's loaded from ``start.folder/adapter``; a resumed policy's weights are
    checked finite (NaN weights would pass the load and fail steps later). ``needs_values``: a value head (GAE);
    ``reference_dtype``: the reference (``start.initial_model``) in that dtype, None for no reference (no KL).
    Returns ``(policy, value_head or None, reference PolicyModel or None)``."""
    policy = AutoModelForCausalLM.from_pretrained(start.policy_path, dtype=torch.float32).to(device).train()
    if lora:
        policy = wrap_with_lora(policy, lora["rank"], lora["alpha"], lora["target_modules"])
        if start.state is not None:
            load_adapter_weights(policy, start.folder / "adapter")
    if start.state is not None:
        check_finite(((name, p.detach()) for name, p in policy.named_parameters()), f"checkpoint {start.folder} (its weights)")
    value_head = ValueHead(policy.config.hidden_size).to(device) if needs_values else None
    reference = None
    if reference_dtype is not None:
        frozen = AutoModelForCausalLM.from_pretrained(start.initial_model, dtype=reference_dtype).to(device).eval()
        reference = PolicyModel(frozen.requires_grad_(False))
    return policy, value_head, reference
