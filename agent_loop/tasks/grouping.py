"""Several samples of the same question, for the group-relative estimators (GRPO, RLOO, REINFORCE++-baseline)."""

from __future__ import annotations

from agent_loop.tasks.base import Task, as_task
from agent_loop.types import Episode, ToolCallRecord


class GroupedTask(Task):
    """Wraps a task so that episode ``i`` plays question ``i // group_size`` of the stream ``question_seed``.

    Each episode keeps its own index, so the agent loop gives every sample of a group its own
    sampling seed (``request_seed(seed, index, turn)``); ``info["group"]`` is the question's index.
    Every hook is the wrapped task's.
    """

    def __init__(self, task, group_size: int, question_seed: int):
        self.task = as_task(task)
        self.group_size = group_size
        self.question_seed = question_seed
        self.name = self.task.name

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        group = index // self.group_size
        episode = self.task.make_episode(group, self.question_seed)
        episode.info = {**episode.info, "index": index, "group": group}
        return episode

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        return self.task.reward(episode, messages, tool_calls)

    def success(self, episode: Episode, reward: float) -> bool:
        return self.task.success(episode, reward)

    def turn_rewards(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> list[float] | None:
        return self.task.turn_rewards(episode, messages, tool_calls)

    def episode_metrics(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> dict[str, float]:
        return self.task.episode_metrics(episode, messages, tool_calls)
