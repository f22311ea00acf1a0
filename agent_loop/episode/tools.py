"""Tools from plain Python functions (or MCP-style schemas), and their concurrent execution for one assistant turn.

:class:`ToolEnvironment` is the loop's default environment of a turn (``agent_loop.episode.contracts``): it
runs a turn's parsed calls with :class:`ToolExecutor` and answers with their results. Tools of another
origin (an MCP server, a sandbox) are functions like any other (sync or async, with a schema from
:func:`tools_from_schemas`); what they hold for one episode is released by ``ToolEnvironment(on_close=...)``.

The JSON schema comes from the function's type hints and docstring (``transformers.utils.get_json_schema``),
arguments are validated against it with ``jsonschema``, and every failure (bad JSON, unknown tool, bad
arguments, an exception, a timeout) becomes an error text the model reads as the tool's response.

A tool can neither take the process down nor keep it alive: any ``BaseException`` it raises
(``SystemExit``, ``KeyboardInterrupt`` included) becomes an ``exception`` record; sync tools run on
daemon threads of a bounded pool (:class:`ToolThreads`), so a hung tool is reported as ``timeout``,
frees its slot for the others, and cannot block interpreter exit; results are cut to a character
budget before anything tokenizes them (the record keeps the cut text and the original length) and
invalid Unicode (lone surrogates) is replaced with U+FFFD.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import jsonschema
from transformers.utils import get_json_schema

from agent_loop.episode.contracts import AssistantTurn, StepLimits, StepResult, TurnEnvironment
from agent_loop.episode.parsers import ParsedCall, ParseError
from agent_loop.episode.tool_formats import default_call_id
from agent_loop.types import ToolCallRecord

# Deriving and checking a schema costs milliseconds; closures made from one function (a per-episode
# lookup table, say) share their code, docstring and hints, so they share one schema and validator.
_CHECKED: dict[tuple, tuple[dict, jsonschema.Draft202012Validator]] = {}


def _checked_schema(fn: Callable) -> tuple[dict, jsonschema.Draft202012Validator]:
    given = getattr(fn, "json_schema", None)  # a schema given with the function (tools_from_schemas)
    code = getattr(fn, "__code__", None)
    if given is not None:
        kept = getattr(fn, "_checked_of", None)  # (the given schema, its entry): no JSON dump of it per call
        if kept is not None and kept[0] is given:
            return kept[1]
        key = (json.dumps(given, sort_keys=True),)
    else:
        key = (code, fn.__doc__, repr(getattr(fn, "__annotations__", None))) if code else (fn,)
    if key not in _CHECKED:
        schema = given if given is not None else get_json_schema(fn)
        jsonschema.Draft202012Validator.check_schema(schema["function"]["parameters"])
        _CHECKED[key] = schema, jsonschema.Draft202012Validator(schema["function"]["parameters"])
    if given is not None:
        try:
            fn._checked_of = (given, _CHECKED[key])
        except (AttributeError, TypeError):  # a callable that takes no attributes: the JSON key every time
            pass
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


TRUNCATION_MARK = " ...[truncated]"
_SURROGATES = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with lone surrogates (not encodable as UTF-8) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", text)


def cut_text(text: str, max_chars: int | None) -> str:
    """``text`` cut to ``max_chars`` characters (and marked) when longer than that and a mark, lone surrogates
    replaced: what an observation keeps before anything tokenizes it (a cut text passes through unchanged)."""
    if max_chars is not None and len(text) > max_chars + len(TRUNCATION_MARK):
        text = text[:max_chars] + TRUNCATION_MARK
    return clean_text(text)


def _as_text(result: Any, max_chars: int | None = None) -> tuple[str, int | None]:
    """The tool result as text, cut to ``max_chars`` (and marked) before anything else touches it;
    the original length in characters when cut, else None."""
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    original = None
    if max_chars is not None and len(text) > max_chars:
        original, text = len(text), text[:max_chars] + TRUNCATION_MARK
    return clean_text(text), original


class ToolPoolExhausted(RuntimeError):
    """Too many sync tool calls are hung (timed out but still running) to start another."""


class ToolThreads:
    """Runs sync tools on daemon threads: at most ``max_workers`` at once per event loop; a call that times
    out gives its slot back at once (its thread is abandoned, still a daemon, so exit never waits for it).

    Abandoned threads still running are counted; past ``max_hung`` new calls fail with
    :class:`ToolPoolExhausted` instead of piling up threads.
    """

    def __init__(self, max_workers: int = 32, max_hung: int = 256):
        self.max_workers, self.max_hung = max_workers, max_hung
        self._gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> Semaphore
        self._lock = threading.Lock()
        self.hung = 0

    def _gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(self.max_workers)
        return gate

    async def run(self, fn: Callable, kwargs: dict, timeout_s: float) -> Any:
        """``fn(**kwargs)`` on a daemon thread; TimeoutError after ``timeout_s``; its BaseException re-raised
        here wrapped so that nothing but Exception subclasses come out."""
        if self.hung >= self.max_hung:
            raise ToolPoolExhausted(f"{self.hung} tool calls are still hung after their timeout; not starting more")
        loop = asyncio.get_running_loop()
        async with self._gate():
            future = loop.create_future()
            state = {"abandoned": False}

            def deliver(ok: bool, value) -> None:
                if not future.done():
                    future.set_result(value) if ok else future.set_exception(value)

            def work() -> None:
                try:
                    outcome = (True, fn(**kwargs))
                except BaseException as error:  # noqa: BLE001 (SystemExit/KeyboardInterrupt of a tool included)
                    outcome = (False, error if isinstance(error, Exception) else _ToolBaseException(error))
                with self._lock:
                    if state["abandoned"]:
                        self.hung -= 1
                        return
                try:
                    loop.call_soon_threadsafe(deliver, *outcome)
                except RuntimeError:  # the event loop is closed: nobody waits for this result
                    pass

            threading.Thread(target=work, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
            try:
                async with asyncio.timeout(timeout_s):
                    return await asyncio.shield(future)
            except BaseException:
                with self._lock:
                    if not future.done():
                        state["abandoned"] = True
                        self.hung += 1
                raise


class _ToolBaseException(Exception):
    """A BaseException (SystemExit, KeyboardInterrupt, ...) raised inside a tool, carried as an Exception."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


TOOL_THREADS = ToolThreads()


class ToolExecutor:
    """Runs the tool calls of one turn concurrently (at most ``max_parallel`` at once), each with a timeout.

    Sync functions run on the daemon threads of ``threads`` (default: the shared :data:`TOOL_THREADS`).
    A sync tool that hangs past its timeout is reported as ``timeout`` at once and frees its slot;
    Python cannot kill its thread, but it is a daemon thread and never keeps the process alive.
    """

    def __init__(self, functions: list[Callable], threads: ToolThreads | None = None):
        self.tools = {tool.name: tool for tool in map(Tool.from_function, functions)}
        self.threads = threads or TOOL_THREADS

    @property
    def schemas(self) -> list[dict]:
        """The tool schemas, for the chat template."""
        return [tool.schema for tool in self.tools.values()]

    async def execute(self, calls: list[ParsedCall | ParseError], turn: int = 0, timeout_s: float = 10.0,
                      max_parallel: int = 4, max_result_chars: int | None = None) -> list[ToolCallRecord]:
        """One record per call, in the order given; ``result`` or ``error`` is what the model reads.

        ``max_result_chars`` cuts longer results (and error texts) before anything tokenizes them;
        the record keeps ``result_chars``, the original length.
        """
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
        limit = asyncio.Semaphore(max_parallel)

        async def bounded(call):
            async with limit:
                return await self._execute_one(call, turn, timeout_s, max_result_chars)

        return list(await asyncio.gather(*(bounded(c) for c in calls)))

    async def _execute_one(self, call: ParsedCall | ParseError, turn: int, timeout_s: float,
                           max_result_chars: int | None = None) -> ToolCallRecord:
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
                async with asyncio.timeout(timeout_s):  # awaited in this task: its SystemExit is caught below
                    result = await tool.fn(**call.arguments)
            else:
                result = await self.threads.run(tool.fn, call.arguments, timeout_s)
            record.result, record.result_chars = _as_text(result, max_result_chars)
        except TimeoutError:
            _failed(record, "timeout", f"Error: tool '{call.name}' timed out after {timeout_s:g} s")
        except BaseException as e:  # the tool's own failure is an observation, not a crash of the loop
            if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # the episode itself is being cancelled
            e = e.error if isinstance(e, _ToolBaseException) else e
            message, _ = _as_text(f"Error: tool '{call.name}' raised {type(e).__name__}: {e}", max_result_chars)
            _failed(record, "exception", message)
        record.latency_s = time.perf_counter() - start
        return record


class ToolEnvironment(TurnEnvironment):
    """The tool executor as the environment of a turn (the default one: ``Episode.environment`` None).

    A turn without tool calls ends the episode (``done``); otherwise its calls run (:class:`ToolExecutor`,
    each bounded by ``limits.timeout_s``, so ``bounds_its_steps``) and their results, in call order, are the
    observation. On a ``final`` turn the calls are not run: no turn would read their results. It gives no
    per-turn reward (``reward`` None). ``on_close``: callables (sync or async) run when the episode ends, e.g.
    closing a per-episode session that the tools share.
    """

    bounds_its_steps = True

    def __init__(self, functions: Sequence[Callable], threads: ToolThreads | None = None, *,
                 on_close: Sequence[Callable] = ()):
        self.executor = ToolExecutor(list(functions), threads)
        self.on_close = list(on_close)

    @property
    def tool_schemas(self) -> list[dict]:
        return self.executor.schemas

    async def step(self, turn: AssistantTurn, limits: StepLimits) -> StepResult:
        if not turn.calls:
            return StepResult(done=True)
        if turn.final:
            return StepResult()
        records = await self.executor.execute(turn.calls, turn=turn.index, timeout_s=limits.timeout_s,
                                              max_parallel=limits.max_parallel, max_result_chars=limits.max_result_chars)
        for record, call_id in zip(records, turn.call_ids):
            record.call_id = call_id
        return StepResult(observations=tool_messages(records), tool_calls=records)

    async def close(self) -> None:
        for fn in self.on_close:
            if inspect.isawaitable(value := fn()):
                await value


def _failed(record: ToolCallRecord, kind: str, message: str) -> ToolCallRecord:
    record.error_kind, record.error = kind, message
    return record


def tool_messages(records: list[ToolCallRecord]) -> list[dict]:
    """Chat messages of the tool results, in call order (``tool_call_id``: the record's ``call_id``, set by the
    loop from ``ChatFormatter.call_id``; by position where unset)."""
    return [{"role": "tool", "name": r.name, "tool_call_id": r.call_id or default_call_id(i),
             "content": r.result if r.error is None else r.error}
            for i, r in enumerate(records)]


# --- tools from functions and from schemas ---------------------------------------------------------


def tool(fn: Callable) -> Callable:
    """Mark a plain function as a tool and check now that its schema can be derived (type hints and a
    Google-style docstring with an ``Args:`` entry per parameter); returns the function unchanged.

    Plain functions work as tools without it: the decorator only moves the error to definition time.
    """
    try:
        Tool.from_function(fn)
    except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
        raise TypeError(f"tool {getattr(fn, '__qualname__', fn)!r}: {error}") from None
    return fn


def _openai_schema(schema: dict) -> dict:
    """An MCP tool (``name``, ``description``, ``inputSchema``) or an OpenAI function schema -> OpenAI form."""
    if schema.get("type") == "function" and isinstance(schema.get("function"), dict):
        function = schema["function"]
    elif "name" in schema:
        function = {"name": schema["name"], "description": schema.get("description", ""),
                    "parameters": schema.get("inputSchema", schema.get("parameters", {"type": "object", "properties": {}}))}
    else:
        raise ValueError(f"not a tool schema (needs 'name' and 'inputSchema', or 'type': 'function'): {schema!r}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"tool schema without a name: {schema!r}")
    defaults = {"description": "", "parameters": {"type": "object", "properties": {}}}
    function = {**function, **{k: v for k, v in defaults.items() if k not in function}}  # the given key order: the prompt renders it
    return {"type": "function", "function": function}


def tools_from_schemas(schemas: Sequence[dict] | str | Path, implementations: Any) -> list[Callable]:
    """Tools from MCP-style JSON schemas (a list, or a ``.json`` file holding one) and their implementations.

    ``implementations`` is a dict ``name -> callable``, a module (functions looked up by name), or one
    handler ``handler(name, arguments) -> result`` for every tool (sync or async), like an MCP server's
    ``call_tool``. The model sees the schemas as given; arguments are validated against them.
    """
    if isinstance(schemas, (str, Path)):
        schemas = json.loads(Path(schemas).read_text(encoding="utf-8"))
    if not isinstance(schemas, list):
        raise ValueError(f"tool schemas must be a list, got {type(schemas).__name__}")
    tools = []
    for raw in schemas:
        schema = _openai_schema(raw)
        name = schema["function"]["name"]
        if isinstance(implementations, dict) or inspect.ismodule(implementations):
            fn = implementations.get(name) if isinstance(implementations, dict) else getattr(implementations, name, None)
            if not callable(fn):
                raise ValueError(f"tool {name!r} has a schema but no implementation")
            tools.append(_with_schema(fn, schema))
        elif callable(implementations):
            tools.append(_with_schema(functools.partial(_call_handler, implementations, name), schema,
                                      is_async=inspect.iscoroutinefunction(implementations)))
        else:
            raise TypeError("implementations must be a dict, a module or a handler(name, arguments)")
    return tools


def _call_handler(handler: Callable, name: str, /, **arguments):  # a tool argument may be called name
    return handler(name, arguments)


def _with_schema(fn: Callable, schema: dict, is_async: bool | None = None) -> Callable:
    """A function that calls ``fn`` and carries ``json_schema`` (read by :func:`_checked_schema`)."""
    if is_async if is_async is not None else inspect.iscoroutinefunction(fn):
        async def call(**arguments):
            return await fn(**arguments)
    else:
        def call(**arguments):
            return fn(**arguments)
    call.__name__ = call.__qualname__ = schema["function"]["name"]
    call.json_schema = schema
    Tool.from_function(call)  # check the schema now
    return call
