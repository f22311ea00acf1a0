"""Tasks, tools and rewards named by a string (the plug-in points of ``--task``, ``--tools``, ``--reward``).

- ``package.module:Name`` or ``path/to/file.py[:Name]`` (``--task``): ``Name`` is a task object, a task
  class (made with no arguments) or a function returning a task. A file without ``:Name`` must define
  exactly one task (a ``TASK`` variable, or one class with ``make_episode`` and ``reward``).
- ``--prompts FILE`` with ``--reward SPEC`` (repeatable) and ``--tools MODULE``: a
  :class:`~agent_loop.tasks.dataset.DatasetTask`. ``SPEC`` is a built-in rule (``exact``, ``number``,
  ``contains``, ``regex:PATTERN``) or ``module:function``. ``MODULE`` (a dotted name or a ``.py`` file)
  gives its ``TOOLS`` list if it has one, else its ``TOOL_SCHEMAS`` (MCP-style) served by its
  ``call_tool(name, arguments)`` or by its functions of those names, else every public function it
  defines (functions it imports from elsewhere are not tools: list them in ``TOOLS`` to serve them).
  A module with no tool is an error.
- A ``.py`` file imports like a script: the modules beside it import (its folder goes on ``sys.path``).

Every failure is a :class:`PluginError` that says which option, what was asked for and what went wrong.
Built-in task names are the registry's (:mod:`agent_loop.tasks.registry`).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Sequence

from agent_loop.episode.contracts import Task, as_task, is_task
from agent_loop.episode.plugin_import import PluginError, import_module, import_object
from agent_loop.episode.tools import tool, tools_from_schemas
from agent_loop.tasks.dataset import DatasetTask
from agent_loop.tasks.rewards import get_rule


def _instantiate(obj: Any, spec: str) -> Any:
    if is_task(obj):
        task = obj
    elif inspect.isclass(obj) or callable(obj):
        try:
            task = obj()
        except Exception as error:
            raise PluginError(f"--task {spec!r}: calling {getattr(obj, '__name__', obj)}() raised "
                              f"{type(error).__name__}: {error}") from error
    else:
        task = obj
    if not is_task(task):
        raise PluginError(f"--task {spec!r} is not a task: a task has make_episode(index, seed) and "
                          "reward(episode, messages, tool_calls) (agent_loop.Environment or DatasetTask)")
    if not isinstance(getattr(task, "name", None), str) or not task.name:
        try:
            task.name = type(task).__name__
        except AttributeError:
            raise PluginError(f"--task {spec!r}: the task needs a string attribute 'name'") from None
    return as_task(task)


def load_plugin_task(spec: str) -> Task:
    """A task from ``package.module:Name`` or a ``.py`` file (see the module docstring)."""
    module, obj = import_object(spec, "--task")
    if obj is None:
        candidates = [getattr(module, "TASK")] if hasattr(module, "TASK") else [
            value for value in vars(module).values()
            if inspect.isclass(value) and value.__module__ == module.__name__
            and callable(getattr(value, "make_episode", None)) and callable(getattr(value, "reward", None))]
        if len(candidates) != 1:
            found = ", ".join(getattr(c, "__name__", "?") for c in candidates) or "none"
            raise PluginError(f"--task {spec!r}: name the task as {spec}:Name (task classes found: {found}; "
                              "or define TASK = ... in the file)")
        obj = candidates[0]
    return _instantiate(obj, spec)


def load_tools(spec: str) -> list[Callable]:
    """The tools of a module or ``.py`` file (see the module docstring)."""
    module = import_module(spec, "--tools")
    if hasattr(module, "TOOLS"):
        functions = list(module.TOOLS)
    elif hasattr(module, "TOOL_SCHEMAS"):
        return tools_from_schemas(module.TOOL_SCHEMAS, getattr(module, "call_tool", module))
    else:
        functions = [value for name, value in vars(module).items()
                     if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")]
    if not functions:
        raise PluginError(f"--tools {spec!r} defines no tool: give it public functions, a TOOLS list, "
                          "or TOOL_SCHEMAS with call_tool(name, arguments)")
    try:
        return [tool(fn) for fn in functions]
    except TypeError as error:
        raise PluginError(f"--tools {spec!r}: {error}") from None


def load_reward(spec: str) -> Callable:
    """A built-in rule name or ``module:function``."""
    if ":" not in spec or spec.startswith("regex:"):
        try:
            return get_rule(spec)
        except ValueError as error:
            raise PluginError(f"--reward: {error}; or module:function") from None
    _, fn = import_object(spec, "--reward")
    if not callable(fn):
        raise PluginError(f"--reward {spec!r} is not a function")
    return fn


def task_from_prompts(prompts: str, reward: Sequence[str], tools: str | None = None,
                      reward_weights: Sequence[float] | None = None, system: str | None = None) -> DatasetTask:
    """The DatasetTask of ``--prompts`` with its ``--reward`` specs and ``--tools`` module."""
    try:
        return DatasetTask(prompts, [load_reward(r) for r in reward], load_tools(tools) if tools else (),
                           reward_weights=reward_weights, system=system, name=Path(prompts).stem)
    except (ValueError, TypeError) as error:
        if isinstance(error, PluginError):
            raise
        raise PluginError(f"--prompts {prompts!r}: {error}") from None
