"""The sandboxed ``python`` tool: each probe of issue 38 (fork bomb, infinite loop, 10 GB, 1 GB written, a
socket, files outside its folder, 100 MB printed) ends as an error observation or capped output, quickly,
leaving nothing behind on the host; state per episode; the tool through the loop on the tiny agent's
tokenizer and template, beside the arithmetic task's calculator."""

import asyncio
import os
import socket
import subprocess
import time

import pytest
from toolset_helpers import NoToolsTask, call, observations, play

from agent_loop.toolsets import with_toolsets
from agent_loop.toolsets.python_sandbox import PythonSandbox, PythonToolset, SandboxError, SandboxLimits, isolation

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=2)
pytestmark = pytest.mark.integration  # every test starts sandboxed interpreters


def run(code: str, how: str | None = None) -> tuple[str, float]:
    """(observation, seconds): the output, or "ERROR: " and the SandboxError's message."""
    started = time.perf_counter()
    try:
        text = asyncio.run(PythonSandbox(LIMITS, how=how).run(code))
    except SandboxError as error:
        text = f"ERROR: {error}"
    return text, time.perf_counter() - started


def sandbox_users() -> list[str]:
    """Processes left by the sandbox's users (uids 200000..299999 when run as root)."""
    listed = subprocess.run(["ps", "-eo", "uid=,pid=,stat=,comm="], capture_output=True, text=True).stdout.splitlines()
    return [line for line in listed if 200_000 <= int(line.split()[0]) < 300_000 and not line.split()[2].startswith("Z")]


def test_this_machine_has_bubblewrap():
    assert isolation() == "bwrap"  # scripts/setup.sh installs it (apt-get install bubblewrap)


def test_output_and_errors_of_ordinary_code():
    assert run("print('hi'); 6 * 7")[0] == "hi\n42\n"
    text, _ = run("1 / 0")
    assert text.startswith("Traceback") and text.rstrip().endswith("ZeroDivisionError: division by zero")
    assert run("x = 1")[0] == "(no output)"


PROBES = {  # name -> (code, what the observation must say)
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  "ERROR: the code was stopped: it ran past the wall-clock limit of 3 s"),
    "infinite_loop": ("while True:\n    pass", "ERROR: the code was stopped: it "),
    "allocate_10_gb": ("x = bytearray(10 * 1024 ** 3)", "MemoryError"),
    "write_1_gb": ("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))",
                   "OSError: [Errno 27] File too large"),
    "open_a_socket": ("import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)",
                      "ConnectionRefusedError"),
    "read_etc_passwd": ("print(open('/etc/passwd').read())", "FileNotFoundError"),
    "read_the_repo": (f"print(open({os.path.abspath('pyproject.toml')!r}).read())", "FileNotFoundError"),
    "fill_the_folder": ("for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (15 << 20))", "No space left on device"),
    "print_100_mb": ("print('x' * (100 << 20))", "[output cut: 104857601 bytes printed, the first 16384 shown]"),
}


@pytest.mark.parametrize("name", PROBES)
def test_probe_is_an_error_or_capped_never_a_hang(name):
    code, expected = PROBES[name]
    with socket.socket() as listening:  # a port on the host's loopback that the sandbox must not reach
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        text, seconds = run(code.replace("PORT", str(listening.getsockname()[1])))
    print(f"probe {name}: {seconds:.2f} s")  # the measured time (pytest -s shows it)
    assert expected in text, text[-500:]
    assert seconds < LIMITS.timeout_s + 10  # the wall-clock limit, plus start and kill on a loaded machine
    assert len(text) < LIMITS.output_bytes + 1000
    if name == "fork_bomb":
        assert run("import os\nprint(sum(1 for _ in range(40) if os.fork() or os._exit(0)))")[0] \
            .startswith("Traceback")  # the 32-process limit: forking fails before 40
    assert sandbox_users() == []  # nothing the code started outlives it
    assert not os.path.exists("big")


def test_the_wall_clock_kill_reaches_a_blocked_child():
    text, seconds = run("import subprocess\nsubprocess.run(['sleep', '100'])")
    assert "wall-clock limit" in text and seconds < LIMITS.timeout_s + 10 and sandbox_users() == []


def test_persistent_interpreter_keeps_state_within_an_episode_only():
    toolset = PythonToolset(persistent=True, limits=LIMITS)

    async def episode_calls():
        first, second = toolset.tools()[0], toolset.tools()[0]  # two episodes' tools
        kept = [await first(code="x = 41"), await first(code="x + 1"), await second(code="print('x' in dir())")]
        with pytest.raises(SandboxError, match="restarted at the next call, its variables are gone"):
            await first(code="while True: pass")
        kept.append(await first(code="print('x' in dir())"))
        await first.aclose()
        await second.aclose()
        return kept

    assert asyncio.run(episode_calls()) == ["(no output)", "42\n", "False\n", "False\n"]
    assert sandbox_users() == []


def test_fresh_interpreter_per_call_by_default():
    async def calls():
        tool = PythonToolset(limits=LIMITS).tools()[0]
        return [await tool(code="x = 1"), await tool(code="print('x' in dir())")]

    assert asyncio.run(calls()) == ["(no output)", "False\n"]


def test_tools_python_in_the_loop_is_exact(tiny_tokenizer):
    task = with_toolsets(NoToolsTask(), tools="python_persistent")
    replies = [call("python", code="n = 6 * 7\nprint(n)"), call("python", code="import os; os.fork and n + 1"),
               "done"]
    traj = play(task, tiny_tokenizer, replies, tool_timeout_s=20.0)
    assert [r.result for r in traj.tool_calls] == ["42\n", "43\n"]
    assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.metrics["template_exact"]
    shown = observations(traj, tiny_tokenizer)
    assert "42" in shown[0] and "43" in shown[1]
    assert sandbox_users() == []  # the episode's end killed its interpreter


def test_arithmetic_with_tools_python_is_solved_by_code(tiny_tokenizer):
    """``--task arithmetic --tools python``: the built-in task with the sandbox beside its calculator."""
    from agent_loop.tasks.registry import get_task

    task = with_toolsets(get_task("arithmetic"), tools="python")
    episode = task.make_episode(0)
    assert [s["function"]["name"] for s in episode.environment.tool_schemas] == ["calculator", "python"]
    expression = episode.info["expression"]
    traj = play(task, tiny_tokenizer, [call("python", code=expression), f"The answer is {episode.answer}."],
                tool_timeout_s=20.0)
    assert traj.tool_calls[0].result == f"{episode.answer}\n" and traj.reward == 1.0 and traj.metrics["template_exact"]


def test_reasoning_gym_arithmetic_with_tools_python_is_scored_by_its_own_scorer(tiny_tokenizer):
    """``--task reasoning_gym:basic_arithmetic --tools python``: the code computes the entry's expression and
    reasoning-gym's ``score_answer`` scores the answer the sandbox printed."""
    from agent_loop.tasks.registry import TaskOptions

    task = TaskOptions(task="reasoning_gym:basic_arithmetic", tools="python").load()
    episode = task.make_episode(0)
    code = f"print(round({episode.info['metadata']['expression']}))"
    traj = play(task, tiny_tokenizer, [call("python", code=code), f"<answer>{episode.answer}</answer>"],
                tool_timeout_s=20.0)
    printed = traj.tool_calls[0].result.strip()
    assert printed == str(episode.answer)  # the sandbox's arithmetic is the dataset's answer
    assert traj.reward == 1.0 and traj.metrics["template_exact"]
    assert task.dataset.score_answer(printed, task.dataset[episode.info["entry"]]) == 1.0  # read through


def test_the_unshare_fallback_still_has_no_network():
    """Without bubblewrap, ``unshare`` gives network and PID namespaces (files stay readable: documented)."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {listening.getsockname()[1]}), timeout=2)"
        text, seconds = run(code, how="unshare")
    assert "ConnectionRefusedError" in text or "Network is unreachable" in text
    assert "wall-clock limit" in run("while True:\n    pass", how="unshare")[0] and seconds < 15
