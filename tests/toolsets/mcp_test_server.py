"""The MCP server of the toolsets tests (official SDK): a per-session counter, a tool that raises, one
that sleeps (hangs past a timeout, or answers after it), one that kills its server, and faulty variants.

    python mcp_test_server.py [--http PORT] [--prefix P] [--no-tools] [--fail-at-start]
"""

import argparse
import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

parser = argparse.ArgumentParser()
parser.add_argument("--http", type=int)
parser.add_argument("--prefix", default="")
parser.add_argument("--no-tools", action="store_true")
parser.add_argument("--fail-at-start", action="store_true")
args = parser.parse_args()
if args.fail_at_start:
    print("this server cannot start: no database", file=sys.stderr)
    sys.exit(3)

server = MCPServer("toolsets-test", log_level="WARNING")  # no log line per request (rich renders them slowly)
COUNTS: dict[str, int] = {}


def count(ctx: Context) -> str:
    """Count this session's calls."""
    session = (ctx.headers or {}).get("mcp-session-id", "stdio")
    COUNTS[session] = COUNTS.get(session, 0) + 1
    return f"count {COUNTS[session]} pid {os.getpid()}"


def boom(reason: str) -> str:
    """Raise an error (ToolError: the SDK's way to give the model the message)."""
    raise ToolError(f"boom: {reason}")


async def sleep(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def die() -> str:
    """Kill this server's process."""
    os._exit(7)


def lookup(name: str) -> str:
    """A tool with an argument called name."""
    return f"looked up {name}"


if not args.no_tools:
    for fn in (count, boom, sleep, die, lookup):
        server.add_tool(fn, name=args.prefix + fn.__name__)

if __name__ == "__main__":
    server.run("streamable-http", host="127.0.0.1", port=args.http) if args.http else server.run()
