"""An OpenAI Agents SDK agent with a function tool, changed only in its base URL and model.

The SDK pins ``openai<3`` and ``mcp<2``, so it lives in a side environment beside agent-loop
(``bash scripts/side_env.sh openai-agents``), and runs there as it is:

    .side-envs/openai-agents/bin/agent-loop rollout --agent examples/agents/agents_sdk_agent.py:agent \
        --task arithmetic --episodes 16
"""

from __future__ import annotations

import ast
import json
import operator

from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would send traces to OpenAI; nothing leaves the machine
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers and + - * /")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    value = _value(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else str(round(value, 6))


async def _invoke(context, arguments: str) -> str:
    try:
        return calculator(**json.loads(arguments))
    except Exception as error:  # noqa: BLE001  (the model reads what went wrong)
        return f"Error: {error}"


def calculator_tool(schema: dict | None = None) -> FunctionTool:
    """The SDK's function tool; ``schema``: the task's JSON schema of it (the prompt the model was taught on)."""
    schema = schema or {"description": "Evaluate an arithmetic expression.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string", "description": "The arithmetic expression."}},
        "required": ["expression"]}}
    return FunctionTool(name="calculator", description=schema["description"], params_json_schema=schema["parameters"],
                        on_invoke_tool=_invoke, strict_json_schema=False)


def make_agent(client: AsyncOpenAI, model: str, schema: dict | None = None) -> Agent:
    return Agent(name="calculator agent", tools=[calculator_tool(schema)],
                 model=OpenAIChatCompletionsModel(model=model, openai_client=client))


async def agent(base_url: str, model: str, session_id: str, row: dict):
    """``--agent`` entry point: the SDK's own client (the session id as its API key); the task scores the answer."""
    client = AsyncOpenAI(base_url=base_url, api_key=session_id, max_retries=0)
    try:
        schema = next((t["function"] for t in row.get("tools", []) if t["function"]["name"] == "calculator"), None)
        await Runner.run(make_agent(client, model, schema), row["messages"][-1]["content"], max_turns=4)
    finally:
        await client.close()
    return None
