"""An OpenAI-compatible proxy that records every call of someone else's agent token-in/token-out as our
Trajectories (``agent-loop proxy``, ``rollout --agent``; docs/agents.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, Field


def check_agent_spec(spec: str | None) -> str | None:
    """``--agent``'s form, checked before anything loads: ``package.module:function`` or ``file.py:function``."""
    if spec is not None:
        target, sep, name = spec.rpartition(":")
        if not sep or not target or not name.isidentifier():
            raise ValueError("expected package.module:function or path/to/file.py:function")
    return spec


@dataclass
class AgentOptions:
    """``--agent``, declared once for every command that plays episodes with the user's own agent (rollout, train)."""

    agent: Annotated[str | None, AfterValidator(check_agent_spec), Field(
        description="play each episode with your own agent, called with an OpenAI client of an in-process recording "
                    "proxy that serves the policy (train: synchronous steps only; docs/agents.md)",
        json_schema_extra={"allowed": "package.module:function or path/to/file.py:function"})] = None
    agent_timeout_s: Annotated[float, Field(gt=0, description="seconds --agent may play one episode; longer: the "
                                            "episode ends with finish error (AgentTimeout in its metrics) and the run "
                                            "goes on")] = 600.0
