"""The training library: the policy's forward, AdamW and its schedules, checkpoints, data parallelism, LoRA,
weight transports, rollout files, metrics and the PPO update; the recipes (``agent_loop.recipes``) compose them."""
