"""``agent-loop proxy`` as a user runs it: a process on 127.0.0.1 with an API key, an openai-client agent pointed at
it, rewards and ends posted over HTTP, a SIGTERM that writes the sessions still open; the file holds whole
Trajectory lines that ``agent-loop inspect`` opens."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from openai import AsyncOpenAI
from proxy_helpers import ROOT, assert_recorded, openai_tools_agent

from agent_loop.proxy.agents import episode_row
from agent_loop.runners.local import read_trajectories
from agent_loop.tasks.registry import get_task

pytestmark = pytest.mark.integration


def _post(url: str, body: dict, key: str) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status


async def _play(base_url: str, key: str, session_id: str, row: dict) -> list[dict]:
    async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0,
                           default_headers={"X-Session-Id": session_id}) as client:
        tools = {fn.__name__: fn for fn in row["episode"].tools}
        return await openai_tools_agent.chat_loop(client, "policy", row["messages"], row["tools"], tools)


def test_proxy_command_records_sessions_and_writes_open_ones_on_sigterm(tmp_path, tiny_tokenizer, tiny_agent_dir):
    out, key, task = tmp_path / "sessions.jsonl", "s3cret", get_task("arithmetic")
    command = [sys.executable, "-m", "agent_loop.cli", "proxy", "--port", "0", "--out", str(out), "--api-key", key,
               "--temperature", "0"]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(ROOT.parent)})
    try:
        line = server.stdout.readline()
        base_url = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line).group(1)
        for n in range(3):
            asyncio.run(_play(base_url, key, f"ep-{n}", episode_row(task, n, 0)))
        assert _post(f"{base_url}/sessions/ep-0/reward", {"reward": 0.25}, key) == 200
        assert _post(f"{base_url}/sessions/ep-0/end", {}, key) == 200
        assert _post(f"{base_url}/sessions/ep-1/end", {"reward": 1}, key) == 200
        server.send_signal(signal.SIGTERM)  # ep-2 is still open: written as closed by the shutdown
        _, err = server.communicate(timeout=120)
    finally:
        server.kill()
    assert server.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    episodes = read_trajectories(out)  # strict: every line whole
    by_id = {t.info["session_id"]: t for t in episodes}
    assert sorted(by_id) == ["ep-0", "ep-1", "ep-2"]
    assert [by_id[i].metrics["proxy"]["closed_by"] for i in sorted(by_id)] == ["end", "end", "shutdown"]
    assert (by_id["ep-0"].reward, by_id["ep-1"].reward, by_id["ep-2"].reward) == (0.25, 1.0, 0.0)
    assert sum(assert_recorded(t, tiny_tokenizer) for t in episodes) >= 2
    shown = subprocess.run([sys.executable, "-m", "agent_loop.cli", "inspect", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "3 episodes" in " ".join(shown.stdout.split())
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)  # never overwritten
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1 and "--out" in again.stderr
    assert len(read_trajectories(out)) == 3
