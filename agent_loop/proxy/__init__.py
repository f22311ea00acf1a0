"""An OpenAI-compatible proxy that records every call of someone else's agent token-in/token-out as our
Trajectories (``agent-loop proxy``, ``rollout --agent``; docs/agents.md)."""


def check_agent_spec(spec: str | None) -> str | None:
    """``--agent``'s form, checked before anything loads: ``package.module:function`` or ``file.py:function``."""
    if spec is not None:
        target, sep, name = spec.rpartition(":")
        if not sep or not target or not name.isidentifier():
            raise ValueError("expected package.module:function or path/to/file.py:function")
    return spec
