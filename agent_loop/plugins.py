"""Plug-in points of the command line and the trainer: a task, tools and rewards named by a string.

- ``--task NAME`` (a built-in task), ``--task package.module:Name`` or ``--task path/to/file.py[:Name]``:
  ``Name`` is a task object, a task class (made with no arguments) or a function returning a task.
  A file without ``:Name`` must define exactly one task (a ``TASK`` variable, or one class with
  ``make_episode`` and ``reward``).
- ``--prompts FILE`` with ``--reward SPEC`` (repeatable) and ``--tools MODULE``: a
  :class:`~agent_loop.data_tasks.DatasetTask`. ``SPEC`` is a built-in rule (``exact``, ``number``,
  ``contains``, ``regex:PATTERN``) or ``module:function``. ``MODULE`` (a dotted name or a ``.py`` file)
  gives its ``TOOLS`` list if it has one, else its ``TOOL_SCHEMAS`` (MCP-style) served by its
  ``call_tool(name, arguments)`` or by its functions of those names, else every public function it defines.

Every failure is a :class:`PluginError` that says which option, what was asked for and what went wrong.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from agent_loop.data_tasks import DatasetTask, get_rule


class PluginError(ValueError):
    """A plug-in (task, tools, reward) named on the command line or in a config cannot be used."""


def import_module(spec: str, option: str, shown: str | None = None):
    """A module by dotted name or ``.py`` file path; PluginError with the reason if it does not import
    (naming ``option`` and ``shown``, the string the user gave; default ``spec``)."""
    shown = shown or spec
    path = Path(spec)
    try:
        if spec.endswith(".py") or path.is_file():
            if not path.is_file():
                raise PluginError(f"{option} {shown!r}: file not found")
            name = f"agent_loop_plugin_{path.stem}_{abs(hash(str(path.resolve())))}"
            if name in sys.modules:
                return sys.modules[name]
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
        return importlib.import_module(spec)
    except PluginError:
        raise
    except ModuleNotFoundError as error:
        raise PluginError(f"{option} {shown!r} does not import: {error} "
                          "(a dotted module on the Python path, or a path to a .py file)") from None
    except Exception as error:
        raise PluginError(f"{option} {shown!r} does not import: {type(error).__name__}: {error}") from error


def import_object(spec: str, option: str) -> tuple[Any, Any]:
    """``module:Name`` -> ``(module, object)``; ``module`` alone -> ``(module, None)``."""
    module_part, _, attribute = spec.rpartition(":") if ":" in spec and not _is_drive(spec) else (spec, "", "")
    module = import_module(module_part, option, shown=spec)
    if not attribute:
        return module, None
    if not hasattr(module, attribute):
        public = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attribute, public, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PluginError(f"{option} {spec!r}: module {module_part!r} has no {attribute!r}{hint}")
    return module, getattr(module, attribute)


def _is_drive(spec: str) -> bool:
    return len(spec) > 1 and spec[1] == ":" and spec[0].isalpha() and spec.count(":") == 1  # C:\\tasks.py


def is_task(obj: Any) -> bool:
    return not inspect.isclass(obj) and callable(getattr(obj, "make_episode", None)) and callable(getattr(obj, "reward", None))


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
    if not isinstance(getattr(task, "name", None), str):
        try:
            task.name = type(task).__name__
        except AttributeError:
            raise PluginError(f"--task {spec!r}: the task needs a string attribute 'name'") from None
    return task


def load_task(spec: str) -> Any:
    """A task from a built-in name, ``package.module:Name`` or a ``.py`` file (see the module docstring)."""
    from agent_loop.tasks import TASKS, get_task

    if spec in TASKS:
        return get_task(spec)
    if ":" not in spec and not spec.endswith(".py") and not Path(spec).is_file():
        close = difflib.get_close_matches(spec, list(TASKS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PluginError(f"--task {spec!r} is not a built-in task ({', '.join(TASKS)}); {hint}"
                          "a custom task is package.module:Name or path/to/file.py[:Name]")
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
    from agent_loop.data_tasks import tool, tools_from_schemas

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


def task_from_options(task: str | None = None, prompts: str | None = None, tools: str | None = None,
                      reward: Sequence[str] | str | None = None, reward_weights: Sequence[float] | None = None,
                      system: str | None = None, default_task: str = "arithmetic") -> Any:
    """The task that the command-line options ``--task/--prompts/--tools/--reward`` name.

    With ``--prompts``: a DatasetTask (``--reward`` required, ``--task`` must not be given).
    Without it: ``--task`` (default ``default_task``); ``--tools``/``--reward`` then are an error, since a
    task brings its own tools and reward.
    """
    rewards = [reward] if isinstance(reward, str) else list(reward or [])
    if prompts is None:
        if tools or rewards:
            given = " and ".join(o for o, v in (("--tools", tools), ("--reward", rewards)) if v)
            raise PluginError(f"{given} apply to a task from --prompts FILE; a --task brings its own tools and reward")
        return load_task(task or default_task)
    if task is not None:
        raise PluginError("give either --task or --prompts, not both")
    if not rewards:
        raise PluginError("--prompts needs a reward: --reward exact|number|contains|regex:PATTERN|module:function")
    try:
        return DatasetTask(prompts, [load_reward(r) for r in rewards], load_tools(tools) if tools else (),
                           reward_weights=reward_weights, system=system, name=Path(prompts).stem)
    except (ValueError, TypeError) as error:
        if isinstance(error, PluginError):
            raise
        raise PluginError(f"--prompts {prompts!r}: {error}") from None
