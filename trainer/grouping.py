"""Several samples of the same question per step, for the group-relative estimators (GRPO, RLOO, REINFORCE++-baseline)."""

from __future__ import annotations

from agent_loop.types import Episode, ToolCallRecord


class GroupedTask:
    """Wraps a task so that episode ``i`` plays question ``i // group_size`` of the stream ``question_seed``.

    Each episode keeps its own index, so the agent loop gives every sample of a group its own
    sampling seed (``request_seed(seed, index, turn)``); ``info["group"]`` is the question's index.
    """

    def __init__(self, task, group_size: int, question_seed: int):
        self.task = task
        self.group_size = group_size
        self.question_seed = question_seed
        self.name = task.name
        for optional in ("turn_rewards", "episode_metrics", "success"):  # the loop looks these up by name
            if hasattr(task, optional):
                setattr(self, optional, getattr(task, optional))

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        group = index // self.group_size
        episode = self.task.make_episode(group, self.question_seed)
        episode.info = {**episode.info, "index": index, "group": group}
        return episode

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        return self.task.reward(episode, messages, tool_calls)
