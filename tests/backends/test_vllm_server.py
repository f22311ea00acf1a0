"""The vLLM server's command line and environment come from one function (agent_loop/backends/vllm_server.py), for
``agent-loop serve`` and for the servers the library starts (``local_vllm_server``), with the flags each passed
before; vLLM's CPU build is recognised by one check, which agrees with vLLM's own; a server's start is waited for
by one health wait."""

import ast
import http.server
import importlib.metadata
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import agent_loop.cli.serve
import agent_loop.model_folders
from agent_loop.backends import vllm_engine, vllm_server
from agent_loop.backends.vllm_server import CPU_SERVER_ARGS, local_vllm_server, vllm_on_cpu, vllm_server_command
from agent_loop.cli import main

ROOT = Path(__file__).resolve().parents[2]
API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def served(capsys) -> tuple[list[str], dict[str, str]]:
    """The command and environment ``serve --dry-run`` printed (a shell line: VAR=value ... python -m ...)."""
    words = capsys.readouterr().out.splitlines()[0].split()
    start = words.index(sys.executable)
    return words[start:], dict(word.split("=", 1) for word in words[:start])


@pytest.mark.parametrize("cpu", [True, False])
def test_serve_runs_the_one_command_with_the_flags_it_always_had(cpu, tiny_agent_dir, capsys, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the rule, not the test worker's core
    monkeypatch.setattr(agent_loop.model_folders, "vllm_on_cpu", lambda: cpu)  # the model check
    monkeypatch.setattr(agent_loop.cli.serve, "vllm_on_cpu", lambda: cpu)  # the command line
    model = str(tiny_agent_dir.resolve())
    assert main(["serve", "--model", model, "--port", "8123", "--lora-rank", "8", "--threads", "1", "--dry-run",
                 "--", "--max-model-len", "512"]) == 0
    command, env = served(capsys)
    assert (command, env) == vllm_server_command(model, port=8123, served_model_name="policy", host="127.0.0.1",
                                                 lora_rank=8, weight_pushes=True, threads=1, cpu=cpu,
                                                 extra=["--max-model-len", "512"])
    assert command == [*API_SERVER, "--model", model, "--served-model-name", "policy", "--host", "127.0.0.1",
                       "--port", "8123", "--generation-config", "vllm", *(CPU_SERVER_ARGS if cpu else ()),
                       "--enable-lora", "--max-lora-rank", "8", "--max-model-len", "512"]
    first_core = str(sorted(os.sched_getaffinity(0))[0])
    cpu_env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "VLLM_CPU_OMP_THREADS_BIND": first_core}
    assert env == {"VLLM_SERVER_DEV_MODE": "1", **(cpu_env if cpu else {}), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def started_servers(monkeypatch) -> list[tuple[list[str], dict]]:
    """(command, env) of every server local_vllm_server starts; nothing runs."""
    started = []

    class Process:
        pid, returncode = -1, None

    def popen(command, env, **kwargs):
        started.append((command, env))
        return Process()

    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    monkeypatch.setattr(vllm_server, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(vllm_server, "stop_process_group", lambda process: None)
    return started


def test_local_servers_run_the_one_command_quiet_with_the_cpu_settings_where_vllm_is_the_cpu_build(monkeypatch):
    started = started_servers(monkeypatch)
    with local_vllm_server("/models/m", "tiny") as url:
        pass
    with local_vllm_server("/models/m", "tiny", lora_rank=8, weight_pushes=True, extra_args=("--max-loras", "1")):
        pass
    (plain, plain_env), (lora, lora_env) = started
    port = plain[plain.index("--port") + 1]
    assert url == f"http://127.0.0.1:{port}"
    assert (plain, plain_env) == _with_environ(vllm_server_command("/models/m", port=int(port),
                                                                   served_model_name="tiny", quiet=True))
    cpu = vllm_on_cpu()
    assert plain == [*API_SERVER, "--model", "/models/m", "--served-model-name", "tiny", "--host", "127.0.0.1",
                     "--port", port, "--generation-config", "vllm", "--disable-log-stats",
                     "--disable-uvicorn-access-log", *(CPU_SERVER_ARGS if cpu else ())]
    assert plain_env.get("VLLM_CPU_KVCACHE_SPACE") == (os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1") if cpu else
                                                       os.environ.get("VLLM_CPU_KVCACHE_SPACE"))
    lora_port = int(lora[lora.index("--port") + 1])
    assert (lora, lora_env) == _with_environ(vllm_server_command(
        "/models/m", port=lora_port, served_model_name="tiny", quiet=True, lora_rank=8, weight_pushes=True,
        extra=("--max-loras", "1")))
    assert lora[-5:] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
    assert lora_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and lora_env["VLLM_SERVER_DEV_MODE"] == "1"


def _with_environ(command_env):
    command, env = command_env
    return command, {**os.environ, **env}


def test_the_command_is_built_in_one_place():
    """No other module spells out vLLM's api_server command line or its CPU flags, or asks a server's health."""
    needles = ("vllm.entrypoints.openai.api_server\"", "\"--enable-lora\"", "\"--generation-config\"",
               "\"--no-enable-chunked-prefill\"", "/health\"")  # and its health wait
    files = [p for folder in ("agent_loop", "trainer", "benchmarks", "examples", "scripts")
             for p in (ROOT / folder).rglob("*.py")]
    offenders = {str(p.relative_to(ROOT)) for p in files if any(n in p.read_text() for n in needles)}
    assert offenders == {"agent_loop/backends/vllm_server.py"}


def test_one_cpu_check_everywhere():
    files = [p for folder in ("agent_loop", "trainer", "benchmarks", "examples", "scripts")
             for p in (ROOT / folder).rglob("*.py")]
    asking_vllm = {str(p.relative_to(ROOT)) for p in files if "is_cpu()" in p.read_text()
                   or "current_platform" in p.read_text()}
    assert asking_vllm <= {"agent_loop/backends/vllm_server.py"}  # its docstring names the rule it follows
    defined = [f"{p.relative_to(ROOT)}" for p in files for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "vllm_on_cpu"]
    assert defined == ["agent_loop/backends/vllm_server.py"]
    assert agent_loop.model_folders.vllm_on_cpu is vllm_on_cpu and vllm_engine.vllm_on_cpu is vllm_on_cpu


@pytest.mark.parametrize("installed, target, expected", [
    ({"vllm-cpu": "0.32.0"}, None, True),
    ({"vllm": "0.11.0"}, None, False),
    ({"vllm": "0.11.0+cpu"}, None, True),  # a source build for the CPU
    ({"vllm": "0.11.0"}, "CPU", True),  # VLLM_TARGET_DEVICE decides first, as in vLLM
    ({}, None, False),
])
def test_the_cpu_check_follows_vllms_rule_from_the_package_metadata(installed, target, expected, monkeypatch):
    if sys.platform.startswith("darwin"):
        pytest.skip("vLLM runs on the CPU on macOS, whatever is installed")

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    if target:
        monkeypatch.setenv("VLLM_TARGET_DEVICE", target)
    assert vllm_on_cpu() is expected


@pytest.mark.slow
def test_the_cpu_check_agrees_with_vllm():
    pytest.importorskip("vllm")
    code = ("from vllm.platforms import current_platform; from agent_loop.backends.vllm_server import vllm_on_cpu; "
            "print(current_platform.is_cpu(), vllm_on_cpu())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    vllm_says, we_say = out.stdout.split()[-2:]
    assert we_say == vllm_says


class _Exited:
    returncode = 3

    def poll(self):
        return self.returncode


class _Running:
    returncode = None

    def poll(self):
        return None


def test_the_health_wait_reports_an_exit_with_the_log_tail_and_gives_up_at_its_deadline(tmp_path):
    from agent_loop.backends.vllm_server import free_port, wait_healthy

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    log = tmp_path / "server.log"
    log.write_text("x" * 5000 + "CUDA out of memory")
    exited = r"^agent-loop serve exited with code 3 while starting:\nx+CUDA out of memory$"
    with pytest.raises(RuntimeError, match=exited) as error:
        wait_healthy(url, _Exited(), timeout_s=60, name="agent-loop serve", log_path=log)
    assert len(str(error.value).split("\n", 1)[1]) == 3000
    with pytest.raises(TimeoutError, match=f"vLLM server at {url} not healthy after 0 s"):
        wait_healthy(url, _Running(), timeout_s=0)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_healthy(f"http://127.0.0.1:{server.server_address[1]}", _Running(), timeout_s=10)  # returns at once
    finally:
        server.shutdown()
        server.server_close()
