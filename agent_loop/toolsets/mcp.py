"""MCP servers as tools (``--mcp-server``), through the official ``mcp`` SDK.

A server is a command line (``'python server.py'``: started as a subprocess, stdio transport; a bare
``python``/``python3`` is this interpreter, so a script runs in agent-loop's environment) or a URL
(``http://127.0.0.1:8000/mcp``: streamable HTTP). Its listed tools become the model's tools, their input
schemas exactly as listed; the tools are listed once when the tool set loads (a server that does not start,
or lists no tools, or two servers serving one name, is one line of error before any episode).

Each episode has its own session with each server it calls (opened at its first call, closed when the
episode ends): a stdio server is a process per episode, an HTTP server a session per episode (the
initialize handshake's ``Mcp-Session-Id``; the 2026-07-28 protocol has no sessions, so this client asks for
the handshake era). A stateful server thus keeps one state per episode.

The loop's ``tool_timeout_s`` bounds each call (a server that answers later is a ``timeout`` observation,
its late answer dropped); a result with ``isError`` and a protocol error are error observations; a server
that dies mid-episode is an error observation, then restarted at the next call (its state lost, said so)
once per episode, after which its calls fail with a clear "not restarted" until the episode ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlparse

from agent_loop.episode.tools import tools_from_schemas

STARTUP_TIMEOUT_S = 60.0  # start and list tools; a Python server importing the SDK takes seconds on a busy machine
MAX_RESTARTS = 1  # per server and episode, after the server died
PROTOCOL_MODE = "legacy"  # the initialize handshake: streamable HTTP sessions, one per episode


_BOX = " │╭╮╰╯─┃━"  # the frame of a rich traceback (the SDK's server logs) around a stderr line


class McpServerError(RuntimeError):
    """An MCP server cannot be used: it did not start, it died, or it answered with an error."""


@dataclass(frozen=True)
class McpServer:
    """One ``--mcp-server`` value: a command line (stdio) or an ``http(s)://`` URL (streamable HTTP)."""

    spec: str

    def __post_init__(self):
        if not self.spec.strip():
            raise ValueError("--mcp-server needs a command line ('python server.py') or a URL (http://HOST:PORT/mcp)")
        if self.is_http:
            url = urlparse(self.spec)
            if not url.hostname:
                raise ValueError(f"--mcp-server {self.spec!r}: a URL needs a host, e.g. http://127.0.0.1:8000/mcp")
        else:
            try:
                shlex.split(self.spec)
            except ValueError as error:
                raise ValueError(f"--mcp-server {self.spec!r}: not a command line ({error})") from None

    @property
    def label(self) -> str:
        """How the model's error observations name the server: the URL, or the command without its folders."""
        return self.spec if self.is_http else " ".join(os.path.basename(p) or p for p in shlex.split(self.spec))

    @property
    def is_http(self) -> bool:
        return self.spec.startswith(("http://", "https://"))

    def transport(self, errlog):
        """A fresh transport (an async context manager) to this server; stdio servers write stderr to ``errlog``."""
        from mcp.client.stdio import StdioServerParameters, stdio_client  # mcp: optional (the tools extra)
        from mcp.client.streamable_http import streamable_http_client  # mcp: optional (the tools extra)

        if self.is_http:
            return streamable_http_client(self.spec)
        command, *args = shlex.split(self.spec)
        if command in ("python", "python3"):
            command = sys.executable
        return stdio_client(StdioServerParameters(command=command, args=args), errlog=errlog)


def _cause(error: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio task groups wrap what their tasks raised)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


class _Connection:
    """One session with one server. It is entered and exited in a task of its own (anyio's scopes must close
    in the task that opened them); calls come from the episode's tool tasks."""

    def __init__(self, server: McpServer):
        self.server = server
        self.client = None
        self.ended = False  # the session is over (closed, or the server went away)
        self._errlog = None if server.is_http else tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by a call, or by nobody
        self._closing = asyncio.Event()
        self._owner = asyncio.get_running_loop().create_task(self._own(), name=f"mcp-{server.spec}")

    async def _own(self) -> None:
        from mcp import Client  # mcp: optional (the tools extra)

        try:
            async with Client(self.server.transport(self._errlog), mode=PROTOCOL_MODE) as client:
                self.client = client
                self._ready.set_result(None)
                await self._closing.wait()
        except BaseException as error:  # noqa: BLE001 (a start that failed is reported to the waiting call)
            if not self._ready.done():
                self._ready.set_exception(McpServerError(self.describe(f"did not start: {_describe(error)}")))
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            self.ended = True
            if self._errlog is not None:
                self._errlog.close()

    def describe(self, what: str) -> str:
        return _described(self.server, what, self._errlog, self.server.label)

    async def call(self, name: str, arguments: dict):
        """The server's CallToolResult; McpServerError if the session is gone."""
        await asyncio.shield(self._ready)  # a call that times out while the server starts leaves it starting
        if self.ended:
            raise McpServerError(self.describe("closed the session"))
        try:
            return await self.client.call_tool(name, arguments)
        except Exception as error:
            from mcp import MCPError  # mcp: optional (the tools extra)

            if isinstance(error, MCPError) and "closed" not in str(error).lower():
                raise McpServerError(f"MCP server {self.server.label} answered {name!r} with an error: {error}") from None
            self.ended = True  # the transport broke: the server died or went away
            raise McpServerError(self.describe(f"went away during {name!r}: {_describe(error)}")) from None

    async def aclose(self) -> None:
        self._closing.set()
        if not self._ready.done():
            self._owner.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(self._owner), 10)


def _described(server: McpServer, what: str, errlog, name: str | None = None) -> str:
    """``what`` happened to ``server``, with the last lines it wrote to stderr (stdio servers)."""
    tail = ""
    if errlog is not None and not errlog.closed:
        errlog.flush()
        errlog.seek(0)
        lines = [line.strip(_BOX) for line in errlog.read()[-4000:].splitlines() if re.search(r"\w{3}", line)]
        tail = f" (its stderr ends: {' | '.join(lines[-3:])})" if lines else ""
        if any("mcp.server.fastmcp" in line for line in lines):  # a server of the 1.x SDK under our mcp 2.x
            tail += (". A server written for the 1.x SDK (FastMCP) runs under its own interpreter: --mcp-server "
                     "'/path/to/its/venv/bin/python server.py', or 'uvx PACKAGE' for a published one (docs/ecosystem.md)")
    return f"MCP server {name or server.spec!r} {what}{tail}"


def _describe(error: BaseException) -> str:
    error = _cause(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def result_text(result) -> str:
    """A CallToolResult as the text the model reads: its text blocks; other blocks named; else its
    structured content as JSON."""
    parts = []
    for block in result.content:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        elif getattr(block, "type", None) == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{getattr(block, 'type', 'content')} {getattr(block, 'mime_type', '') or ''}]".replace(" ]", "]"))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


class McpToolError(RuntimeError):
    """The server's tool answered with ``isError``: its text is the observation."""


class McpEpisode:
    """One episode's sessions, one per server, opened at a server's first call; :meth:`aclose` ends them."""

    def __init__(self, owners: dict[str, McpServer]):
        self.owners = owners  # tool name -> its server
        self.connections: dict[McpServer, _Connection] = {}
        self.restarts: dict[McpServer, int] = {}
        self.closed = False

    def _connection(self, server: McpServer) -> _Connection:
        connection = self.connections.get(server)
        if connection is not None and connection.ended:
            if self.restarts.get(server, 0) >= MAX_RESTARTS:
                raise McpServerError(connection.describe(f"went away again; not restarted in this episode "
                                                         f"(restarted {MAX_RESTARTS} time(s))"))
            self.restarts[server] = self.restarts.get(server, 0) + 1
            asyncio.get_running_loop().create_task(connection.aclose())
            connection = None
        if connection is None:
            connection = self.connections[server] = _Connection(server)
        return connection

    async def prepare(self, names: set[str], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start the sessions of the servers of ``names`` and wait (at most ``timeout_s``) until they are ready,
        so that a server's start is not counted in its first call's timeout; a failure is the call's to report."""
        servers = {self.owners[n] for n in names if n in self.owners}
        if self.closed or not servers:
            return
        waits = []
        for server in servers:
            with contextlib.suppress(McpServerError):
                waits.append(asyncio.shield(self._connection(server)._ready))
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*waits, return_exceptions=True)

    async def call(self, name: str, arguments: dict) -> str:
        if self.closed:
            raise McpServerError("the episode has ended: its MCP sessions are closed")
        server = self.owners[name]
        connection = self._connection(server)
        try:
            result = await connection.call(name, arguments)
        except McpServerError as error:
            if connection.ended and self.restarts.get(server, 0) < MAX_RESTARTS:
                raise McpServerError(f"{error}; it is restarted at the next call, its state from this episode "
                                     "is lost") from None
            if connection.ended:
                raise McpServerError(f"{error}; it is not restarted again in this episode") from None
            raise
        if result.is_error:
            raise McpToolError(result_text(result) or "the tool reported an error")
        return result_text(result)

    async def aclose(self) -> None:
        """Close every session of this episode (idempotent)."""
        self.closed = True
        connections, self.connections = list(self.connections.values()), {}
        await asyncio.gather(*(c.aclose() for c in connections))


async def _list(server: McpServer, timeout_s: float) -> list[dict]:
    errlog = None if server.is_http else tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
    from mcp import Client  # mcp: optional (the tools extra)

    try:
        async with asyncio.timeout(timeout_s):
            async with Client(server.transport(errlog), mode=PROTOCOL_MODE) as client:
                tools, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
    except TimeoutError:
        raise McpServerError(_described(server, f"did not start and list its tools within {timeout_s:g} s",
                                        errlog)) from None
    except Exception as error:
        raise McpServerError(_described(server, f"did not start: {_describe(error)}", errlog)) from None
    finally:
        if errlog is not None:
            errlog.close()
    return [{"name": t.name, "description": t.description or "", "inputSchema": t.input_schema} for t in tools]


def list_tools(server: McpServer, timeout_s: float = STARTUP_TIMEOUT_S) -> list[dict]:
    """The server's tools as MCP schemas (``name``, ``description``, ``inputSchema``), from a short session
    of its own (on a thread with its own event loop: callable with or without a running loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _list(server, timeout_s)).result()


class McpToolset:
    """The tools of ``--mcp-server`` (repeatable): listed now, served per episode. Picklable (specs and
    schemas only; sessions open in the process that plays the episode)."""

    name = "mcp"

    def __init__(self, servers: list[str], *, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.servers = [McpServer(spec) for spec in servers]
        self.schemas: list[dict] = []
        self.owners: dict[str, McpServer] = {}
        for server in self.servers:
            listed = list_tools(server, startup_timeout_s)
            if not listed:
                raise McpServerError(f"MCP server {server.spec!r} lists no tools")
            for schema in listed:
                if schema["name"] in self.owners:
                    raise McpServerError(f"tool name {schema['name']!r} is served by both MCP server "
                                         f"{self.owners[schema['name']].spec!r} and {server.spec!r}")
                self.owners[schema["name"]] = server
            self.schemas += listed

    def tools(self) -> list[Callable]:
        """One episode's tools: async functions with the listed schemas, sharing the episode's sessions."""
        episode = McpEpisode(self.owners)
        tools = tools_from_schemas(self.schemas, episode.call)
        for fn in tools:  # the episode's environment readies and closes its sessions (agent_loop.toolsets)
            fn.prepare, fn.aclose = episode.prepare, episode.aclose
        return tools
