"""An episode's session id: the one key the loop sends with each of an episode's requests.

Backends key per-episode state by it: the HTTP backend keeps an episode on one server, and the warm start's
replay backend (:class:`trainer.warmstart.ReplayBackend`) answers an episode's k-th request with its
demonstration's k-th turn. Everyone who needs an episode's key calls :func:`episode_session_id`, so a change
here changes them all.
"""

from __future__ import annotations


def episode_session_id(task_name: str, seed: int, index: int) -> str:
    """The session id of episode ``index`` of task ``task_name`` under ``seed`` (``"name:seed:index"``)."""
    return f"{task_name}:{seed}:{index}"
