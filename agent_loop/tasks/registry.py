"""The one task registry behind ``--task``, and the options that name a task.

Adding a built-in task: a module with a :class:`~agent_loop.episode.contracts.Task` subclass, and its line in
:data:`TASKS`. Tasks of another library are ``SOURCE:NAME`` (:data:`SOURCES`: ``reasoning_gym:chain_sum``,
``skyrl_gym:gsm8k``; :mod:`agent_loop.ecosystem`), with ``task_options``. Any other task is a plug-in
(``package.module:Name``, ``file.py[:Name]``: see :mod:`agent_loop.tasks.plugins`) or a task from data
(``--prompts`` with ``--reward`` and ``--tools``).
"""

from __future__ import annotations

import difflib
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

from agent_loop.episode.contracts import Task
from agent_loop.options import OptionError, closest, one_of
from agent_loop.tasks.plugins import PluginError, load_plugin_task, task_from_prompts
from agent_loop.toolsets import is_toolset, with_toolsets

TASKS = {  # name -> "module:Class" (a Task subclass made with no arguments)
    "arithmetic": "agent_loop.tasks.builtin:ArithmeticTask",
    "lookup": "agent_loop.tasks.builtin:LookupTask",
    "chain": "agent_loop.tasks.builtin:ChainTask",
    "keydoor": "agent_loop.tasks.keydoor:KeyDoorTask",
}
DEFAULT_TASK = "arithmetic"
SOURCES = {  # --task SOURCE:NAME -> its module (agent_loop.ecosystem: names(), NEEDS_PROMPTS, load(), REFUSED)
    "reasoning_gym": "agent_loop.ecosystem.reasoning_gym",
    "skyrl_gym": "agent_loop.ecosystem.skyrl_gym",
    "verifiers": "agent_loop.ecosystem.verifiers",  # in its side environment (scripts/side_envs/verifiers.txt)
}


def split_source(spec: str) -> tuple[str, str] | None:
    """``"reasoning_gym:chain_sum"`` -> ``("reasoning_gym", "chain_sum")``; None for a spec of no source."""
    source, sep, name = spec.partition(":")
    return (source, name) if sep and source in SOURCES else None


def source_module(spec: str):
    """The module of ``spec``'s source, its library imported; ValueError naming the package when it is missing."""
    source, _ = split_source(spec)
    try:
        return importlib.import_module(SOURCES[source])
    except ModuleNotFoundError as error:
        raise ValueError(f"--task {spec}: {error.name!r} is not installed (pip install "
                         f"{source.replace('_', '-')}; docs/ecosystem.md)") from None


def check_source(spec: str) -> None:
    """ValueError (one line, with "did you mean") unless ``spec``'s source knows its name."""
    module, (source, name) = source_module(spec), split_source(spec)
    if name in getattr(module, "REFUSED", {}):
        raise ValueError(f"--task {spec}: {module.REFUSED[name]}")
    known = module.names()
    if name not in known:
        raise ValueError(f"--task {spec}: no {source} task {name!r}{closest(name, known)} "
                         f"({len(known)} known; docs/ecosystem.md)")


def parse_task_options(value: Any) -> Any:
    """``--task-options`` text as a mapping: a JSON object, or ``KEY=VALUE,KEY=VALUE`` (each VALUE read as JSON
    when it is JSON, else as text); a mapping (from a config file) as it is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError as error:
            raise ValueError(f"not a JSON object: {error}") from None
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{item!r} is not KEY=VALUE")
        try:
            options[key.strip()] = json.loads(raw)
        except ValueError:
            options[key.strip()] = raw
    return options


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


def load_source_task(spec: str, *, prompts: str | None = None, options: dict | None = None,
                     system: str | None = None) -> Task:
    """The task of ``SOURCE:NAME`` (:data:`SOURCES`) with its options; PluginError (one line) if it cannot load."""
    try:
        check_source(spec)
        return source_module(spec).load(split_source(spec)[1], prompts=prompts, options=options, system=system)
    except (ValueError, TypeError) as error:  # TypeError: a task option the source does not take
        text = str(error)
        text = text if text.startswith("--task") else f"--task {text}" if text.startswith(spec) else f"--task {spec}: {text}"
        raise PluginError(text) from None


def load_task(spec: str) -> Task:
    """A task from a built-in name, ``SOURCE:NAME`` (default options), ``package.module:Name`` or a ``.py`` file;
    PluginError if it cannot load."""
    if spec in TASKS:
        return get_task(spec)
    if split_source(spec) is not None:
        return load_source_task(spec)
    if not is_plugin(spec):
        close = difflib.get_close_matches(spec, list(TASKS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PluginError(f"--task {spec!r} is not a built-in task ({', '.join(TASKS)}); {hint}"
                          "a custom task is package.module:Name or path/to/file.py[:Name]")
    return load_plugin_task(spec)


@dataclass
class DataTaskOptions:
    """How the rows of a task from data are scored and prompted: agent-loop's ``--prompts`` rows, and verl's
    dataset rows in our verl AgentLoop (``agent_loop.integrations.verl_options``). Declared once, for both."""

    reward: Annotated[list[str], Field(description="reward of --prompts: exact, number, contains, regex:PATTERN "
                                       "or module:function (repeatable)",
                                       json_schema_extra={"allowed": "a rule or module:function, repeatable"})] = \
        field(default_factory=list)
    reward_weights: Annotated[list[float] | None, Field(description="one weight per --reward",
                                                        json_schema_extra={"allowed": "numbers", "nargs": "+"})] = None
    system: Annotated[str | None, Field(description="system prompt of --prompts episodes",
                                        json_schema_extra={"allowed": "text"})] = None


@dataclass
class SeedOptions:
    """The seed: every command that plays or trains on a task, and our verl AgentLoop (declared once)."""

    seed: Annotated[int, Field(ge=0, description="seed of the questions (the task's episode stream) and of each "
                               "request's sampling (inside verl, verl seeds its own sampling)")] = 0


@dataclass
class TaskChoice:
    """Which task: the commands' ``--task`` and our verl AgentLoop's ``task`` key (declared once)."""

    task: Annotated[str, AfterValidator(check_task), Field(
        description="task to play: a built-in name, SOURCE:NAME of another library (reasoning_gym:chain_sum, "
                    "skyrl_gym:gsm8k; docs/ecosystem.md), package.module:Name or path/to/file.py[:Name]",
        json_schema_extra={"allowed": task_names})] = DEFAULT_TASK


@dataclass
class TaskSourceOptions(TaskChoice):
    """Where the episodes come from: a task, or a prompts file (declared before the row options, so the help
    names --task first)."""

    prompts: Annotated[str | None, Field(description="a task from data: its prompts file (.jsonl, .parquet or a "
                                         "saved Hugging Face dataset folder)",
                                         json_schema_extra={"allowed": "a file or folder"})] = None


@dataclass
class TaskOptions(DataTaskOptions, TaskSourceOptions):
    """Which task to play: a registered or plug-in ``task``, or a task from data (``prompts`` with
    ``reward`` and ``tools``). Shared by ``agent-loop rollout`` and ``train``."""

    tools: Annotated[str | None, Field(description="tools of --prompts: a module or .py file of functions; or a "
                                       "built-in tool set added to any task's tools: python (sandboxed code, a "
                                       "fresh interpreter per call), python_persistent (one per episode)",
                                       json_schema_extra={"allowed": "a module or .py file, python, python_persistent"})] = None
    mcp_server: Annotated[list[str], Field(description="an MCP server whose tools are added to the task's: a command "
                                           "line (stdio, e.g. 'python server.py') or http://HOST:PORT/mcp (streamable "
                                           "HTTP); one session per episode (repeatable)",
                                           json_schema_extra={"allowed": "a command line or URL, repeatable"})] = \
        field(default_factory=list)
    task_options: Annotated[dict, BeforeValidator(parse_task_options), Field(
        description="options of a SOURCE:NAME task (reasoning_gym: size, seed, calculator, generator config; "
                    "skyrl_gym: the env_config); a mapping in a config file",
        json_schema_extra={"allowed": "KEY=VALUE,... or a JSON object"})] = field(default_factory=dict)

    def check(self) -> None:
        """The rules that tie the task options together (OptionError)."""
        if split_source(self.task) is not None:
            return self._check_source()
        if self.task_options:
            raise OptionError(None, "{task_options} apply to a SOURCE:NAME {task} ("
                              + ", ".join(f"{s}:NAME" for s in SOURCES) + ")")
        if self.prompts is None:
            given = [name for name in ("tools", "reward") if getattr(self, name) and not (
                name == "tools" and is_toolset(self.tools))]  # a built-in tool set adds to any task
            if given:
                raise OptionError(None, " and ".join("{%s}" % n for n in given) + " apply to a task from {prompts} "
                                  "FILE; a {task} brings its own tools and reward")
            return
        if self.task != DEFAULT_TASK:
            raise OptionError(None, "give either {task} or {prompts}, not both")
        if not self.reward:
            raise OptionError(None, "{prompts} needs a reward: {reward} exact|number|contains|regex:PATTERN|module:function")

    def _check_source(self) -> None:
        try:
            check_source(self.task)
            needs_prompts = source_module(self.task).NEEDS_PROMPTS
        except ValueError as error:
            text = str(error).replace("{", "{{").replace("}", "}}")
            raise OptionError(None, text.replace("--task", "{task}", 1)) from None
        if self.reward:
            raise OptionError(None, "{reward} applies to a task from {prompts}: a SOURCE:NAME {task} scores itself")
        if needs_prompts and self.prompts is None:
            raise OptionError(None, f"{{task}} {self.task} plays rows: give {{prompts}} ROWS")
        if not needs_prompts and self.prompts is not None:
            raise OptionError(None, f"{{task}} {self.task} makes its own episodes: drop {{prompts}}")
        if self.tools and not is_toolset(self.tools):
            raise OptionError(None, "{tools} MODULE applies to a task from {prompts}")

    def load(self) -> Task:
        """The task these options name (checked first); PluginError if a plug-in cannot be used."""
        self.check()
        toolset = self.tools if is_toolset(self.tools) else None
        if split_source(self.task) is not None:
            task = load_source_task(self.task, prompts=self.prompts, options=self.task_options, system=self.system)
        elif self.prompts is None:
            task = load_task(self.task)
        else:
            task = task_from_prompts(self.prompts, self.reward, None if toolset else self.tools, self.reward_weights,
                                     self.system)
        return with_toolsets(task, tools=toolset, mcp_server=self.mcp_server) if toolset or self.mcp_server else task
