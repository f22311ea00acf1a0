"""An MCP server written for the 1.x SDK (issue 49 item 12): ``mcp-server-calculator`` from PyPI, a ``FastMCP``
server pinned to ``mcp<2``, which cannot run in .venv (mcp 2.3 renamed ``FastMCP`` to ``MCPServer``). Run under
its own interpreter (the side environment .side-envs/mcp-1x, built by ``bash scripts/side_env.sh mcp-1x``;
``scripts/setup.sh --test`` builds it), its tools are the model's tools and its answers the observations, as
docs/ecosystem.md says; under agent-loop's interpreter it is refused before any episode, naming the cause."""

import subprocess

import pytest
from toolset_helpers import NoToolsTask, call, observations, play

from agent_loop.toolsets import with_toolsets
from tests.helpers.side_envs import side_python

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server_file() -> str:
    """The published server's module file (``from mcp.server.fastmcp import FastMCP`` at its top), as a user runs
    a server script: ``python server.py``."""
    python = side_python("mcp-1x")
    out = subprocess.run([str(python), "-c", "import mcp, mcp_server_calculator.calculator as c; "
                          "print(mcp.__file__); print(c.__file__)"], capture_output=True, text=True, check=True)
    sdk, module = out.stdout.split()
    assert "/.side-envs/mcp-1x/" in sdk  # the 1.x SDK of the server's interpreter, not .venv's
    return module


def test_a_1x_sdk_server_runs_under_its_own_interpreter(server_file, tiny_tokenizer):  # server_file: the SDK check
    """``--mcp-server '.side-envs/mcp-1x/bin/python -m mcp_server_calculator'``: listed (its ``calculate`` tool
    and the schema FastMCP 1.x writes), called in an episode, its answer the observation, the tokens exact."""
    task = with_toolsets(NoToolsTask(), mcp_server=[f"{side_python('mcp-1x')} -m mcp_server_calculator"])
    [schema] = task.make_episode(0).environment.tool_schemas
    assert schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["properties"] == {"expression": {"title": "Expression", "type": "string"}}
    traj = play(task, tiny_tokenizer, [call("calculate", expression="6*7+1"), "done"])
    assert [r.result for r in traj.tool_calls] == ["43"] and traj.tool_calls[0].error is None
    assert "43" in observations(traj, tiny_tokenizer)[0]
    assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.metrics["template_exact"]


def test_the_same_server_under_agent_loop_s_interpreter_is_refused_naming_the_cause(server_file):
    """``python server.py`` is .venv's python (mcp 2.3): the server cannot import FastMCP, and that is the one line
    before any episode (what docs/ecosystem.md answers: run it under its own interpreter or uvx)."""
    with pytest.raises(ValueError, match="did not start: .*FastMCP") as error:
        with_toolsets(NoToolsTask(), mcp_server=[f"python {server_file}"])
    assert "\n" not in str(error.value)
    assert "runs under its own interpreter: --mcp-server '/path/to/its/venv/bin/python server.py'" in str(error.value)
    assert "'uvx PACKAGE'" in str(error.value) and "docs/ecosystem.md" in str(error.value)
