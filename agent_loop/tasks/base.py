"""The one task contract: a task makes episodes and scores them (docs/design.md section 2).

Subclass :class:`Task` and write ``make_episode`` and ``reward``; every other hook has a default the
loop relies on. :class:`agent_loop.tasks.environment.Environment` (episodes from code) and
:class:`agent_loop.tasks.dataset.DatasetTask` (episodes from rows of data) are tasks written this way.

The contract is declared in :mod:`agent_loop.episode.contracts`, below the tasks, so that the loop that
plays it imports no task module (no package cycle); this is where tasks import it from.
"""

from agent_loop.episode.contracts import Task, as_task, episode_rng, is_task

__all__ = ["Task", "as_task", "episode_rng", "is_task"]
