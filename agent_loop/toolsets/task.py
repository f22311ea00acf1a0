"""A task with tool sets added to its episodes, and the environment that plays their tools."""

from __future__ import annotations

import asyncio
from typing import Sequence

from agent_loop.episode.contracts import TaskWrapper, as_task
from agent_loop.episode.tools import Tool, ToolEnvironment
from agent_loop.types import Episode


class ToolsetEnvironment(ToolEnvironment):
    """The tool environment, which first lets each tool set get ready for a turn's calls (``prepare(names)``:
    an MCP server starting, bounded by its own startup timeout rather than by the calls' ``tool_timeout_s``)."""

    def __init__(self, functions: Sequence, *, on_close: Sequence = (), on_step: Sequence = ()):
        super().__init__(functions, on_close=on_close)
        self.on_step = list(on_step)

    async def step(self, turn, limits):
        if turn.calls and not turn.final:
            names = {getattr(call, "name", None) for call in turn.calls} - {None}
            await asyncio.gather(*(prepare(names) for prepare in self.on_step))
        return await super().step(turn, limits)


def _shared(tools, hook: str) -> list:
    """The distinct ``hook`` callables the tools carry (the tools of one tool set share one per episode)."""
    return list({id(h): h for fn in tools if (h := getattr(fn, hook, None)) is not None}.values())


class ToolsetTask(TaskWrapper):
    """``task`` with the tools of ``toolsets`` added to each of its episodes (agent_loop.toolsets); every other
    hook is the task's (:class:`~agent_loop.episode.contracts.TaskWrapper`), and so are its other attributes."""

    def __init__(self, task, toolsets: Sequence):
        super().__init__(as_task(task))
        self.toolsets = list(toolsets)
        self.make_episode(0, 0)  # a name clash is refused now, before any episode is played

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        episode = super().make_episode(index, seed)
        if episode.environment is not None:
            raise ValueError(f"task {self.name!r} answers its turns with an environment of its own: tool sets "
                             "(--tools python, --mcp-server) add tools to tasks whose episodes use tools")
        added = [fn for toolset in self.toolsets for fn in toolset.tools()]
        names = [Tool.from_function(fn).name for fn in [*episode.tools, *added]]
        clashes = sorted({n for n in names if names.count(n) > 1})
        if clashes:
            raise ValueError(f"tool name(s) {', '.join(map(repr, clashes))} given twice (by task {self.name!r} and "
                             f"{' and '.join(t.name for t in self.toolsets)}): rename one, or leave one out")
        episode.environment = ToolsetEnvironment([*episode.tools, *added], on_close=_shared(added, "aclose"),
                                                 on_step=_shared(added, "prepare"))
        episode.tools = []
        return episode

    def __getattr__(self, name: str):  # the task's own attributes (its dataset, size, ...) read through
        if name in ("task", "toolsets") or name.startswith("__"):  # unpickling: not set yet, no recursion
            raise AttributeError(name)
        return getattr(self.task, name)
