"""Environments people already have, played through the loop's one environment interface (docs/ecosystem.md).

- ``--task reasoning_gym:NAME`` (:mod:`.reasoning_gym`): a reasoning-gym dataset, scored by its own
  ``score_answer``;
- ``--task skyrl_gym:ENV_ID --prompts ROWS`` (:mod:`.skyrl_gym`): a skyrl-gym environment answering every
  turn (:class:`~agent_loop.episode.contracts.TurnEnvironment`), its ``step`` rewards as the episode's.

Each source module has ``names()`` (what it can play), ``NEEDS_PROMPTS`` and ``load(name, *, prompts,
options, system)`` returning a Task; ``ValueError`` (one line) for an unknown name or a bad option. The task
registry (:data:`agent_loop.tasks.registry.SOURCES`) names the sources by string, as it names its built-in
tasks, so this package sits above the tasks it builds on.
"""
