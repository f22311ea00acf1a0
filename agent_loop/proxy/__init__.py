"""An OpenAI-compatible proxy that records every call of someone else's agent token-in/token-out as our
Trajectories (``agent-loop proxy``, ``rollout --agent``; docs/agents.md)."""
