"""Tool sets added to any task's episodes: MCP servers (``--mcp-server``, :mod:`.mcp`) and the sandboxed
Python tool (``--tools python`` / ``python_persistent``, :mod:`.python_sandbox`).

A tool set makes each episode's tools afresh (``tools()``): functions like any other tool, whose per-episode
state (an MCP session, an interpreter) is released by their ``aclose`` when the episode ends: the episode's
environment is the tool environment of the task's tools and the set's (:class:`.task.ToolsetEnvironment`),
which the loop closes however the episode ends. Two tools of one name (a server's and the task's, or two
servers') are refused in one line before any episode.

Python API: ``with_toolsets(task, tools="python", mcp_server=["python server.py"])``, or
``TaskOptions(task=..., tools=..., mcp_server=[...]).load()`` (the keys of the CLI and of YAML).
"""

from __future__ import annotations

from typing import Sequence

from agent_loop.episode.contracts import as_task
from agent_loop.toolsets.mcp import McpServerError, McpToolset
from agent_loop.toolsets.python_sandbox import PythonToolset
from agent_loop.toolsets.task import ToolsetTask

TOOLSETS = ("python", "python_persistent")  # the built-in names of --tools


def is_toolset(spec: str | None) -> bool:
    """Whether ``--tools spec`` names a built-in tool set (not a module of tools)."""
    return spec in TOOLSETS


def load_toolset(name: str):
    """The built-in tool set ``name`` (ValueError if this machine cannot run it)."""
    if name not in TOOLSETS:
        raise ValueError(f"unknown tool set {name!r}; built-in: {', '.join(TOOLSETS)}")
    return PythonToolset(persistent=name == "python_persistent")


def with_toolsets(task, *, tools: str | None = None, mcp_server: Sequence[str] = ()):
    """``task`` with the built-in tool set ``tools`` and the tools of the MCP servers ``mcp_server``
    (command lines or URLs) added to its episodes (ValueError, one line, if they cannot be)."""
    toolsets = [load_toolset(tools)] if tools else []
    if mcp_server:
        try:
            toolsets.append(McpToolset(list(mcp_server)))
        except McpServerError as error:  # the CLI's one line, as for any option that cannot be used
            raise ValueError(str(error)) from None
    return ToolsetTask(task, toolsets) if toolsets else as_task(task)
