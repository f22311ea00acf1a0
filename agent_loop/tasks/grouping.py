"""Several samples of the same question, for the group-relative estimators (GRPO, RLOO, REINFORCE++-baseline)."""

from __future__ import annotations

from agent_loop.episode.contracts import TaskWrapper, as_task
from agent_loop.types import Episode


class GroupedTask(TaskWrapper):
    """Wraps a task so that episode ``i`` plays question ``i // group_size`` of the stream ``question_seed``.

    Each episode keeps its own index, so the agent loop gives every sample of a group its own
    sampling seed (``request_seed(seed, index, turn)``); ``info["group"]`` is the question's index.
    Every other hook is the wrapped task's (:class:`~agent_loop.episode.contracts.TaskWrapper`).
    """

    def __init__(self, task, group_size: int, question_seed: int):
        super().__init__(as_task(task))
        self.group_size = group_size
        self.question_seed = question_seed

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        group = index // self.group_size
        episode = self.task.make_episode(group, self.question_seed)
        episode.info = {**episode.info, "index": index, "group": group}
        return episode
