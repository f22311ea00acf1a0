"""The OpenAI chat-completions wire format: requests checked into :class:`ChatRequest`, answers and errors built.

Only what the proxy can honour token-in/token-out is accepted; anything else is an :class:`ApiError` (an
OpenAI-style ``{"error": {...}}`` body with its status code), never a silent change of meaning.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

# parameters that change what is sampled and that the proxy cannot honour: refused, never ignored
_REFUSED = {"functions": "use tools", "function_call": "use tools", "logit_bias": None, "prediction": None,
            "audio": None, "modalities": None, "web_search_options": None}


class ApiError(Exception):
    """A refusal: ``status`` (400, 401, 404, 409, 413, 503...), OpenAI's ``type`` and ``code``, one-line message."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """What one ``/v1/chat/completions`` call asks for, checked."""

    model: str
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the completion's token ids
    parse_tools: bool = True  # tool_choice "none": the turn is text
    user: str | None = None
    metadata: dict = field(default_factory=dict)


def _text(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (images and audio are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text"):
                raise ApiError(400, f"{where}: content part of type {kind!r} is not supported (text only: the "
                               "proxy trains a text model token-in/token-out)", code="unsupported_content",
                               param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param="messages")


def _arguments(raw, where: str):
    """Tool-call arguments as the template renders them: the JSON object a string holds (else the string)."""
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
        return value if isinstance(value, dict) else raw
    if isinstance(raw, dict):
        return raw
    raise ApiError(400, f"{where}: function.arguments must be a JSON string", param="messages")


def normal_message(message, index: int) -> dict:
    """One request message in the form the chat template and the session compare: role, text content, tool calls
    with their arguments as objects, tool results with their call id."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise ApiError(400, f"{where}: a message is an object with role system, user, assistant or tool",
                       param="messages")
    role = "system" if message["role"] == "developer" else message["role"]
    out = {"role": role, "content": _text(message.get("content"), where)}
    if role == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ApiError(400, f"{where}: a tool call needs function.name", param="messages")
            calls.append({"id": str(call.get("id") or ""), "type": "function",
                          "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"), where)}})
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
        if message.get("name"):
            out["name"] = str(message["name"])
    return out


def _number(body: dict, name: str, low: float, high: float, kind=float):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high or (kind is int and int(value) != value):
        raise ApiError(400, f"{name} must be a{'n integer' if kind is int else ' number'} in [{low:g}, {high:g}], "
                       f"got {value!r}", param=name)
    return kind(value)


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                              and isinstance(t.get("function"), dict) and t["function"].get("name")
                                              for t in tools):
        raise ApiError(400, "tools must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}",
                       param="tools")
    # "strict" is a constraint on decoding, not prompt text (vLLM drops it too); the rest is rendered as sent
    return [{"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in tools]


def _check_refused(body: dict) -> None:
    for name, hint in _REFUSED.items():
        if body.get(name) is not None:
            raise ApiError(400, f"{name} is not supported by the recording proxy" + (f" ({hint})" if hint else ""),
                           param=name, code="unsupported_parameter")
    if body.get("n", 1) != 1:
        raise ApiError(400, f"n must be 1 (got {body.get('n')!r}): one session is one episode; play n episodes as n "
                       "sessions", param="n", code="unsupported_parameter")
    if body.get("top_logprobs"):
        raise ApiError(400, "top_logprobs is not supported (logprobs: true gives each sampled token's logprob)",
                       param="top_logprobs", code="unsupported_parameter")
    if body.get("stop"):
        raise ApiError(400, "stop sequences are not supported (a turn ends on the chat template's end-of-turn "
                       "token; a stop string would cut tokens the model sampled)", param="stop",
                       code="unsupported_parameter")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(400, f"tool_choice {choice!r} is not supported (auto or none)", param="tool_choice",
                       code="unsupported_parameter")
    form = body.get("response_format")
    if form not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than text is not supported (no constrained decoding)",
                       param="response_format", code="unsupported_parameter")


def parse_request(body) -> ChatRequest:
    """A request body (already decoded JSON) checked into a :class:`ChatRequest`; ApiError on the first problem."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise ApiError(400, "model is required (a string)", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    _check_refused(body)
    options = body.get("stream_options") or {}
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(
        model=body["model"], messages=[normal_message(m, i) for i, m in enumerate(messages)], tools=_tools(body),
        max_tokens=_number({"max_tokens": limit}, "max_tokens", 1, 1 << 30, int),
        temperature=_number(body, "temperature", 0, 2), top_p=_number(body, "top_p", 1e-9, 1),
        seed=_number(body, "seed", -(1 << 63), (1 << 63) - 1, int), stream=bool(body.get("stream")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        logprobs=bool(body.get("logprobs")), return_token_ids=bool(body.get("return_token_ids")),
        parse_tools=body.get("tool_choice") != "none",
        user=body["user"] if isinstance(body.get("user"), str) else None, metadata=metadata)


# --- answers ---------------------------------------------------------------------------------------------


def wire_message(content: str, calls: list[dict]) -> dict:
    """The assistant message as OpenAI sends it (arguments as JSON text, content null beside tool calls)."""
    message = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])
                                               if not isinstance(c["arguments"], str) else c["arguments"]}}
                                 for c in calls]
    return message


def logprobs_block(tokenizer, ids: list[int], logprobs: list[float]) -> dict:
    """OpenAI's ``choice.logprobs``: each sampled token (its text, bytes and sampling logprob)."""
    content = []
    for tid, lp in zip(ids, logprobs):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return {"content": content}


def completion_body(*, request_id: str, model: str, message: dict, finish: str, usage: dict,
                    logprobs: dict | None, token_ids: dict | None) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
    if token_ids:
        choice["token_ids"] = token_ids["completion"]
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}
    if token_ids:
        body["prompt_token_ids"] = token_ids["prompt"]
    return body


def stream_chunks(*, request_id: str, model: str, message: dict, finish: str, usage: dict | None,
                  logprobs: dict | None) -> list[dict]:
    """The SSE chunks of one finished completion: content, then each tool call whole, then the finish (and usage)."""
    def chunk(delta: dict, finish_reason=None, **extra) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}]}

    chunks = []
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}, logprobs=logprobs))
    for i, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, finish))
    if usage is not None:
        chunks.append({"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                       "model": model, "choices": [], "usage": usage})
    return chunks
