"""Tasks: the built-in tasks (:mod:`.builtin`), tasks written as code
(:mod:`.environment`) and from data (:mod:`.dataset`), reward rules (:mod:`.rewards`), groups of samples
(:mod:`.grouping`), plug-ins named by a string (:mod:`.plugins`) and the registry behind ``--task``
(:mod:`.registry`). The contract they implement, :class:`~agent_loop.episode.contracts.Task`, is declared
below them, in the episode package (:mod:`agent_loop.episode.contracts`). docs/design.md sections 2 and 6a."""
