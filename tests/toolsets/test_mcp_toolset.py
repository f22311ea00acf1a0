"""MCP servers as tools: real servers of the official SDK (tests/toolsets/mcp_test_server.py) over stdio and
streamable HTTP on 127.0.0.1, played by the loop on the tiny agent's real tokenizer and chat template."""

import os
import time

import pytest
from toolset_helpers import NoToolsTask, call, http_server, observations, play, stdio_server  # noqa: F401 (a fixture)

from agent_loop.toolsets import with_toolsets
from agent_loop.toolsets.mcp import McpServer, result_text


def pid_of(text: str) -> int:
    return int(text.rsplit("pid ", 1)[1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def test_server_specs_are_checked_in_one_line():
    assert McpServer("http://127.0.0.1:8000/mcp").is_http and not McpServer("python server.py").is_http
    for bad, words in [("  ", "needs a command line"), ("http:///mcp", "needs a host"), ("python 'open", "not a command line")]:
        with pytest.raises(ValueError, match=words):
            McpServer(bad)


def test_results_become_the_text_the_model_reads():
    from mcp.types import CallToolResult, ImageContent, TextContent

    text = CallToolResult(content=[TextContent(type="text", text="a"), TextContent(type="text", text="b")])
    assert result_text(text) == "a\nb"
    assert result_text(CallToolResult(content=[], structured_content={"x": 1})) == '{"x": 1}'
    image = CallToolResult(content=[ImageContent(type="image", data="AA==", mime_type="image/png")])
    assert result_text(image) == "[image image/png]"


@pytest.mark.integration
def test_stdio_server_one_session_per_episode_errors_and_timeouts_as_observations(tiny_tokenizer):
    """A stateful counter counts per episode (a process per episode, gone when it ends); a tool that raises
    (isError), one that hangs, and one that answers after the timeout are error observations, and the session
    still works after them; the observations are OBSERVATION spans and the tokens stay exact."""
    task = with_toolsets(NoToolsTask(), mcp_server=[stdio_server()])
    schemas = task.make_episode(0).environment.tool_schemas  # what the chat template renders
    count = next(s for s in schemas if s["function"]["name"] == "count")
    assert count["function"]["parameters"] == {"properties": {}, "type": "object", "title": "countArguments"}
    replies = [call("count"), call("count") + call("boom", reason="no disk"), call("sleep", seconds=60),
               call("sleep", seconds=6), call("sleep", seconds=3), call("count") + call("lookup", name="x"), "done"]
    traj = play(task, tiny_tokenizer, replies, tool_timeout_s=4.0)
    records = traj.tool_calls
    assert [r.result for r in records[:2]] and records[0].result.startswith("count 1 pid")
    assert records[1].result.startswith("count 2 pid") and pid_of(records[1].result) == pid_of(records[0].result)
    assert records[2].error_kind == "exception" and "McpToolError: Error executing tool boom: boom: no disk" in records[2].error
    assert records[3].error_kind == "timeout" and records[4].error_kind == "timeout"  # hangs; answers after 4 s
    assert records[5].result == "slept 3.0"  # the late answer of sleep(6) arrived meanwhile and was dropped
    assert records[6].result.startswith("count 3 pid") and records[7].result == "looked up x"  # an argument "name"
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    assert traj.metrics["template_exact"] and traj.metrics["template_mismatch"] == 0
    shown = observations(traj, tiny_tokenizer)
    assert len(shown) == 6 and "count 1 pid" in shown[0] and "boom" in shown[1] and "timed out" in shown[2]
    assert gone_within(pid_of(records[0].result), 15)  # the episode's end closed its session: the process ended
    second = play(task, tiny_tokenizer, [call("count"), "done"], index=1)
    assert second.tool_calls[0].result.startswith("count 1 pid")  # a new episode, a new session
    assert pid_of(second.tool_calls[0].result) != pid_of(records[0].result)


@pytest.mark.integration
def test_a_server_killed_mid_episode_is_an_error_then_one_restart_then_a_clear_stop(tiny_tokenizer):
    task = with_toolsets(NoToolsTask(), mcp_server=[stdio_server()])
    replies = [call("count"), call("die"), call("count"), call("die"), call("count"), "done"]
    started = time.perf_counter()
    traj = play(task, tiny_tokenizer, replies, tool_timeout_s=5.0)
    assert time.perf_counter() - started < 120
    first, died, again, died_again, stopped = traj.tool_calls
    assert "went away during 'die'" in died.error and "restarted at the next call" in died.error
    assert again.result.startswith("count 1 pid") and pid_of(again.result) != pid_of(first.result)  # state lost
    assert "not restarted again" in died_again.error
    assert stopped.error_kind == "exception" and "not restarted in this episode" in stopped.error
    assert traj.finish_reason == "stop" and traj.metrics["template_exact"]


@pytest.mark.integration
def test_http_server_gives_each_concurrent_episode_its_own_session(http_server, tiny_tokenizer):  # noqa: F811
    import asyncio

    from agent_loop.backends.scripted import ScriptedBackend
    from agent_loop.episode.loop_config import LoopConfig
    from agent_loop.runners.local import run_rollouts

    task = with_toolsets(NoToolsTask(), mcp_server=[http_server])
    replies = [call("web_count"), call("web_count"), call("web_boom", reason="x"), "done"]

    def script(prompt_ids):
        turn = tiny_tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return tiny_tokenizer.encode(replies[min(turn, len(replies) - 1)])

    trajs = asyncio.run(run_rollouts(task, ScriptedBackend(script), tiny_tokenizer, range(3),
                                     LoopConfig(max_turns=4, temperature=0.0), concurrency=3, progress=False))
    for traj in trajs:
        assert [r.result.split(" pid")[0] for r in traj.tool_calls[:2]] == ["count 1", "count 2"]
        assert traj.tool_calls[2].error_kind == "exception" and traj.metrics["template_exact"]
        assert traj.finish_reason == "stop"


@pytest.mark.integration
@pytest.mark.parametrize("servers, words", [
    ([stdio_server("--no-tools")], "lists no tools"),
    ([stdio_server("--fail-at-start")], "did not start: .*its stderr ends: this server cannot start: no database"),
    (["no-such-mcp-command --x"], "did not start: FileNotFoundError"),
    (["http://127.0.0.1:9/mcp"], "did not start: ConnectError"),
])
def test_a_server_that_cannot_serve_is_one_line_before_any_episode(servers, words):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=words) as error:
        with_toolsets(NoToolsTask(), mcp_server=servers)
    assert "\n" not in str(error.value) and time.perf_counter() - started < 90


@pytest.mark.integration
def test_name_clashes_are_refused(http_server):  # noqa: F811 (the fixture)
    with pytest.raises(ValueError, match="'web_count' is served by both MCP server"):
        with_toolsets(NoToolsTask(), mcp_server=[http_server, http_server])

    def web_count() -> str:
        """A task's own tool with a server tool's name."""
        return "mine"

    class Own(NoToolsTask):
        def make_episode(self, index, seed=0):
            episode = super().make_episode(index, seed)
            episode.tools = [web_count]
            return episode

    with pytest.raises(ValueError, match=r"tool name\(s\) 'web_count' given twice"):
        with_toolsets(Own(), mcp_server=[http_server])
