"""The chunked output head (agent_loop/training/policy.py ``chunked_head``): the trainer's logprobs and entropies computed a few
tokens at a time, never the whole ``(b, t, v)`` float32 logits, with the real tiny agent on a real batch (the
arithmetic and chain demonstrations replayed through the loop, tiny tokenizer and template).

Checks: values and gradients (of the hidden states, of every weight) equal the plain whole-logits computation
and a serial per-token loop kept here, to float32 rounding, for chunk sizes that do and do not divide the
token count; the policy's forward (shared-prefix cache) and the no-gradient recompute (old logprobs, the
reference model's) equal the plain forward; no tensor of more than one chunk's logits is saved for backward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.tasks.registry import get_task
from agent_loop.training.demonstrations import replay
from agent_loop.training.policy import PolicyModel, batch_logprobs, chunked_head, policy_outputs, response_forward
from masking import SpanKind

TOL = dict(rtol=1e-5, atol=1e-5)  # float32 rounding: sums over a vocabulary, in another order
# a weight's gradient sums every token's share (hundreds), in another order than the plain computation's
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def model(tiny_agent_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    trajectories = [*replay(get_task("arithmetic"), tiny_tokenizer, range(3), seed=1, progress=False),
                    *replay(get_task("chain"), tiny_tokenizer, range(2), seed=1, progress=False)]
    return trajectories_to_batch(trajectories, pad_token_id=tiny_tokenizer.pad_token_id or 0)


def serial(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor):
    """The plain reference: one token at a time, log-softmax and entropy written out."""
    b, t, _ = hidden.shape
    logprobs, entropies = torch.zeros(b, t), torch.zeros(b, t)
    for i in range(b):
        for j in range(t):
            logits = head(hidden[i, j]).float()
            log_p = logits - torch.logsumexp(logits, dim=0)
            logprobs[i, j] = log_p[tokens[i, j]]
            entropies[i, j] = -(log_p.exp() * log_p).sum()
    return logprobs, entropies


def loss_of(logprobs, entropies, weights):
    return (weights[0] * logprobs).sum() + (weights[1] * entropies).sum()


def head_outputs(head: torch.nn.Module, hidden: torch.Tensor, weights: torch.Tensor, compute) -> tuple:
    """``compute(head, leaf)``'s logprobs and entropies for a fresh leaf copy of ``hidden``, and the gradients of
    the weighted loss with respect to the hidden states and the head's weight."""
    head.zero_grad(set_to_none=True)
    leaf = hidden.clone().requires_grad_(True)
    logprobs, entropies = compute(head, leaf)
    loss_of(logprobs, entropies, weights).backward()
    return logprobs.detach(), entropies.detach(), leaf.grad, head.weight.grad.clone()


@pytest.fixture(scope="module")
def references(model, batch):
    """Random hidden states and loss weights over the batch's tokens, and what the plain whole-logits computation
    and the serial loop give for them (computed once: the serial loop is the slow part)."""
    head = model.get_output_embeddings()
    generator = torch.Generator().manual_seed(0)
    b, t = batch.responses.shape
    hidden = torch.randn(b, t, head.in_features, generator=generator)
    weights = torch.randn(2, b, t, generator=generator)

    def whole(head, leaf):
        logits = head(leaf).float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
        return logprobs, torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)

    return hidden, weights, {"whole": head_outputs(head, hidden, weights, whole),
                             "serial": head_outputs(head, hidden, weights,
                                                    lambda head, leaf: serial(head, leaf, batch.responses))}


@pytest.mark.parametrize("chunk", [1, 7, 64, 100_000])
def test_chunked_values_and_gradients_equal_the_whole_logits_and_a_serial_loop(model, batch, references, chunk):
    head = model.get_output_embeddings()
    hidden, weights, expected = references
    got = head_outputs(head, hidden, weights, lambda head, leaf: chunked_head(head, leaf, batch.responses, chunk=chunk))
    for reference in ("whole", "serial"):
        for value, want, tolerance in zip(got, expected[reference], (TOL, TOL, TOL, GRAD_TOL)):
            torch.testing.assert_close(value, want, **tolerance)
    assert got[0].shape == batch.responses.shape and (got[0] < 0).all()


def test_the_policy_forward_equals_the_plain_forward_values_and_gradients(model, batch):
    plain_logits, _ = response_forward(model, batch, share_prefix=False)
    plain_logprobs = torch.log_softmax(plain_logits, -1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    plain_entropy = torch.logsumexp(plain_logits, -1) - (torch.softmax(plain_logits, -1) * plain_logits).sum(-1)
    mask = batch.spans == SpanKind.ASSISTANT
    model.zero_grad(set_to_none=True)
    (torch.where(mask, plain_logprobs + 0.1 * plain_entropy, 0.0)).sum().backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    logprobs, entropy, values = policy_outputs(PolicyModel(model, logits_chunk=13), batch)
    assert values is None and logprobs.shape == entropy.shape == batch.responses.shape
    torch.testing.assert_close(logprobs, plain_logprobs, **TOL)
    torch.testing.assert_close(entropy, plain_entropy, **TOL)
    (torch.where(mask, logprobs + 0.1 * entropy, 0.0)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == plain_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], **GRAD_TOL, msg=name)


def test_the_no_gradient_recompute_equals_the_plain_forward(model, batch):
    with torch.no_grad():
        plain_logits, _ = response_forward(model, batch, share_prefix=False)
    plain = torch.log_softmax(plain_logits, -1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    assistant = batch.spans == SpanKind.ASSISTANT
    reference = PolicyModel(model, logits_chunk=5).requires_grad_(False)  # as the trainer's frozen reference
    logprobs, _ = batch_logprobs(reference, batch, micro_batch_size=2)
    model.requires_grad_(True)
    torch.testing.assert_close(logprobs, torch.where(assistant, plain, 0.0), **TOL)
    assert (logprobs[assistant] < 0).all()


def saved_tensor_sizes(function) -> list[torch.Size]:
    """The shapes of the tensors autograd saves for backward while ``function`` runs."""
    shapes = []

    def pack(tensor):
        shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return shapes


def test_no_more_than_one_chunk_of_logits_is_kept_for_backward(model, batch):
    head = model.get_output_embeddings()
    vocabulary = head.out_features
    b, t = batch.responses.shape
    hidden = torch.randn(b, t, head.in_features, requires_grad=True)
    chunk = 16
    chunked = saved_tensor_sizes(lambda: chunked_head(head, hidden, batch.responses, chunk=chunk))

    def plain():  # the trainer's head before chunking: log-softmax and entropy of the whole logits
        logits = head(hidden).float()
        torch.log_softmax(logits, -1).gather(-1, batch.responses.unsqueeze(-1))
        torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)

    whole = saved_tensor_sizes(plain)

    def logits_rows(shapes):
        return max((s.numel() // vocabulary for s in shapes if len(s) and s[-1] == vocabulary), default=0)

    assert logits_rows(whole) >= b * t  # the plain forward keeps the whole (b, t, v): the check can fail
    assert b * t > 4 * chunk and logits_rows(chunked) <= chunk
