"""verifiers (v1) environments: ``--task verifiers:ID`` (docs/ecosystem.md), in the side environment
``.side-envs/verifiers`` (``bash scripts/side_env.sh verifiers``: verifiers 0.4.0 pins mcp 2.0 and openai<3).

``ID`` is a verifiers taskset id as ``vf-eval`` takes it: an importable module (an installed environment
package, or a module on ``PYTHONPATH``) exporting a ``vf.Taskset`` subclass via ``__all__``; the task options
are its ``TasksetConfig`` fields (``env``: a dict of the ``EnvConfig`` fields, ``limit``: the first N tasks).
Episode ``i`` plays task ``i % len(tasks)``: its ``system_prompt`` and ``prompt`` are the prompt.

- The reward is the task's own scoring (``Task.score``: its ``@vf.reward`` functions, weighted, summed as
  ``trace.reward``) on a verifiers ``Trace`` of the episode's messages; its ``@vf.metric`` values and each
  reward are the episode's task metrics.
- Tools: the task's and taskset's ``vf.Toolset`` servers, registered in process on the MCP SDK's server
  (``Toolset.register``) and called through it; their listed input schemas are what the template renders.
  A turn without tool calls ends a single-agent episode.
- Multi-turn: a taskset whose package exports a ``vf.Env`` subclass (the v1 form of ``MultiTurnEnv``) plays
  through its own ``run(task, agents)``: each ``interaction.turn(message)`` hands the model's reply to the
  environment and its next message back to the loop as the observation; ``run`` returning ends the episode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import pkgutil

from verifiers.v1 import AgentConfig, Segment, SingleAgentEnv, Trace
from verifiers.v1.dialects.chat import parse_message
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.types import AssistantMessage
from verifiers.v1.utils import loaders

from agent_loop.episode.contracts import AssistantTurn, StepLimits, StepResult, Task, TurnEnvironment
from agent_loop.episode.tools import ToolEnvironment, tools_from_schemas
from agent_loop.options import closest
from agent_loop.toolsets.mcp import result_text
from agent_loop.types import Episode, ToolCallRecord

NEEDS_PROMPTS = False
BUILTIN = ("harbor", "nemo_gym", "openenv", "textarena")  # verifiers' own tasksets: containers or services
REFUSED = {name: f"verifiers:{name} runs its tasks in a container or a hosted service (docker, prime sandboxes, "
           "a cloud account); not supported (docs/ecosystem.md)" for name in BUILTIN}


def names() -> list[str]:
    """The importable top-level modules (a verifiers taskset id is one); load() says when one is no taskset."""
    return sorted({m.name for m in pkgutil.iter_modules()} - set(REFUSED))


def run_sync(coroutine):
    """``coroutine``'s result, run on an event loop of its own (the caller may be inside one)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def trace_of(task, messages: list[dict], prompt_len: int) -> Trace:
    """A verifiers Trace of an episode's chat messages (the path of one branch; the assistant messages after the
    prompt are the sampled ones), which its task scores as verifiers scores a rollout's trace."""
    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                  agent=AgentInfo(config=AgentConfig()))
    for i, message in enumerate(messages):
        calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                 if not isinstance(c["function"]["arguments"], str) else c for c in message.get("tool_calls") or []]
        trace.nodes.append(MessageNode(parent=i - 1 if i else None, message=parse_message({**message, "tool_calls": calls}),
                                       sampled=message["role"] == "assistant" and i >= prompt_len))
    return trace


def prompt_messages(data) -> list[dict]:
    """A task's prompt as chat messages: its system prompt, then its prompt (a string or messages)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [m.model_dump(mode="json", exclude_none=True) for m in data.prompt]


async def _toolset_tools(toolsets, task) -> list:
    """The tools of verifiers Toolsets, each registered on an in-process MCP server and called through it."""
    from mcp.server.mcpserver import MCPServer  # mcp: optional (the tools extra)

    tools, seen = [], set()
    for toolset in toolsets:
        await toolset.setup()
        await toolset.setup_task(task)
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        listed = [t.model_dump(by_alias=True, exclude_none=True) for t in await server.list_tools()]
        if clash := seen & {t["name"] for t in listed}:
            raise ValueError(f"two verifiers toolsets serve the tool {sorted(clash)[0]!r}")
        seen |= {t["name"] for t in listed}

        async def call(name, arguments, server=server):
            result = await server.call_tool(name, arguments)
            if getattr(result, "is_error", False):
                raise RuntimeError(result_text(result))
            return result_text(result)

        tools += tools_from_schemas(listed, call)
    return tools


class _Interaction:
    """What a verifiers Env's ``agents.NAME.interaction(task)`` gives: ``turn(message)`` answered by the loop."""

    def __init__(self, bridge: _EnvBridge):
        self.bridge, self.started = bridge, False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def turn(self, message=None) -> Segment:
        if self.started:
            if message is None:
                raise ValueError("this exchange takes its next user message: turn(message)")
            items = [message] if isinstance(message, str) else message
            await self.bridge.asks.put([{"role": "user", "content": m} if isinstance(m, str) else dict(m)
                                        for m in items])
        elif message is not None:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        self.started = True
        turn = await self.bridge.replies.get()
        return Segment(messages=[AssistantMessage(content=turn.text)])


class _Agents:
    """The ``agents`` a verifiers Env's ``run`` gets: one seat, the policy (a second seat would need a model)."""

    def __init__(self, bridge: _EnvBridge):
        self.bridge, self.seat = bridge, None

    def __getattr__(self, name: str):
        if self.seat not in (None, name):
            raise ValueError(f"the verifiers env plays seats {self.seat!r} and {name!r}: one policy seat only")
        self.seat = name
        return self

    def interaction(self, task):
        return _Interaction(self.bridge)


class _EnvBridge:
    """A verifiers Env's ``run`` as a coroutine beside the loop: replies go in, its next messages come out."""

    def __init__(self, env, task):
        self.env, self.task, self.run = env, task, None

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self.run is None:
            self.replies, self.asks = asyncio.Queue(), asyncio.Queue()
            self.run = asyncio.ensure_future(self._play())
        await self.replies.put(turn)
        ask = await self.asks.get()
        if isinstance(ask, BaseException):
            raise ask
        return StepResult(done=True) if ask is None else StepResult(observations=ask)

    async def _play(self):
        try:
            await self.env.run(self.task, _Agents(self))
        except Exception as error:
            await self.asks.put(RuntimeError(f"{type(self.env).__name__}.run raised {type(error).__name__}: {error}"))
        await self.asks.put(None)

    def close(self):
        if self.run is not None:
            self.run.cancel()


class VerifiersEnvironment(TurnEnvironment):
    """One verifiers task as the environment of an episode's turns: its toolsets' calls answered, then its Env's
    ``run`` (if any) answering the replies; without an Env a turn without tool calls ends the episode."""

    def __init__(self, task, env, tools: list):
        self.tools = ToolEnvironment(tools) if tools else None
        self.bridge = _EnvBridge(env, task) if env is not None else None

    @property
    def tool_schemas(self) -> list[dict]:
        return self.tools.tool_schemas if self.tools else []

    async def step(self, turn: AssistantTurn, limits: StepLimits) -> StepResult:
        if self.tools and turn.calls:
            return await self.tools.step(turn, limits)
        if self.bridge:
            return await self.bridge.step(turn)
        return StepResult(done=True)

    async def close(self) -> None:
        if self.bridge:
            self.bridge.close()


class VerifiersTask(Task):
    """The tasks of the verifiers taskset ``taskset_id`` (see the module docstring)."""

    def __init__(self, taskset_id: str, options: dict | None = None, system: str | None = None):
        options = dict(options or {})
        env_options, limit = options.pop("env", {}), options.pop("limit", None)
        self.name, self.system = f"verifiers:{taskset_id}", system
        try:
            config = loaders.taskset_config_type(taskset_id)(id=taskset_id, **options)
            self.taskset = loaders.taskset_class(taskset_id)(config)
            env_cls = loaders.environment_class(taskset_id)
            self.env = None if env_cls is SingleAgentEnv else env_cls(
                loaders.env_config_type(taskset_id)(taskset=config, **env_options))
        except Exception as error:
            lines = str(error).splitlines()  # a pydantic error: its first line, then the field and why
            raise ValueError(f"verifiers:{taskset_id}: {type(error).__name__}: {'; '.join(lines[:3])}") from None
        if self.taskset.task_type().NEEDS_CONTAINER:
            raise ValueError(f"verifiers:{taskset_id}: its tasks need a container runtime; not supported")
        view = self.taskset if limit is None else self.taskset.take(int(limit))
        if not view.bounded:
            raise ValueError(f"verifiers:{taskset_id} is infinite: give the task option limit=N")
        self.tasks = list(view)
        if not self.tasks:
            raise ValueError(f"verifiers:{taskset_id}: the taskset loaded no tasks")
        self._scored: tuple | None = None

    def task_at(self, index: int):
        task = self.tasks[index % len(self.tasks)]
        return task.with_system_prompt(self.system) if self.system else task

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        task = self.task_at(index)
        if task.data.prompt is None:
            raise ValueError(f"{self.name}: task {index} has no prompt (a user-opened exchange); not supported")
        toolsets = type(task).toolsets(task.config) + type(self.taskset).toolsets(self.taskset.config)
        tools = run_sync(_toolset_tools(toolsets, task)) if toolsets else []
        return Episode(messages=prompt_messages(task.data), tools=[], environment=VerifiersEnvironment(task, self.env, tools),
                       info={"task_index": index % len(self.tasks), "task": task.data.model_dump(mode="json")})

    def _score(self, episode: Episode, messages: list[dict]) -> Trace:
        if self._scored is None or self._scored[0] is not messages:  # reward, then episode_metrics: one scoring
            trace = trace_of(self.task_at(episode.info["task_index"]), messages, len(episode.messages))
            run_sync(self.task_at(episode.info["task_index"]).score(trace))
            self._scored = (messages, trace)
        return self._scored[1]

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        return self._score(episode, messages).reward

    def episode_metrics(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> dict:
        trace = self._score(episode, messages)
        return {**{k: v for k, v in trace.metrics.items() if v is not None},
                **{f"reward_{k}": r.score for k, r in trace.rewards.items() if r is not None}}


def load(name: str, *, prompts: str | None = None, options: dict | None = None, system: str | None = None) -> Task:
    """``--task verifiers:ID`` with the taskset's config fields as task options."""
    if name in REFUSED:
        raise ValueError(REFUSED[name])
    if prompts is not None:
        raise ValueError(f"verifiers:{name} plays its taskset's own rows; --prompts is not taken")
    try:
        loaders.import_taskset(name)
    except ModuleNotFoundError:
        raise ValueError(f"no verifiers taskset {name!r}{closest(name, names())}: install its package or put its "
                         "module on PYTHONPATH") from None
    return VerifiersTask(name, options, system)
