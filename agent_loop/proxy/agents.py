"""``--agent module:function``: episodes played by someone else's agent through an in-process proxy.

The function is called once per episode with keyword arguments (it takes those it names):

- ``client``: an ``openai.AsyncOpenAI`` bound to this episode's session (base URL and ``X-Session-Id`` set);
- ``base_url``, ``model``, ``session_id``: to build its own client (use ``session_id`` as the API key, or send it
  as the ``X-Session-Id`` header);
- ``row``: the episode's row: ``messages`` (the task's opening chat), ``tools`` (their JSON schemas), ``answer``,
  ``index``, ``seed``, ``task`` and ``episode`` (the task's :class:`~agent_loop.types.Episode`, tools included).

It returns the episode's reward, or None: then the task (or ``--reward`` of ``--prompts``) scores the final
messages of the session's last segment (on a thread of its own, for at most ``reward_timeout_s``). An agent that
raises, or plays longer than ``--agent-timeout-s``, ends its episode with finish ``error`` (the reason in its info).

A plain function (``openai.OpenAI``, LangChain's ``.invoke``, a requests loop: it blocks) runs on a daemon thread
of its own, so the event loop that serves the in-process proxy it calls goes on serving, and a stop (SIGINT,
SIGTERM) never waits for it; an ``async def`` runs on that event loop. A file named by ``--agent`` imports as
``--task`` files do: the modules beside it import (:func:`agent_loop.episode.plugin_import.import_module`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
from typing import Callable

from agent_loop.backends.base import Backend
from agent_loop.episode.loop import call_bounded, slow_reward_notice
from agent_loop.episode.plugin_import import import_module
from agent_loop.episode.tools import ToolExecutor
from agent_loop.proxy import check_agent_spec
from agent_loop.proxy.core import Proxy, ProxySettings
from agent_loop.proxy.server import ProxyServer
from agent_loop.runners.local import TrajectorySink, error_trajectory
from agent_loop.runners.spec import RunSpec
from agent_loop.runners.stats import RolloutStats
from agent_loop.tasks.rewards import as_reward
from agent_loop.types import Trajectory, episode_session_id, in_episode_order

AGENT_ARGUMENTS = ("client", "base_url", "model", "session_id", "row")


@functools.cache  # a file is run once however often it is named
def load_agent(spec: str) -> Callable:
    """The function ``package.module:function`` or ``path/to/file.py:function`` names; ValueError saying why not."""
    try:
        check_agent_spec(spec)
    except ValueError as error:
        raise ValueError(f"--agent {spec!r}: {error}") from None
    target, _, name = spec.rpartition(":")
    module = import_module(target, "--agent", shown=spec)  # as --task and --tools files: its neighbours import
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--agent {spec!r}: {target} has no function {name!r}")
    return fn


def episode_row(task, index: int, seed: int) -> dict:
    """What the agent function gets as ``row`` for episode ``index`` of ``task``."""
    episode = task.make_episode(index, seed)
    return {"messages": [dict(m) for m in episode.messages], "tools": ToolExecutor(episode.tools).schemas,
            "answer": episode.answer, "index": index, "seed": seed, "task": task.name, "episode": episode}


class AgentTimeout(Exception):
    """An agent played one episode for longer than its bound (``--agent-timeout-s``)."""


class RewardTimeout(Exception):
    """The task's reward of an agent's episode ran longer than its bound (``--reward-timeout-s``)."""


def is_async(agent: Callable) -> bool:
    """Whether ``agent`` is an ``async def`` (a coroutine function, a partial of one, or an object whose
    ``__call__`` is one): it runs on the event loop; anything else may block and runs on a thread."""
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))


async def call_agent(agent: Callable, *, timeout_s: float | None = None, name: str = "agent", **arguments):
    """``agent`` with the arguments it names (all of them if it takes ``**kwargs``): an ``async def`` awaited on
    this event loop; a plain function called on a daemon thread of its own (``name``), its result awaited if it
    is awaitable. At most ``timeout_s`` seconds in all (None: no bound), else :class:`AgentTimeout`; a plain
    function still running then is left to its thread, which ends with the process."""
    parameters = inspect.signature(agent).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        arguments = {k: v for k, v in arguments.items() if k in parameters}

    async def called():
        value = agent(**arguments) if is_async(agent) else await call_bounded(
            functools.partial(agent, **arguments), None, name)
        return await value if inspect.isawaitable(value) else value

    try:
        async with asyncio.timeout(timeout_s) as bound:
            return await called()
    except TimeoutError:
        if not bound.expired():
            raise  # the agent's own TimeoutError
        raise AgentTimeout(f"the agent played the episode for longer than {timeout_s:g} s "
                           "(--agent-timeout-s)") from None


class AgentRunner:
    """Plays episodes of ``task`` with ``agent`` through ``proxy`` served at ``server.base_url``: each for at
    most ``timeout_s`` seconds, its reward (when the agent gives none) for at most ``reward_timeout_s``."""

    def __init__(self, agent: Callable, task, proxy: Proxy, server: ProxyServer, *, timeout_s: float | None = None,
                 reward_timeout_s: float = 60.0):
        from openai import AsyncOpenAI  # openai: optional (the proxy extra)

        self.agent, self.task, self.proxy, self.server = agent, task, proxy, server
        self.timeout_s, self.reward_timeout_s = timeout_s, reward_timeout_s
        self.client = AsyncOpenAI(base_url=server.base_url, api_key="agent-loop", max_retries=0)

    async def play(self, index: int, seed: int) -> list[Trajectory]:
        """One episode: its session's segments as Trajectories (one error Trajectory if the agent failed)."""
        row = episode_row(self.task, index, seed)
        session_id = episode_session_id(self.task.name, seed, index)  # the loop's own key of an episode
        self.proxy.open(session_id, row={"task": self.task.name, "index": index, "seed": seed})
        error = None
        try:
            reward = await call_agent(
                self.agent, timeout_s=self.timeout_s, name=f"agent-{session_id}",
                client=self.client.with_options(default_headers={"X-Session-Id": session_id}),
                base_url=self.server.base_url, model=self.proxy.settings.model_name, session_id=session_id, row=row)
            if reward is not None:
                self.proxy.set_reward(session_id, as_reward(reward, "the agent"))
        except Exception as exc:  # noqa: BLE001  (the user's agent: its failure ends this episode only)
            error = f"{type(exc).__name__}: {exc}"
        if session_id not in self.proxy.sessions:  # the agent ended it itself (POST .../end)
            return []
        episode = row["episode"]
        try:
            if error is None:
                await self._score(session_id, episode, f"episode {index} of {self.task.name} (seed {seed})")
        except Exception as exc:  # noqa: BLE001  (the task's reward failed)
            error = f"{type(exc).__name__}: {exc}"
        out = self.proxy.end(session_id, info={"answer": episode.answer, **episode.info})
        if error is not None or not out:
            return [error_trajectory(self.task, index, seed, error or "the agent made no call", self.proxy.tokenizer)]
        for trajectory in out:
            trajectory.info["success"] = bool(self.task.success(episode, trajectory.reward))
        return out

    async def _score(self, session_id: str, episode, where: str) -> None:
        """The task's reward of the session's last segment, when the agent gave none: on a thread of its own for at
        most ``reward_timeout_s`` (a warning after a few seconds names the episode), as our loop scores."""
        session = self.proxy.sessions[session_id]
        if session.reward is not None or not session.segments:
            return
        last = session.segments[-1].state

        def score() -> float:
            return as_reward(self.task.reward(episode, last.messages, last.records), f"{self.task.name}'s reward")

        try:
            reward = await call_bounded(score, self.reward_timeout_s, f"reward-{session_id}",
                                        notice=slow_reward_notice(where, self.reward_timeout_s))
        except TimeoutError:
            raise RewardTimeout(f"scoring {where} took longer than {self.reward_timeout_s:g} s (--reward-timeout-s); "
                               "reward 0") from None
        self.proxy.set_reward(session_id, reward)


async def stream_agent_rollouts(spec: RunSpec, backend: Backend, agent: Callable, *, concurrency: int = 16,
                                sample_size: int = 0, total: int | None = None, keep: bool = False,
                                settings: ProxySettings | None = None,
                                timeout_s: float | None = None) -> tuple[RolloutStats, list[Trajectory]]:
    """:func:`agent_loop.runners.local.stream_rollouts` with ``agent`` playing each episode through an in-process
    proxy over ``backend`` (sampling from ``spec.config``), each for at most ``timeout_s`` seconds (None: no
    bound); every segment is written to ``spec.output_path``. Returns the statistics and, with ``keep``, every
    segment in finishing order."""
    config = spec.config
    settings = settings or ProxySettings(max_tokens=config.max_tokens, temperature=config.temperature,
                                         top_p=config.top_p, seed=spec.seed, max_sessions=max(concurrency, 1) * 2)
    episodes = list(spec.episodes)
    total = len(episodes) if total is None else total
    stats, kept, todo = RolloutStats(sample_indices=frozenset(episodes[:sample_size])), [], iter(episodes)
    proxy = Proxy(backend, spec.tokenizer, settings)
    try:
        async with ProxyServer(proxy) as server:
            runner = AgentRunner(agent, spec.task, proxy, server, timeout_s=timeout_s,
                                 reward_timeout_s=config.reward_timeout_s)
            with TrajectorySink(total, f"agent {spec.task.name}", spec.output_path, spec.progress, spec.output_mode,
                                stats=stats, info=spec.recorded()) as sink:
                async def worker() -> None:
                    for index in todo:
                        for trajectory in await runner.play(index, spec.seed):
                            sink.add(trajectory)
                            kept.append(trajectory) if keep else None

                await asyncio.gather(*(worker() for _ in itertools.repeat(None, min(concurrency, max(total, 1)))))
            await runner.client.close()
    finally:
        await backend.end_run()
    return stats, kept


async def agent_rollouts(task, backend: Backend, tokenizer, episodes, config, *, agent: str | Callable, seed: int = 0,
                         concurrency: int = 16, timeout_s: float | None = None) -> list[Trajectory]:
    """:func:`agent_loop.runners.local.run_rollouts` for ``agent`` (a function or its ``module:function``): every
    segment of every episode, in episode order (what a training step takes; the trainer's ``--agent``), each
    episode for at most ``timeout_s`` seconds."""
    agent = load_agent(agent) if isinstance(agent, str) else agent
    spec = RunSpec(task, tokenizer, list(episodes), config, seed, None, progress=False)
    _, kept = await stream_agent_rollouts(spec, backend, agent, concurrency=concurrency, keep=True, timeout_s=timeout_s)
    return in_episode_order(kept)
