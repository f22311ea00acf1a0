"""What the loop plays (docs/design.md section 2): the task contract, and the environment that answers each turn.

Declared here, in the episode package, so that the loop imports no task module: the tasks
(:mod:`agent_loop.tasks`; ``from agent_loop import Task``), the tool executor
(:class:`agent_loop.episode.tools.ToolEnvironment`) and the adapters of other libraries' environments
(:mod:`agent_loop.ecosystem`) implement these; the loop (:mod:`agent_loop.episode.loop`) plays them.

- A :class:`Task` makes episodes and scores them.
- An episode's :class:`TurnEnvironment` (``Episode.environment``; default: the tool environment of
  ``Episode.tools``) receives each assistant turn (:class:`AssistantTurn`) and answers with a
  :class:`StepResult`: observation messages, a per-turn reward, done/truncated and metadata.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from agent_loop.types import Episode, ToolCallRecord

# --- the task --------------------------------------------------------------------------------------


def episode_rng(name: str, seed: int, index: int) -> random.Random:
    """The random generator of episode ``index`` of task ``name`` under ``seed``: the same episode
    whatever runs beside it, in any process."""
    return random.Random(f"{name}:{seed}:{index}")


def as_reward(value: Any, what: str = "") -> float:
    """A reward function's return value as a finite float (bools, ints, numpy and torch scalars are fine);
    TypeError or ValueError (``what`` returned ...) for anything else, NaN and infinities included."""
    prefix = f"{what} " if what else ""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{prefix}returned {type(value).__name__} {value!r:.200}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{prefix}returned {number}, not a finite number")
    return number


class Task:
    """An environment: makes episodes and scores them.

    Must write: ``name``, :meth:`make_episode` and :meth:`reward`. May override :meth:`success`,
    :meth:`turn_rewards`, :meth:`episode_metrics`, :meth:`turn_states` and :meth:`demonstrate` (their defaults are
    documented on each).
    An episode may carry its own :class:`TurnEnvironment` (``Episode.environment``) that answers its turns.
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

    def turn_states(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list | None:
        """One hashable key per assistant turn: the state of the environment the turn started from (GiGPO's
        anchor state; turns of a group's episodes with equal keys are compared with each other). Keys are
        strings, numbers, None, or tuples/lists of them (recorded in ``Trajectory.info["turn_states"]``, read
        back as tuples). Default None: ``gigpo`` keys each turn by the observation tokens before it."""
        return None

    def demonstrate(self, episode: Episode, rng: random.Random) -> list[dict] | None:
        """A solved ``episode`` for ``agent-loop warmstart`` (supervised fine-tuning on its ASSISTANT tokens):
        the messages after its prompt, as the loop records them (a list that starts with the prompt, such as
        a Trajectory's ``messages``, is taken too): assistant turns with ``content`` and ``tool_calls``
        (``{"name", "arguments"}`` dicts, or the OpenAI ``{"function": {...}}`` shape), the last one a final
        answer without tool calls; the tool results between them may be left out (the tools are run).
        ``rng``: seeded by the episode's (index, seed), apart from the one that made the episode.
        Default None: no demonstration (a task with none cannot be warm-started)."""
        return None


def state_key(key: Any, where: str = "") -> Any:
    """A turn state as a hashable key: lists (a JSON record's tuples) become tuples, recursively; TypeError
    (naming ``where``) for anything else that is not hashable, or not a string, number, bool, None or tuple."""
    if isinstance(key, (list, tuple)):
        return tuple(state_key(k, where) for k in key)
    if key is None or isinstance(key, (str, int, float)):
        return key
    raise TypeError(f"{where}{' ' if where else ''}is {type(key).__name__} {key!r:.100}: a turn state must be a "
                    "string, number, bool, None, or a tuple or list of them")


def turn_state_keys(states: Any, turns: int, what: str = "turn_states") -> list | None:
    """``states`` (a :meth:`Task.turn_states` answer, or a record's) as one :func:`state_key` per turn of the
    ``turns`` assistant turns, or None; TypeError / ValueError naming the turn for a wrong type or count."""
    if states is None:
        return None
    if not isinstance(states, (list, tuple)):
        raise TypeError(f"{what} returned {type(states).__name__} {states!r:.100}, not a list (one key per turn)")
    if len(states) != turns:
        raise ValueError(f"{what} returned {len(states)} keys for {turns} assistant turns (one key per turn)")
    return [state_key(key, f"{what}[turn {k}]") for k, key in enumerate(states)]


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
                        "reward(episode, messages, tool_calls) (subclass agent_loop.Task)")
    return TaskWrapper(obj)


HOOKS = ("make_episode", "reward", "success", "turn_rewards", "episode_metrics", "turn_states",
         "demonstrate")  # every Task hook


class TaskWrapper(Task):
    """``task`` with every hook forwarded to it (:data:`HOOKS`); a hook it lacks (a task object that does not
    subclass :class:`Task`) gets :class:`Task`'s default. Subclass it and override the hooks a wrapper changes
    (:class:`agent_loop.tasks.grouping.GroupedTask`, the verl loop's row task): the others stay the task's."""

    def __init__(self, task):
        self.task = task
        self.name = task.name if isinstance(task, Task) else getattr(task, "name", None) or type(task).__name__

    def _forward(self, hook: str, *args):
        own = getattr(self.task, hook, None)
        return own(*args) if callable(own) else getattr(Task, hook)(self, *args)

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        return self._forward("make_episode", index, seed)

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        return self._forward("reward", episode, messages, tool_calls)

    def success(self, episode: Episode, reward: float) -> bool:
        return self._forward("success", episode, reward)

    def turn_rewards(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list[float] | None:
        return self._forward("turn_rewards", episode, messages, tool_calls)

    def episode_metrics(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> dict[str, float]:
        return self._forward("episode_metrics", episode, messages, tool_calls)

    def turn_states(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list | None:
        return self._forward("turn_states", episode, messages, tool_calls)

    def demonstrate(self, episode: Episode, rng: random.Random) -> list[dict] | None:
        return self._forward("demonstrate", episode, rng)


# --- the environment of a turn ---------------------------------------------------------------------


@dataclass
class AssistantTurn:
    """One assistant turn, as the loop hands it to the episode's environment."""

    index: int  # 0-based, counted over the episode
    text: str  # as sampled, decoded with special tokens, without its end-of-turn token
    content: str  # the text outside the parsed tool calls (the assistant message's content)
    calls: list  # the parsed calls (ParsedCall), then the calls that did not parse (ParseError), in that order
    call_ids: list[str]  # one id per entry of ``calls``: the tool message's ``tool_call_id``
    final: bool  # no turn follows, whatever step returns (the last turn allowed, or one cut by its token budget):
    #              work whose result no one reads (running the tool calls) may be skipped
    finish_reason: str  # the generation's: "stop" (an end-of-turn token) or "length" (the turn's token budget)


@dataclass
class StepLimits:
    """The loop's budgets for one step (from LoopConfig): a tool call's (or a step's) seconds, the calls run at
    once, and the characters an observation may keep before tokenizing."""

    timeout_s: float
    max_parallel: int
    max_result_chars: int | None


@dataclass
class StepResult:
    """An environment's answer to one assistant turn."""

    observations: list[dict] = field(default_factory=list)  # chat messages ({"role", "content", ...}) appended next
    reward: float | None = None  # this turn's reward; None: this environment gives no per-turn reward
    done: bool = False  # the episode has ended (finish "stop"); observations are then not appended
    truncated: bool = False  # the environment's own limit ended it (finish "max_turns")
    metadata: dict = field(default_factory=dict)  # recorded in Trajectory.info["steps"]
    tool_calls: list[ToolCallRecord] = field(default_factory=list)  # calls answered, recorded in Trajectory.tool_calls


class TurnEnvironment:
    """The one interface of what answers an assistant turn (docs/design.md, "The environment of a turn").

    Write :meth:`step`, sync or ``async``. A sync step runs on a daemon thread of its own, bounded by
    ``limits.timeout_s``; an async one is awaited under the same bound and must not block the event loop.
    ``bounds_its_steps = True`` says every piece of a step's work already has its own timeout (the tool
    executor: one per call), so the loop awaits it without an outer one. A step that raises, times out or
    returns anything but a well-formed :class:`StepResult` ends the episode with finish "error" and the reason
    in ``metrics["error"]``. :meth:`close` (sync or async) runs once when the episode ends, however it ends.
    """

    bounds_its_steps: bool = False

    @property
    def tool_schemas(self) -> list[dict]:
        """The tool schemas the chat template renders (none by default: the environment reads the text itself)."""
        return []

    def step(self, turn: AssistantTurn, limits: StepLimits) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must define step(self, turn, limits) -> StepResult")

    def close(self) -> None:
        """Release what the episode held (a database connection, a session); default nothing."""


def checked_step(result: Any, limits: StepLimits, cut) -> StepResult:
    """``result`` if it is a well-formed StepResult (observation contents longer than the character budget cut by
    ``cut(text, max_chars) -> text``, the reward a finite float), else TypeError/ValueError saying what is wrong."""
    if not isinstance(result, StepResult):
        raise TypeError(f"step returned {type(result).__name__} {result!r:.100}, not a StepResult")
    if not isinstance(result.observations, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in result.observations):
        raise TypeError(f"StepResult.observations must be a list of messages with a string role and content, got "
                        f"{result.observations!r:.200}")
    if not isinstance(result.done, bool) or not isinstance(result.truncated, bool):
        raise TypeError(f"StepResult.done and .truncated must be bools, got {result.done!r} and {result.truncated!r}")
    if not isinstance(result.metadata, dict) or not all(isinstance(c, ToolCallRecord) for c in result.tool_calls):
        raise TypeError("StepResult.metadata must be a dict and .tool_calls a list of ToolCallRecord")
    reward = None if result.reward is None else as_reward(result.reward, "the environment's step")
    observations = [{**m, "content": cut(m["content"], limits.max_result_chars)} for m in result.observations]
    return StepResult(observations, reward, result.done, result.truncated, result.metadata, list(result.tool_calls))
