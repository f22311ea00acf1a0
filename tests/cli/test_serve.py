"""``agent-loop serve``: the vLLM server command on the CPU build, and a real server it starts."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from agent_loop.backends.vllm_server import CPU_SERVER_ARGS, free_port
from agent_loop.cli import main

AGENT_LOOP = [sys.executable, "-m", "agent_loop.cli"]


def test_dry_run_prints_the_cpu_command_with_weight_pushes_lora_and_passed_arguments(tiny_agent_dir, capsys):
    assert main(["serve", "--model", str(tiny_agent_dir), "--port", "8123", "--lora-rank", "8", "--dry-run",
                 "--", "--max-model-len", "512"]) == 0
    command_line, served = capsys.readouterr().out.splitlines()  # a shell line: VAR=value ... python -m ...
    words = command_line.split()
    env, command = words[:words.index(sys.executable)], words[words.index(sys.executable):]
    assert "VLLM_SERVER_DEV_MODE=1" in env and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in env
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # not `vllm serve` (no metadata on CPU)
    assert command[command.index("--model") + 1] == str(tiny_agent_dir.resolve())
    assert command[command.index("--served-model-name") + 1] == "policy"
    assert " ".join(CPU_SERVER_ARGS) in command_line
    assert command[-4:] == ["--max-lora-rank", "8", "--max-model-len", "512"]
    assert served == "serving 'policy' at http://127.0.0.1:8123 (Ctrl-C stops it)"


def test_a_folder_that_is_no_model_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path), "--dry-run"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("agent-loop serve: --model") and "no config.json" in error
    assert main(["serve", "--model", str(tmp_path / "missing"), "--dry-run"]) == 2
    assert "no such folder" in capsys.readouterr().err


def _models(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
        return [entry["id"] for entry in json.load(response)["data"]]


@pytest.mark.slow
@pytest.mark.integration
def test_serve_starts_a_server_that_rollout_plays_on_and_sigint_stops_it(tiny_agent_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([*AGENT_LOOP, "serve", "--model", str(tiny_agent_dir), "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if _models(url) == ["policy"]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not answer within 300 s"
            time.sleep(1)
        out = tmp_path / "episodes.jsonl"
        played = subprocess.run([*AGENT_LOOP, "rollout", "--backend", "http", "--server", url, "--model",
                                 str(tiny_agent_dir), "--served-model-name", "policy", "--episodes", "4",
                                 "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert played.returncode == 0, played.stderr[-3000:]
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == 4 and all(record["response_ids"] for record in records)
        # an unchanged openai-client agent through the recording proxy, in front of the same upstream server
        recorded = tmp_path / "agent.jsonl"
        played = subprocess.run([*AGENT_LOOP, "rollout", "--agent", "examples/agents/openai_tools_agent.py:agent",
                                 "--backend", "http", "--server", url, "--model", str(tiny_agent_dir),
                                 "--served-model-name", "policy", "--episodes", "2", "--out", str(recorded)],
                                capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
        assert played.returncode == 0, played.stderr[-3000:]
        sessions = [json.loads(line) for line in recorded.read_text().splitlines()]
        assert sorted(r["info"]["index"] for r in sessions) == [0, 1]
        assert all(r["response_ids"] and r["metrics"]["template_exact"] for r in sessions)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            log.close()
    assert server.returncode is not None
