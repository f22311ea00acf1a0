"""The application's recipes: ``train`` (RL: rollouts -> batch -> score -> update -> push) and ``warmstart``
(fine-tuning on a task's demonstrations), each a short script over the library (``agent_loop.training``,
``agent_loop.runners``, ``masking``, ``advantages``); ``agent_loop.cli`` turns argv into their configs."""
