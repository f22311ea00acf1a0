"""Supervised fine-tuning: the one loop of the warm start (``agent_loop.recipes.warmstart``) and of the tiny agent's
build (``agent_loop.tiny.train``), and the losses they train on.

The loop (:func:`fine_tune`): each step sets the learning rate of its step (``agent_loop.training.optimization.lr_at``,
by the caller's schedule), has the caller's ``step_gradient`` accumulate the step's loss gradient, clips the
gradient norm, steps AdamW and clears the gradients; it returns (and hands ``after_step``) each step's metrics:
``loss``, ``lr``, ``grad_norm``, ``tokens``. What the two trainers differ in is what a step's loss is:

- the warm start: the mean next-token cross-entropy over the ASSISTANT tokens (``spans == ASSISTANT``, the loop's
  response mask, the end-of-turn token included) of a step's rows of a collated :class:`~masking.batch.Batch`,
  run in micro-batches through the trainer's own forward (``agent_loop.training.policy``: the shared prompt prefix
  once), each micro-batch's gradient accumulated as it runs (:func:`step_loss`, :func:`batch_gradient`);
- the tiny agent: fresh right-padded ``(input_ids, labels)`` groups each step, labels ``-100`` off the targets,
  their summed cross-entropy (:func:`labelled_loss`) over the step's target count, one backward for the step
  (:func:`labelled_gradient`; the arithmetic its shipped weights were trained with).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from tqdm.auto import tqdm

import agent_loop.training.optimization as optimization
from agent_loop.training.policy import PolicyModel, micro_batches, policy_outputs
from masking.batch import Batch
from masking.kinds import SpanKind

IGNORE = -100  # a label that gets no loss (transformers' convention)
StepGradient = Callable[[int], tuple[torch.Tensor, float]]  # step -> (its mean loss, detached; its target tokens)


# --- the warm start's loss: ASSISTANT tokens of a collated batch -------------------------------------------


def assistant_mask(batch: Batch) -> torch.Tensor:
    """``(b, t)`` bool: the ASSISTANT tokens (``Batch.response_mask``), every one of which a fine-tune trains on
    (no rollout correction here: nothing like ``Batch.loss_mask`` leaves any out)."""
    return batch.spans == SpanKind.ASSISTANT


def summed_loss(model: PolicyModel, micro: Batch) -> torch.Tensor:
    """The summed next-token cross-entropy of ``micro``'s ASSISTANT tokens (each predicted from every token
    before it, prompt included), a 0-dim tensor with gradient."""
    logprobs, _, _ = policy_outputs(model, micro, entropy=False)
    return -torch.where(assistant_mask(micro), logprobs, 0.0).sum()


def step_loss(model: PolicyModel, batch: Batch, rows: torch.Tensor, micro_batch_size: int, *,
              backward: bool = True) -> torch.Tensor:
    """The mean cross-entropy over the ASSISTANT tokens of ``batch``'s rows ``rows`` (every token weighs the
    same), run in micro-batches; with ``backward``, each micro-batch's share of its gradient is accumulated."""
    tokens = assistant_mask(batch)[rows].sum().clamp(min=1)
    total = torch.zeros((), device=batch.responses.device)
    for _, micro in micro_batches(batch, rows, micro_batch_size):
        loss = summed_loss(model, micro) / tokens
        if backward:
            loss.backward()
        total += loss.detach()
    return total


def row_order(n: int, steps: int, batch_size: int, seed: int) -> torch.Tensor:
    """``(steps, batch_size)`` row numbers: passes over ``n`` rows, each pass in a new random order."""
    generator = torch.Generator().manual_seed(seed)
    passes = -(-steps * batch_size // n)
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(passes)])
    return order[: steps * batch_size].view(steps, batch_size)


def batch_gradient(policy: PolicyModel, batch: Batch, order: torch.Tensor, micro_batch_size: int) -> StepGradient:
    """The step gradient of a fine-tune on ``batch``: step ``s`` trains on the rows ``order[s]``
    (:func:`row_order`) with :func:`step_loss`."""
    def gradient(step: int) -> tuple[torch.Tensor, float]:
        rows = order[step].to(batch.responses.device)
        return step_loss(policy, batch, rows, micro_batch_size), float(assistant_mask(batch)[rows].sum())

    return gradient


# --- the tiny agent's loss: labelled token targets ---------------------------------------------------------


def unlabelled_prefix_length(input_ids: torch.Tensor, labels: torch.Tensor) -> int:
    """Length of the token prefix all rows share, stopping before the first labelled token.

    ``input_ids`` and ``labels`` are (b, t); the result P leaves at least one token after the prefix
    and keeps ``labels[:, :P+1]`` all IGNORE, so the prefix's logits never enter the loss.
    """
    same = (input_ids == input_ids[:1]).all(dim=0)
    common = int(same.logical_not().nonzero()[0]) if not same.all() else input_ids.shape[1]
    first_labelled = int((labels != IGNORE).any(dim=0).nonzero()[0])
    return max(0, min(common, first_labelled - 1, input_ids.shape[1] - 1))


def labelled_loss(model, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the labelled tokens of a right-padded (b, t) batch, and their count.

    Right padding needs no attention mask under causal attention: real tokens never see later pads.
    The shared prefix runs once (batch 1) and the rest attends to its expanded key/value cache; gradients
    flow through the cache, so loss and gradient are those of a plain full-sequence forward.
    """
    prefix = unlabelled_prefix_length(input_ids, labels)
    cache = None
    if prefix > 0:
        cache = model(input_ids[:1, :prefix], use_cache=True).past_key_values
        cache.batch_repeat_interleave(input_ids.shape[0])
    logits = model(input_ids[:, prefix:], past_key_values=cache, use_cache=cache is not None).logits
    targets = labels[:, prefix + 1 :]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss, int((targets != IGNORE).sum())


def labelled_gradient(model, groups_of: Callable[[int], Iterable[tuple[torch.Tensor, torch.Tensor]]]) -> StepGradient:
    """The step gradient of a fine-tune on labelled groups: step ``s``'s loss is the summed :func:`labelled_loss`
    of the groups ``groups_of(s)`` over their labelled tokens, one backward for the whole step."""
    def gradient(step: int) -> tuple[torch.Tensor, float]:
        total, count = torch.zeros(()), 0
        for input_ids, labels in groups_of(step):
            loss, n = labelled_loss(model, input_ids, labels)
            total, count = total + loss, count + n
        loss = total / count
        loss.backward()
        return loss.detach(), float(count)

    return gradient


# --- the loop ------------------------------------------------------------------------------------------------


def optimizer_step(model, optimizer: torch.optim.Optimizer, lr: float, step_gradient: StepGradient, step: int,
                   max_grad_norm: float) -> dict:
    """One optimizer step at ``lr``: the step's gradient, clipped to ``max_grad_norm``, AdamW, gradients cleared;
    its metrics (``loss``, ``lr``, ``grad_norm``, ``tokens``)."""
    optimization.set_lr(optimizer, lr)
    loss, tokens = step_gradient(step)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(), "tokens": tokens}


def fine_tune(model, optimizer: torch.optim.Optimizer, steps: int, step_gradient: StepGradient, *,
              lr_of: Callable[[int], float], max_grad_norm: float, first_step: int = 0,
              after_step: Callable[[int, dict], None] | None = None, description: str = "fine-tune",
              progress: bool = True) -> list[dict]:
    """Train ``model`` (in train mode; eval mode after) from step ``first_step`` to ``steps`` with :func:`optimizer_step`
    at the rates ``lr_of(step)``; ``after_step(done, metrics)`` runs after each (``done``: the steps done). Returns
    the metrics of the steps run here; the progress bar shows each step's loss as it next moves.

    The optimizer (its state loaded, for a run that goes on) must hold every parameter of ``model``: their
    gradients are cleared first."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    history = []
    bar = tqdm(range(first_step, steps), desc=description, unit="step", disable=not progress)
    for step in bar:
        metrics = optimizer_step(model, optimizer, lr_of(step), step_gradient, step, max_grad_norm)
        history.append(metrics)
        if after_step is not None:
            after_step(step + 1, metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
    model.eval()
    return history
