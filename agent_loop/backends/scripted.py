"""A backend that replays scripted replies: deterministic tests of the loop logic, no model involved."""

from __future__ import annotations

from typing import Callable, Sequence

from agent_loop.backends.base import Backend, GenerationResult, SamplingParams

# A script maps the prompt so far to the reply's token ids. Deciding from the prompt (not from call
# order) keeps replies deterministic when many episodes interleave on one backend.
Script = Callable[[list[int]], Sequence[int]]


def scripted_logprob(token_id: int) -> float:
    """A fixed, recognisable fake logprob per token id, so tests can check logprobs are carried through."""
    return -((token_id % 97) + 1) / 100.0


class ScriptedBackend(Backend):
    """Replays replies from ``script(prompt_ids)``.

    The reply is cut at the first stop token (finish "stop") or at ``max_tokens`` (finish "length");
    a reply that has no stop token gets the first stop token appended, as a real model ending its turn.
    ``calls`` records every (prompt, session_id), for assertions.
    """

    def __init__(self, script: Script):
        self.script = script
        self.calls: list[tuple[list[int], str | None]] = []

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        self.calls.append((list(prompt_ids), session_id))
        reply = list(self.script(list(prompt_ids)))
        stops = set(sampling.stop_token_ids)
        stop_at = next((i for i, tok in enumerate(reply) if tok in stops), None)
        if stop_at is not None:
            reply = reply[: stop_at + 1]
        elif sampling.stop_token_ids:
            reply.append(sampling.stop_token_ids[0])
        finish = "stop"
        if len(reply) > sampling.max_tokens:
            reply, finish = reply[: sampling.max_tokens], "length"
        return GenerationResult(reply, [scripted_logprob(t) for t in reply], finish)
