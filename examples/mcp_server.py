"""An MCP server for ``agent-loop rollout --mcp-server``: a ``calculator`` and a per-session ``counter``.

    agent-loop rollout --prompts questions.jsonl --reward number --mcp-server 'python examples/mcp_server.py'
    python examples/mcp_server.py --http 8765   # then --mcp-server http://127.0.0.1:8765/mcp
    --mcp-server 'python examples/mcp_server.py --tools calculator'   # list only some of its tools

Written with the official SDK's low-level ``Server``, whose listed input schemas are exactly what the chat
template renders: ``calculator``'s is the built-in tasks' own (the tiny agent was trained on it). Over stdio
each episode gets a process of its own; over HTTP a session of its own (``Mcp-Session-Id``), so ``counter``
counts per episode.
"""

import argparse
import ast
import operator

import anyio
import mcp.types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
COUNTS: dict[str, int] = {}  # session id ("stdio": the process is the session) -> calls of counter
TOOLS = [
    types.Tool(name="calculator", description="Evaluate an arithmetic expression.",
               input_schema={"type": "object", "properties": {"expression": {
                   "type": "string", "description": "The arithmetic expression."}}, "required": ["expression"]}),
    types.Tool(name="counter", description="Count the calls of this tool in this session.",
               input_schema={"type": "object", "properties": {}}),
]


def evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError("only integers, +, - and *")


LISTED = TOOLS  # the tools served (--tools)


async def list_tools(ctx, params) -> types.ListToolsResult:
    return types.ListToolsResult(tools=LISTED)


async def call_tool(ctx, params) -> types.CallToolResult:
    arguments = params.arguments or {}
    try:
        if params.name == "calculator":
            text = str(evaluate(ast.parse(arguments["expression"], mode="eval").body))
        else:
            session = (getattr(ctx.request, "headers", None) or {}).get("mcp-session-id", "stdio")
            COUNTS[session] = COUNTS.get(session, 0) + 1
            text = str(COUNTS[session])
    except (KeyError, SyntaxError, ValueError) as error:  # the model reads the error (isError)
        return types.CallToolResult(content=[types.TextContent(type="text", text=f"error: {error}")], is_error=True)
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)])


server = Server("agent-loop-example", on_list_tools=list_tools, on_call_tool=call_tool)


async def serve_stdio() -> None:
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    parser.add_argument("--tools", default="calculator,counter", help="the tools to list, comma-separated")
    args = parser.parse_args()
    LISTED = [tool for tool in TOOLS if tool.name in args.tools.split(",")]
    port = args.http
    if port:
        import uvicorn

        uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=port, log_level="warning")
    else:
        anyio.run(serve_stdio)
