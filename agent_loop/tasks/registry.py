"""The one task registry behind ``--task``, and the options that name a task.

Adding a built-in task: a module with a :class:`~agent_loop.tasks.base.Task` subclass, and its line in
:data:`TASKS`. Any other task is a plug-in (``package.module:Name``, ``file.py[:Name]``: see
:mod:`agent_loop.tasks.plugins`) or a task from data (``--prompts`` with ``--reward`` and ``--tools``).
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from agent_loop.config import OptionError, closest, one_of
from agent_loop.tasks.base import Task

TASKS = {  # name -> "module:Class" (a Task subclass made with no arguments)
    "arithmetic": "agent_loop.tasks.builtin:ArithmeticTask",
    "lookup": "agent_loop.tasks.builtin:LookupTask",
    "chain": "agent_loop.tasks.builtin:ChainTask",
}
DEFAULT_TASK = "arithmetic"


def get_task(name: str) -> Task:
    """A new instance of the built-in task ``name``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    module, _, cls = TASKS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def task_names() -> str:
    return one_of(sorted(TASKS))


def is_plugin(spec: str) -> bool:
    return ":" in spec or spec.endswith(".py") or Path(spec).is_file()


def check_task(spec: str) -> str:
    """A registered task name, or a plug-in (``package.module:Name``, ``file.py[:Name]``: loaded later)."""
    if spec not in TASKS and not is_plugin(spec):
        raise ValueError(f"unknown task{closest(spec, TASKS)} (choose {task_names()})")
    return spec


def load_task(spec: str) -> Task:
    """A task from a built-in name, ``package.module:Name`` or a ``.py`` file; PluginError if it cannot load."""
    from agent_loop.tasks.plugins import PluginError, load_plugin_task  # tools and data load transformers

    if spec in TASKS:
        return get_task(spec)
    if not is_plugin(spec):
        close = difflib.get_close_matches(spec, list(TASKS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PluginError(f"--task {spec!r} is not a built-in task ({', '.join(TASKS)}); {hint}"
                          "a custom task is package.module:Name or path/to/file.py[:Name]")
    return load_plugin_task(spec)


@dataclass
class TaskOptions:
    """Which task to play: a registered or plug-in ``task``, or a task from data (``prompts`` with
    ``reward`` and ``tools``). Shared by ``agent-loop rollout`` and ``train``."""

    task: Annotated[str, AfterValidator(check_task), Field(
        description="task to play: a built-in name, package.module:Name or path/to/file.py[:Name]",
        json_schema_extra={"allowed": task_names})] = DEFAULT_TASK
    prompts: Annotated[str | None, Field(description="a task from data: its prompts file (.jsonl, .parquet or a "
                                         "saved Hugging Face dataset folder)",
                                         json_schema_extra={"allowed": "a file or folder"})] = None
    reward: Annotated[list[str], Field(description="reward of --prompts: exact, number, contains, regex:PATTERN "
                                       "or module:function (repeatable)",
                                       json_schema_extra={"allowed": "a rule or module:function, repeatable"})] = \
        field(default_factory=list)
    reward_weights: Annotated[list[float] | None, Field(description="one weight per --reward",
                                                        json_schema_extra={"allowed": "numbers", "nargs": "+"})] = None
    tools: Annotated[str | None, Field(description="tools of --prompts: a module or .py file of functions",
                                       json_schema_extra={"allowed": "a module or .py file"})] = None
    system: Annotated[str | None, Field(description="system prompt of --prompts episodes",
                                        json_schema_extra={"allowed": "text"})] = None

    def check(self) -> None:
        """The rules that tie the task options together (OptionError)."""
        if self.prompts is None:
            given = [name for name in ("tools", "reward") if getattr(self, name)]
            if given:
                raise OptionError(None, " and ".join("{%s}" % n for n in given) + " apply to a task from {prompts} "
                                  "FILE; a {task} brings its own tools and reward")
            return
        if self.task != DEFAULT_TASK:
            raise OptionError(None, "give either {task} or {prompts}, not both")
        if not self.reward:
            raise OptionError(None, "{prompts} needs a reward: {reward} exact|number|contains|regex:PATTERN|module:function")

    def load(self) -> Task:
        """The task these options name (checked first); PluginError if a plug-in cannot be used."""
        self.check()
        if self.prompts is None:
            return load_task(self.task)
        from agent_loop.tasks.plugins import task_from_prompts

        return task_from_prompts(self.prompts, self.reward, self.tools, self.reward_weights, self.system)
