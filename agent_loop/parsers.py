"""Tool-call parsers: the model's text of one assistant turn -> tool calls, parse errors and the text content.

Formats: Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several per turn) and
Llama 3.1 JSON ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``, several
separated by ``;``). Malformed calls become :class:`ParseError` items, never exceptions, so the loop can
answer them with an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    """One well-formed tool call."""

    name: str
    arguments: dict


@dataclass
class ParseError:
    """A call the model attempted that could not be parsed (error kind ``malformed_json``)."""

    raw: str  # the text of the attempted call
    error: str  # what was wrong, readable by the model


@dataclass
class ParsedTurn:
    """What an assistant turn said: its text without the calls, the calls in order, and the failed ones."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)


def _call_from_json(raw: str, arguments_key: str) -> ParsedCall | ParseError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ParseError(raw, f"malformed JSON in tool call: {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParseError(raw, 'a tool call must be a JSON object with a string "name"')
    arguments = obj.get(arguments_key, obj.get("arguments", {}))  # tolerate either key
    if isinstance(arguments, str):  # some models encode the arguments twice
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return ParseError(raw, f"malformed JSON in tool call arguments: {e}")
    if not isinstance(arguments, dict):
        return ParseError(raw, f'"{arguments_key}" must be a JSON object, got {type(arguments).__name__}')
    return ParsedCall(obj["name"], arguments)


def _split(items: list[ParsedCall | ParseError]) -> tuple[list[ParsedCall], list[ParseError]]:
    return [c for c in items if isinstance(c, ParsedCall)], [e for e in items if isinstance(e, ParseError)]


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes/Qwen: each call is ``<tool_call>{json}</tool_call>``; an unclosed last call is parsed to the end."""
    items = [_call_from_json(m.group(1).strip(), "arguments") for m in _HERMES_CALL.finditer(text)]
    content = _HERMES_CALL.sub("", text).strip()
    return ParsedTurn(content, *_split(items))


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.1/3.2 JSON: the turn is ``[<|python_tag|>]{"name": ..., "parameters": {...}}`` (``;``-separated).

    A turn that does not start with ``{`` (after the optional tag) is plain content.
    """
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip() if not tagged else body)
    decoder, items, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            items.append(_call_from_json(body[pos:].strip(), "parameters"))  # records the error
            break
        items.append(_call_from_json(body[pos:end], "parameters"))
        pos = end
        while pos < len(body) and body[pos] in "; \n\t":
            pos += 1
    return ParsedTurn("", *_split(items))


def parser_for_template(template: str):
    """The parser matching a chat template's tool-call format: Hermes/Qwen if it mentions ``<tool_call>``,
    Llama 3 JSON if it mentions ``"parameters"`` with ``<|start_header_id|>`` or ``<|python_tag|>``."""
    if "<tool_call>" in template:
        return parse_hermes
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return parse_llama3_json
    raise ValueError("no tool-call parser for this chat template: it uses neither <tool_call> (Hermes/Qwen) "
                     "nor the Llama 3 JSON format")
