"""The views of ``agent-loop inspect``: spans, rewards, returns and advantages token by token, and a run over its steps.

Views: the terminal (rich: a summary and the few most informative episodes), an HTML page (one
self-contained file with in-page filters), a PNG (matplotlib) and the estimator comparison
(carry-through vs. reset-at-observation vs. ignoring the mask), for one file (:mod:`~agent_loop.inspect.view`:
``scan`` then ``build_view``, rendered by ``terminal``, ``html`` and ``plots``); two files compared episode
by episode (:mod:`~agent_loop.inspect.runs`); and a training run's folder over its steps
(:mod:`~agent_loop.inspect.steps`). Files are read one line at a time: memory grows with the episodes
shown, not with the file. These modules return data and render it; the command's options, messages and
exit status are ``agent_loop.cli.inspect``'s.
"""
