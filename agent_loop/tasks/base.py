"""The one task contract: a task makes episodes and scores them (docs/design.md section 2).

Subclass :class:`Task` and write ``make_episode`` and ``reward``; every other hook has a default the
loop relies on. :class:`agent_loop.tasks.environment.Environment` (episodes from code) and
:class:`agent_loop.tasks.dataset.DatasetTask` (episodes from rows of data) are tasks written this way.
"""

from __future__ import annotations

import random

from agent_loop.types import Episode, ToolCallRecord


def episode_rng(name: str, seed: int, index: int) -> random.Random:
    """The random generator of episode ``index`` of task ``name`` under ``seed``: the same episode
    whatever runs beside it, in any process."""
    return random.Random(f"{name}:{seed}:{index}")


class Task:
    """An environment: makes episodes and scores them.

    Must write: ``name``, :meth:`make_episode` and :meth:`reward`. May override :meth:`success`,
    :meth:`turn_rewards`, :meth:`episode_metrics` and :meth:`demonstrate` (their defaults are documented on each).
    """

    name: str = ""

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        """Episode ``index`` of the stream ``seed``: deterministic in (index, seed)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_episode(self, index, seed)")

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        """Outcome reward of a finished episode (1.0 success, 0.0 failure for the built-in tasks)."""
        raise NotImplementedError(f"{type(self).__name__} must define reward(self, episode, messages, tool_calls)")

    def success(self, episode: Episode, reward: float) -> bool:
        """Whether the episode succeeded; the one success rule (stored in ``Trajectory.info["success"]``).
        Default: a positive outcome reward."""
        return reward > 0

    def turn_rewards(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list[float] | None:
        """One reward per assistant turn, placed on each turn's last ASSISTANT token; default None (no per-turn rewards)."""
        return None

    def episode_metrics(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> dict[str, float]:
        """The task's own numbers about an episode (``Trajectory.metrics["task"]``, averaged by the trainer);
        default none."""
        return {}

    def demonstrate(self, episode: Episode, rng: random.Random) -> list[dict] | None:
        """A solved ``episode`` for ``agent-loop warmstart`` (supervised fine-tuning on its ASSISTANT tokens):
        the messages after its prompt, as the loop records them (a list that starts with the prompt, such as
        a Trajectory's ``messages``, is taken too): assistant turns with ``content`` and ``tool_calls``
        (``{"name", "arguments"}`` dicts, or the OpenAI ``{"function": {...}}`` shape), the last one a final
        answer without tool calls; the tool results between them may be left out (the tools are run).
        ``rng``: seeded by the episode's (index, seed), apart from the one that made the episode.
        Default None: no demonstration (a task with none cannot be warm-started)."""
        return None


def is_task(obj) -> bool:
    """A task object (not a class): has ``make_episode`` and ``reward``."""
    return not isinstance(obj, type) and callable(getattr(obj, "make_episode", None)) and callable(getattr(obj, "reward", None))


def as_task(obj) -> Task:
    """``obj`` as a :class:`Task`: itself, or (an object with ``make_episode`` and ``reward`` that does not
    subclass Task) wrapped so that its missing hooks get the defaults. TypeError for anything else."""
    if isinstance(obj, Task):
        return obj
    if not is_task(obj):
        raise TypeError(f"{obj!r} is not a task: a task has make_episode(index, seed) and "
                        "reward(episode, messages, tool_calls) (subclass agent_loop.tasks.base.Task)")
    return _Wrapped(obj)


class _Wrapped(Task):
    """A task object that does not subclass :class:`Task`, with the defaults for the hooks it lacks."""

    def __init__(self, task):
        self.task = task
        self.name = getattr(task, "name", None) or type(task).__name__
        for hook in ("success", "turn_rewards", "episode_metrics", "demonstrate"):
            if callable(getattr(task, hook, None)):
                setattr(self, hook, getattr(task, hook))

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        return self.task.make_episode(index, seed)

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        return self.task.reward(episode, messages, tool_calls)
