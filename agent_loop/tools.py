"""Tools from plain Python functions, and their concurrent execution for one assistant turn.

The JSON schema comes from the function's type hints and docstring (``transformers.utils.get_json_schema``),
arguments are validated against it with ``jsonschema``, and every failure (bad JSON, unknown tool, bad
arguments, an exception, a timeout) becomes an error text the model reads as the tool's response.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import jsonschema
from transformers.utils import get_json_schema

from agent_loop.parsers import ParseError, ParsedCall
from agent_loop.types import ToolCallRecord


# Deriving and checking a schema costs milliseconds; closures made from one function (a per-episode
# lookup table, say) share their code, docstring and hints, so they share one schema and validator.
_CHECKED: dict[tuple, tuple[dict, jsonschema.Draft202012Validator]] = {}


def _checked_schema(fn: Callable) -> tuple[dict, jsonschema.Draft202012Validator]:
    given = getattr(fn, "json_schema", None)  # a schema given with the function (data_tasks.tools_from_schemas)
    code = getattr(fn, "__code__", None)
    if given is not None:
        key = (json.dumps(given, sort_keys=True),)
    else:
        key = (code, fn.__doc__, repr(getattr(fn, "__annotations__", None))) if code else (fn,)
    if key not in _CHECKED:
        schema = given if given is not None else get_json_schema(fn)
        jsonschema.Draft202012Validator.check_schema(schema["function"]["parameters"])
        _CHECKED[key] = schema, jsonschema.Draft202012Validator(schema["function"]["parameters"])
    return _CHECKED[key]


@dataclass
class Tool:
    """A callable with its JSON schema (``{"type": "function", "function": {...}}``)."""

    fn: Callable
    schema: dict
    validator: jsonschema.Draft202012Validator

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @classmethod
    def from_function(cls, fn: Callable) -> "Tool":
        return cls(fn, *_checked_schema(fn))


def _as_text(result: Any) -> str:
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)


class ToolExecutor:
    """Runs the tool calls of one turn concurrently (at most ``max_parallel`` at once), each with a timeout.

    Sync functions run in a worker thread (``asyncio.to_thread``). A sync tool that hangs past its
    timeout is reported as ``timeout`` at once, but Python cannot kill its thread: it keeps a worker
    of the default executor busy until it returns.
    """

    def __init__(self, functions: list[Callable]):
        self.tools = {tool.name: tool for tool in map(Tool.from_function, functions)}

    @property
    def schemas(self) -> list[dict]:
        """The tool schemas, for the chat template."""
        return [tool.schema for tool in self.tools.values()]

    async def execute(self, calls: list[ParsedCall | ParseError], turn: int = 0, timeout_s: float = 10.0,
                      max_parallel: int = 4) -> list[ToolCallRecord]:
        """One record per call, in the order given; ``result`` or ``error`` is what the model reads."""
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
        limit = asyncio.Semaphore(max_parallel)

        async def bounded(call):
            async with limit:
                return await self._execute_one(call, turn, timeout_s)

        return list(await asyncio.gather(*(bounded(c) for c in calls)))

    async def _execute_one(self, call: ParsedCall | ParseError, turn: int, timeout_s: float) -> ToolCallRecord:
        if isinstance(call, ParseError):
            return ToolCallRecord(name="", arguments=call.raw, turn=turn, error_kind="malformed_json",
                                  error=f"Error: {call.error}")
        record = ToolCallRecord(name=call.name, arguments=call.arguments, turn=turn)
        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(self.tools) or "none"
            return _failed(record, "unknown_tool", f"Error: unknown tool '{call.name}'; available: {available}")
        error = jsonschema.exceptions.best_match(tool.validator.iter_errors(call.arguments))
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "arguments"
            return _failed(record, "invalid_arguments", f"Error: invalid arguments for '{call.name}' ({where}): {error.message}")
        start = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(tool.fn):
                result = await asyncio.wait_for(tool.fn(**call.arguments), timeout_s)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments), timeout_s)
            record.result = _as_text(result)
        except TimeoutError:
            _failed(record, "timeout", f"Error: tool '{call.name}' timed out after {timeout_s:g} s")
        except Exception as e:  # the tool's own failure is an observation, not a crash of the loop
            _failed(record, "exception", f"Error: tool '{call.name}' raised {type(e).__name__}: {e}")
        record.latency_s = time.perf_counter() - start
        return record


def _failed(record: ToolCallRecord, kind: str, message: str) -> ToolCallRecord:
    record.error_kind, record.error = kind, message
    return record


def tool_messages(records: list[ToolCallRecord]) -> list[dict]:
    """Chat messages of the tool results, in call order (``tool_call_id`` as in ``ChatFormatter.assistant_message``)."""
    return [{"role": "tool", "name": r.name, "tool_call_id": f"call{i:05d}",
             "content": r.result if r.error is None else r.error}
            for i, r in enumerate(records)]
