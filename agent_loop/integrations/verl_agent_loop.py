"""Our episode loop as a verl AgentLoop, registered in verl's agent-loop registry as ``agent_loop`` when this
module imports (docs/verl.md, "Our agent loop inside verl").

verl's ``AgentLoopWorker`` makes one :class:`AgentLoop` per dataset row and awaits its ``run``; we play one
episode with :func:`agent_loop.episode.loop.run_episode` (token-in/token-out chat formatting, our tool-call
parsers, our tool execution, the task's reward) against verl's server manager
(:class:`~agent_loop.integrations.verl_backend.VerlServerBackend`), and return verl's ``AgentLoopOutput``:
``response_mask`` is our spans (1 ASSISTANT, 0 OBSERVATION), ``response_logprobs`` the sampling logprobs,
and ``extra_fields`` (which verl's worker turns into ``non_tensor_batch`` columns) hold ``spans``,
``turn_ids``, ``tool_calls`` (our records as dicts), ``messages``, ``finish_reason``, ``truncated``,
``reward_source``, ``agent_loop_reward``, ``turn_scores`` (our per-turn rewards) and ``tool_rewards``.

Options (:class:`~agent_loop.integrations.verl_options.VerlLoopOptions`) come from the trainer config's top-level ``agent_loop`` section
(``+agent_loop.task=arithmetic`` on verl's command line) and, overriding it, from the keys of an entry in
verl's ``agent_loop_config_path`` file (``- name: my_loop`` / ``_target_: ...verl_agent_loop.AgentLoop`` /
``task: ...``). This module imports verl; the backend and everything else it uses do not.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
from typing import Any, Callable
from uuid import uuid4

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.tools.function_tool import FunctionTool, normalize_function_tool_return
from verl.utils.ray_utils import get_event_loop

from agent_loop.episode.contracts import Task, TaskWrapper, as_task
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tool_formats import TOOL_FORMATS
from agent_loop.episode.tools import Tool, tools_from_schemas
from agent_loop.integrations.verl_backend import VerlServerBackend
from agent_loop.integrations.verl_options import VerlLoopOptions
from agent_loop.tasks.dataset import DatasetTask
from agent_loop.tasks.plugins import load_reward, load_tools
from agent_loop.tasks.registry import load_task
from agent_loop.types import Episode, Trajectory
from masking.kinds import SpanKind

AGENT_NAME = "agent_loop"
# the keyword arguments verl 0.9's AgentLoopWorker gives every agent loop (besides tools=)
VERL_KWARGS = frozenset({"trainer_config", "server_manager", "tokenizer", "processor", "dataset_cls", "data_config",
                         "hf_model_type"})
logger = logging.getLogger(__name__)


def options_from(trainer_config, kwargs: dict) -> VerlLoopOptions:
    """The options of the trainer config's ``agent_loop`` section, overridden by ``kwargs`` (the keys of an
    ``agent_loop_config_path`` entry other than verl's ``name``)."""
    return _options(_options_text(_agent_loop_section(trainer_config), kwargs))


def _agent_loop_section(trainer_config) -> dict:
    """The trainer config's ``agent_loop`` section as a container ({} when it has none)."""
    section = trainer_config.get("agent_loop") if trainer_config is not None else None
    return OmegaConf.to_container(section, resolve=True) if section is not None else {}


def _options_text(values: dict, kwargs: dict) -> str:
    """:func:`options_from`'s options as sorted JSON (the key of the per-config caches): the ``agent_loop``
    section's ``values`` overridden by ``kwargs``."""
    given = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in kwargs.items()}
    return json.dumps({**values, **given}, sort_keys=True, default=str)


@dataclasses.dataclass(frozen=True)
class _ConfigSettings:
    """What the AgentLoop reads from verl's trainer config, read once per config object (verl hands every row
    of a worker the same one)."""

    values: dict  # the agent_loop section as a container
    response_length: int
    prompt_length: int
    max_assistant_turns: int | None
    full_determinism: bool


_SETTINGS: dict[int, tuple[Any, _ConfigSettings]] = {}  # id(trainer config) -> (that config, its settings)


def _config_settings(config) -> _ConfigSettings:
    """:class:`_ConfigSettings` of the trainer config ``config``, kept per config object (the entry holds the
    object, so its id is not reused while kept): OmegaConf reads and ``to_container`` cost ~0.1 ms a row."""
    kept = _SETTINGS.get(id(config))
    if kept is not None and kept[0] is config:
        return kept[1]
    rollout = config.actor_rollout_ref.rollout
    turns = rollout.multi_turn.get("max_assistant_turns")
    settings = _ConfigSettings(_agent_loop_section(config), int(rollout.response_length), int(rollout.prompt_length),
                               int(turns) if turns else None, bool(rollout.get("full_determinism", False)))
    if len(_SETTINGS) >= 16:
        _SETTINGS.clear()
    _SETTINGS[id(config)] = (config, settings)
    return settings


@functools.lru_cache(maxsize=64)
def _options(text: str) -> VerlLoopOptions:  # verl makes an AgentLoop per row: parse each config once
    return VerlLoopOptions.from_mapping(json.loads(text))


@functools.lru_cache(maxsize=64)
def _loop_config(text: str, response_length: int, max_assistant_turns: int | None) -> LoopConfig:
    """The LoopConfig of the options ``text`` (validated once per options and verl budget, not once per row)."""
    options = _options(text)
    config = options.loop_config(response_length)
    if max_assistant_turns and "max_turns" not in options.loop:
        config.max_turns = int(max_assistant_turns)
    return config


@functools.lru_cache(maxsize=16)
def _task(spec: str) -> Task:
    return as_task(load_task(spec))


@functools.lru_cache(maxsize=16)
def _tool_functions(spec: str) -> tuple[Callable, ...]:
    return tuple(load_tools(spec))


@functools.lru_cache(maxsize=16)
def _rewards(specs: tuple[str, ...]) -> tuple[Callable, ...]:
    return tuple(load_reward(s) for s in specs)


def _no_reward() -> float:
    """Row episodes that verl's reward manager scores: our loop still needs a reward function."""
    return 0.0


# --- verl's tools as ours -----------------------------------------------------------------------------


def verl_tool_functions(verl_tools: list, tools_kwargs: dict | None, tool_rewards: list[float]) -> list[Callable]:
    """verl's tools (``BaseTool`` subclasses and ``FunctionTool``) as our tool functions, for one episode.

    Each call runs as verl's ``ToolAgentLoop`` runs it: a ``FunctionTool`` is called with the arguments; a
    ``BaseTool`` gets ``create(create_kwargs=tools_kwargs[name]["create_kwargs"])``, ``execute`` and
    ``release``. The model reads the response's text; the tool reward is appended to ``tool_rewards``.
    Failures are our tool errors (the model reads them; the record says ``exception``).
    """
    if not verl_tools:
        return []
    by_name = {tool.name: tool for tool in verl_tools}
    kwargs_of = dict(tools_kwargs or {})

    async def call_tool(name: str, arguments: dict):
        tool = by_name[name]
        if isinstance(tool, FunctionTool):
            response, reward, _ = normalize_function_tool_return(await tool.call(arguments))
        else:
            create = (kwargs_of.get(name) or {}).get("create_kwargs", {})
            instance_id, _ = await tool.create(create_kwargs=create)
            try:
                response, reward, _ = await tool.execute(instance_id, arguments)
            finally:
                await tool.release(instance_id)
        if getattr(response, "image", None) or getattr(response, "video", None):
            raise ValueError(f"tool {name!r} returned an image or video: the agent_loop AgentLoop is text-only")
        if reward is not None:
            tool_rewards.append(float(reward))
        return response.text or ""

    return tools_from_schemas(list(_verl_schemas(tuple(verl_tools))), call_tool)


@functools.lru_cache(maxsize=16)
def _verl_schemas(verl_tools: tuple) -> tuple[dict, ...]:
    """The tools' schemas as dicts, once per tool list (verl gives every row the worker's same tools)."""
    return tuple(tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in verl_tools)


# --- the episode of a row ------------------------------------------------------------------------------


class _Prepared(TaskWrapper):
    """``task`` with its episode already made (from a verl row): the loop plays that one episode; every other
    hook is the task's."""

    def __init__(self, task: Task, episode: Episode):
        super().__init__(task)
        self.episode = episode

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        return self.episode


def _plain(value: Any) -> Any:
    """A verl row value (numpy arrays and scalars from parquet) as plain Python."""
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def episode_for_row(options: VerlLoopOptions, row: dict, extra_tools: list[Callable]) -> _Prepared:
    """The episode verl's row ``row`` (the AgentLoop's ``run`` kwargs) plays, with its task; ValueError naming
    the row's index for a row that cannot be played."""
    index = int(_plain(row.get("index", 0)) or 0)
    ground_truth = (_plain(row.get("reward_model")) or {}).get("ground_truth")
    tools = list(extra_tools) + (list(_tool_functions(options.tool_functions)) if options.tool_functions else [])
    try:
        if options.task:
            task = _task(options.task)
            episode = task.make_episode(index, options.seed)
            episode.tools = list(episode.tools) + tools
            if episode.answer is None:
                episode.answer = ground_truth
        else:
            data = {"prompt": _plain(row.get("raw_prompt")), "answer": ground_truth,
                    **{k: _plain(row[k]) for k in ("data_source", "extra_info") if k in row}}
            rewards = _rewards(tuple(options.reward)) if options.reward else [_no_reward]
            task = DatasetTask([data], list(rewards), tools, reward_weights=options.reward_weights,
                               system=options.system, name="verl")
            episode = task.make_episode(0)
    except ValueError as error:
        raise ValueError(f"verl row with index {index}: {error}") from None
    names = [Tool.from_function(fn).name for fn in episode.tools]
    if len(set(names)) != len(names):
        raise ValueError(f"verl row with index {index}: two tools share a name: {sorted(names)}")
    if options.tool_format:
        episode.tool_format = next(f for f in TOOL_FORMATS if f.name == options.tool_format)
    episode.info.update({"verl_index": index, "ground_truth": _plain(ground_truth)})
    return _Prepared(task, episode)


# --- the AgentLoop -------------------------------------------------------------------------------------


_BASES: dict[tuple, tuple[tuple, dict]] = {}  # ids of verl's arguments -> (those objects, the attributes they gave)


def _init_verl_base(loop: AgentLoopBase, args: tuple, kwargs: dict) -> None:
    """verl's ``AgentLoopBase.__init__`` of ``loop``, run once per set of verl's arguments: verl gives every row
    of a worker the same config, server manager, tokenizer, processor and dataset class, and the base's
    attributes (its Continuous Token builder, ~0.2 ms with a ``tokenizer.encode``, which our loop does not use;
    configuration only) are the same for each; later rows take a copy of them (a fresh dict for each dict
    attribute) and their own ``loop`` (the running event loop, as verl's ``__init__`` reads it). Positional
    arguments or keys verl 0.9 does not pass: verl's ``__init__`` every time."""
    if args or not set(kwargs) <= VERL_KWARGS:
        AgentLoopBase.__init__(loop, *args, **kwargs)
        return
    objects = tuple(getattr(kwargs.get(k), "config", kwargs.get(k)) if k in ("trainer_config", "data_config")
                    else kwargs.get(k) for k in sorted(VERL_KWARGS))
    key = tuple(map(id, objects))
    kept = _BASES.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], objects)):
        loop.__dict__.update({k: dict(v) if type(v) is dict else v for k, v in kept[1].items()})
        loop.loop = get_event_loop()
        return
    AgentLoopBase.__init__(loop, **kwargs)
    if len(_BASES) >= 16:
        _BASES.clear()
    _BASES[key] = (objects, {k: dict(v) if type(v) is dict else v for k, v in vars(loop).items()})


@register(AGENT_NAME)
class AgentLoop(AgentLoopBase):
    """verl's agent loop that plays our episode loop (module docstring). verl makes one per row."""

    def __init__(self, *args, tools=None, **kwargs):
        # what is not verl's (AgentLoopBase's arguments, an agent_loop_config_path entry's name) is ours
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k not in VERL_KWARGS}
        ours.pop("name", None)
        _init_verl_base(self, args, kwargs)
        settings = self.settings = _config_settings(self.config)
        text = _options_text(settings.values, ours)
        self.options = _options(text)
        self.verl_tools = list(tools.tools) if tools is not None else []
        self.response_length, self.prompt_length = settings.response_length, settings.prompt_length
        self.loop_config = copy.copy(_loop_config(text, self.response_length, settings.max_assistant_turns))

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        tool_rewards: list[float] = []
        task = episode_for_row(self.options, kwargs, verl_tool_functions(
            self.verl_tools, _plain(kwargs.get("tools_kwargs")), tool_rewards))
        priority = int(_plain(kwargs.get("priority", 0)) or 0)
        request_id = f"det-{priority}" if self.settings.full_determinism else uuid4().hex
        backend = VerlServerBackend(self.server_manager, sampling_params, request_id)
        index = task.episode.info["verl_index"]
        trajectory = await run_episode(task, index, backend, self.tokenizer, self.loop_config, seed=self.options.seed,
                                       prompt_check=functools.partial(self._check_prompt, index=index))
        if trajectory.metrics.get("backend_error"):  # as verl's own loops: a failed server fails the step
            raise RuntimeError(f"verl row with index {task.episode.info['verl_index']}: generation failed: "
                               f"{trajectory.metrics['backend_error']}")
        return self.output(trajectory, backend, tool_rewards)

    def _check_prompt(self, prompt_ids: list[int], *, index: int) -> None:
        """A prompt longer than verl's ``prompt_length`` is an error before anything is generated (cutting it,
        as verl's own loops do, would train on a context the model never saw). The loop calls it with the prompt
        it rendered (``run_episode(prompt_check=)``): the prompt is rendered once."""
        if len(prompt_ids) > self.prompt_length:
            raise ValueError(f"verl row with index {index}: the prompt has {len(prompt_ids)} tokens, more than "
                             f"rollout.prompt_length={self.prompt_length}; raise it or shorten the prompt")

    def output(self, trajectory: Trajectory, backend: VerlServerBackend, tool_rewards: list[float]) -> AgentLoopOutput:
        """verl's output of a played episode, cut to ``response_length`` (``truncated`` says so)."""
        n = self.response_length
        spans = trajectory.spans[:n]
        cut = len(trajectory.response_ids) > n
        scores = self.options.scores
        turns = trajectory.metrics.get("turn_tokens", [])
        extra = {
            "spans": spans, "turn_ids": trajectory.turn_ids[:n],
            "tool_calls": [dataclasses.asdict(r) for r in trajectory.tool_calls],
            "messages": trajectory.messages,
            "finish_reason": "length" if cut else trajectory.finish_reason,
            "truncated": bool(cut or trajectory.truncated),
            "reward_source": scores, "agent_loop_reward": trajectory.reward,
            "turn_scores": list(trajectory.turn_rewards or []), "tool_rewards": tool_rewards,
            "agent_loop_info": _plain(json.loads(json.dumps(trajectory.info, default=str))),
        }
        return AgentLoopOutput(
            prompt_ids=trajectory.prompt_ids,
            response_ids=trajectory.response_ids[:n],
            response_mask=[int(s == SpanKind.ASSISTANT) for s in spans],
            response_logprobs=trajectory.logprobs[:n] if backend.logprobs_given else None,
            reward_score=trajectory.reward if scores == "agent_loop" else None,
            num_turns=1 + len(turns) + sum(1 for t in turns if t.get("observation")),  # verl: user + assistant + tool
            metrics=AgentLoopMetrics(generate_sequences=trajectory.metrics.get("generate_s", 0.0),
                                     tool_calls=trajectory.metrics.get("tools_s", 0.0),
                                     num_preempted=backend.num_preempted),
            extra_fields=extra,
        )
