"""verl's server manager as one of our backends: the episode loop asks it for token ids, verl routes the
request to its vLLM/SGLang servers (docs/verl.md, "Our agent loop inside verl").

verl is not imported here: the server manager is duck-typed (``await generate(request_id, prompt_ids=,
sampling_params=)`` returning an object with ``token_ids``, ``log_probs`` and ``num_preempted``, as verl
0.9's ``AsyncLLMServerManager`` / ``LLMServerClient`` and its ``TokenOutput``), so this module and its
tests run without verl.
"""

from __future__ import annotations

from agent_loop.backends.base import Backend, GenerationResult, SamplingParams


class VerlServerBackend(Backend):
    """One episode's requests to verl's server manager, under one ``request_id`` (verl's sticky session:
    every turn of the episode goes to the same server and reuses its prefix cache).

    ``sampling_params`` is the dict verl's ``AgentLoopWorker`` hands its agent loops (temperature, top_p,
    top_k with -1 for off, repetition_penalty, logprobs, and validation's overrides). It is sent as verl
    built it; each request only sets ``max_tokens`` (the loop's per-turn budget, which already counts the
    episode's response tokens against verl's ``response_length``) and adds the loop's end-of-turn ids to
    ``stop_token_ids``. Our loop's own sampling fields are not sent: verl's config decides sampling.

    After the episode: ``logprobs_given`` (False if any reply came without logprobs: verl's
    ``calculate_log_probs`` is off, and the output should carry none), ``num_preempted`` (summed, -1
    when the server never said), ``requests``.
    """

    def __init__(self, server_manager, sampling_params: dict, request_id: str):
        if not callable(getattr(server_manager, "generate", None)):
            raise TypeError(f"{type(server_manager).__name__} is not a verl server manager: it has no generate()")
        self.server_manager = server_manager
        self.sampling_params = dict(sampling_params)
        self.request_id = request_id
        self.logprobs_given = True
        self.num_preempted = -1
        self.requests = 0

    def describe(self, session_id: str | None = None) -> str:
        return f"verl's server manager (request {self.request_id})"

    def request_params(self, sampling: SamplingParams) -> dict:
        """verl's sampling dict for one request of the loop (see the class docstring)."""
        stops = list(self.sampling_params.get("stop_token_ids") or [])
        stops += [t for t in sampling.stop_token_ids if t not in stops]
        return {**self.sampling_params, "max_tokens": int(sampling.max_tokens), "stop_token_ids": stops}

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerationResult:
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        output = await self.server_manager.generate(
            self.request_id, prompt_ids=list(prompt_ids), sampling_params=self.request_params(sampling))
        self.requests += 1
        token_ids = [int(t) for t in output.token_ids]
        if getattr(output, "stop_reason", None) == "aborted":
            raise RuntimeError(f"verl's server aborted request {self.request_id} after {len(token_ids)} tokens")
        if not token_ids:
            raise RuntimeError(f"verl's server returned no tokens for request {self.request_id}")
        logprobs = getattr(output, "log_probs", None)
        if logprobs is None or len(logprobs) < len(token_ids):
            self.logprobs_given, logprobs = False, [0.0] * len(token_ids)
        preempted = getattr(output, "num_preempted", None)
        if preempted is not None:
            self.num_preempted = max(self.num_preempted, 0) + int(preempted)
        # more ids than max_tokens, or bad ids/logprobs, are the loop's BadOutputError (backends.base.check_result)
        return GenerationResult(token_ids, [float(x) for x in logprobs[: len(token_ids)]],
                                finish_reason(token_ids, sampling))


def finish_reason(token_ids: list[int], sampling: SamplingParams) -> str:
    """"stop" when the reply ends on one of the loop's stop ids, or ended before its budget (the server's own
    end of sequence); "length" when it used the whole budget without a stop id."""
    if token_ids[-1] in sampling.stop_token_ids:
        return "stop"
    return "length" if len(token_ids) >= sampling.max_tokens else "stop"
