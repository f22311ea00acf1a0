"""An agent written against the OpenAI chat API with the ``openai`` client: a hand-written tool loop.

Nothing in it knows about agent-loop; pointed at the proxy it is trained as it is:

    agent-loop rollout --agent examples/agents/openai_tools_agent.py:agent --task arithmetic --episodes 16
    agent-loop train --agent examples/agents/openai_tools_agent.py:agent --task arithmetic --steps 2

Standalone against a running ``agent-loop proxy --port 8100``: ``run(base_url="http://127.0.0.1:8100/v1",
session_id="ep-1", ...)``.
"""

from __future__ import annotations

import inspect
import json

from openai import AsyncOpenAI


async def run_tools(tools: dict, calls) -> list[dict]:
    """The tool messages answering ``calls`` (an error text for a tool that fails, as most agents do)."""
    out = []
    for call in calls:
        try:
            fn = tools[call.function.name]
            value = fn(**json.loads(call.function.arguments or "{}"))
            result = str(await value if inspect.isawaitable(value) else value)
        except Exception as error:  # noqa: BLE001
            result = f"Error: {type(error).__name__}: {error}"
        out.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return out


async def chat_loop(client: AsyncOpenAI, model: str, messages: list[dict], schemas: list[dict], tools: dict,
                    max_turns: int = 4) -> list[dict]:
    """Ask, run the tools asked for, ask again; stop on an answer without tool calls or after ``max_turns``."""
    messages = list(messages)
    for turn in range(max_turns):
        response = await client.chat.completions.create(model=model, messages=messages, tools=schemas or None)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or turn == max_turns - 1:
            break
        messages += await run_tools(tools, message.tool_calls)
    return messages


async def agent(client: AsyncOpenAI, model: str, row: dict):
    """``--agent`` entry point: the task's opening chat and tools; returns None (the task scores the answer)."""
    tools = {fn.__name__: fn for fn in row["episode"].tools}
    await chat_loop(client, model, row["messages"], row["tools"], tools)
    return None


async def run(*, base_url: str, session_id: str, model: str, messages: list[dict], schemas: list[dict], tools: dict):
    """The same agent against a proxy at ``base_url``: the session id goes as the API key (the proxy's second
    source of session ids)."""
    async with AsyncOpenAI(base_url=base_url, api_key=session_id) as client:
        return await chat_loop(client, model, messages, schemas, tools)
