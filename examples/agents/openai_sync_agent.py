"""A synchronous agent, as most agents are written: the plain ``openai.OpenAI`` client in a hand-written tool loop.

    agent-loop rollout --agent examples/agents/openai_sync_agent.py:play --task arithmetic --episodes 16
    agent-loop train --agent examples/agents/openai_sync_agent.py:play --task arithmetic --steps 2

agent-loop calls a plain function on a thread of its own, so its blocking calls never hold up the in-process
proxy that answers them; ``--agent-timeout-s`` bounds an episode. Nothing in it knows about agent-loop.
"""

from __future__ import annotations

import json

from openai import OpenAI


def run_tools(tools: dict, calls) -> list[dict]:
    """The tool messages answering ``calls`` (an error text for a tool that fails, as most agents do)."""
    out = []
    for call in calls:
        try:
            result = str(tools[call.function.name](**json.loads(call.function.arguments or "{}")))
        except Exception as error:  # noqa: BLE001
            result = f"Error: {type(error).__name__}: {error}"
        out.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return out


def play(base_url: str, model: str, session_id: str, row: dict, max_turns: int = 4):
    """``--agent`` entry point: ask, run the tools asked for, ask again; the task scores the final answer (None)."""
    client = OpenAI(base_url=base_url, api_key=session_id, max_retries=0)  # the API key is the session id
    tools = {fn.__name__: fn for fn in row["episode"].tools}
    messages = list(row["messages"])
    for turn in range(max_turns):
        message = client.chat.completions.create(model=model, messages=messages, tools=row["tools"]).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or turn == max_turns - 1:
            break
        messages += run_tools(tools, message.tool_calls)
    return None
