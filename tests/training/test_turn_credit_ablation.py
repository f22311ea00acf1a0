"""examples/turn_credit_ablation.py at tiny sizes on the tiny agent (issue 47 item 5): a warm start on keydoor's
demonstrations, two estimators one after the other, the held-out start measured once per seed, the table, the
curves and the histories written, only the latest checkpoint kept; then a run cut off after its step-2 checkpoint
(what a kill before the step-3 checkpoint leaves: step 3's metrics logged, no step_000003, no result.json) goes on
from that checkpoint, and a finished run trains on from its last checkpoint when --steps grows (to 3: one step more
shows both); the warm start and the start's held-out rates are reused. Those semantics are the script's, whatever
plays the episodes, so they are tested on the transformers backend; the in-process vLLM engine (as SmolLM2's runs
play) gets a run of its own, which must close the engine's process, or the process slot's exit waits on it and no
run after it starts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.processes import alive

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("reinforce_plus_plus", "gigpo")


def ablation(out: Path, steps: int, backend: str = "hf", variants: tuple[str, ...] = VARIANTS) -> str:
    command = [sys.executable, str(ROOT / "examples" / "turn_credit_ablation.py"), "--warm-start-steps", "2",
               "--warm-start-episodes", "8", "--warm-start-batch", "4", "--steps", str(steps), "--prompts-per-step", "2",
               "--group-size", "2", "--eval-episodes", "2", "--save-every", "1", "--max-response-tokens", "384",
               "--greedy", "--variants", *variants, "--backend", backend, "--parallel", "1", "--threads", "1",
               "--output-dir", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def steps_logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_ablation_writes_its_outputs_and_resumes_a_cut_run(tmp_path):
    out = tmp_path / "ablation"
    first = ablation(out, 2)
    assert "warm start: 2 steps on keydoor's demonstrations" in first
    assert (out / "warmstart" / "model" / "config.json").is_file()
    results = json.loads((out / "histories.json").read_text())
    assert [r["variant"] for r in results] == list(VARIANTS)
    start = json.loads((out / "start-seed0.json").read_text())
    for r in results:
        assert [m["step"] for m in r["history"]] == [1, 2]
        assert r["held_out"]["start"] == start  # measured once per seed, the same start for every variant
        assert set(r["held_out"]["end"]) == set(start) == {"greedy", "sampled"}
        assert all(0.0 <= v <= 1.0 for v in r["held_out"]["end"].values())
        assert all("good_moves" in m and "success" in m for m in r["history"])
        checkpoints = out / f"{r['variant']}-seed0" / "checkpoints"
        assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000002"]  # saved at 1 and 2, latest kept
    table = (out / "results.md").read_text()
    for variant in VARIANTS:
        assert f"| {variant} | 1 |" in table and f"| {variant} | 0 |" in table  # the summary row and the run's
    assert "steps to 0.5" in table and "Command: `python examples/turn_credit_ablation.py" in table
    assert (out / "learning_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # cut off after step 3 was logged and before its checkpoint: no step_000003, no result.json
    run = out / "gigpo-seed0"
    before = steps_logged(run)
    cut = {**before[-1], "step": 3, "success": -1.0}
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(cut) + "\n")
    (run / "result.json").unlink()
    finished = out / "reinforce_plus_plus-seed0"
    finished_before = steps_logged(finished)

    second = ablation(out, 3)  # the cut run goes on from step 2; the finished one trains on to step 3
    assert "=== gigpo (seed 0) resumed ===" in second and "warm start:" not in second
    assert "=== reinforce_plus_plus (seed 0) resumed ===" in second
    after = steps_logged(run)
    assert [m["step"] for m in after] == [1, 2, 3]  # the cut step 3 trimmed, trained again, logged once
    assert after[:2] == before and after[2]["success"] != -1.0
    assert steps_logged(finished)[:2] == finished_before
    for folder in (run, finished):
        resumed = json.loads((folder / "result.json").read_text())
        assert resumed["resumed"] and [m["step"] for m in resumed["history"]] == [1, 2, 3]
        assert sorted(p.name for p in (folder / "checkpoints").glob("step_*")) == ["step_000003"]
        assert resumed["held_out"]["start"] == start
    assert len(json.loads((out / "histories.json").read_text())) == 2


@pytest.mark.slow
def test_a_run_on_the_vllm_engine_closes_it(tmp_path):
    """A run's process (a pool worker) exits only once its engine is closed: an open engine would hold it, and the
    command (and every run after it) would wait forever."""
    out = tmp_path / "ablation"
    ablation(out, 1, backend="vllm", variants=VARIANTS[:1])  # returns: the pool's worker exited
    [result] = json.loads((out / "histories.json").read_text())
    assert result["variant"] == VARIANTS[0] and [m["step"] for m in result["history"]] == [1]
    assert (out / f"{VARIANTS[0]}-seed0" / "vllm.log").stat().st_size  # played on the engine: its log


def test_an_unregistered_estimator_is_refused_before_any_work(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("turn_credit_ablation", ROOT / "examples" / "turn_credit_ablation.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit, match="estimators not registered: turn_nope"):
        script.main(["--variants", "grpo", "turn_nope", "--warm-start-steps", "2", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "warmstart").exists()
    with pytest.raises(SystemExit, match="no finished runs"):
        script.main(["--collect", "--output-dir", str(tmp_path / "out")])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigterm_stops_the_runs_processes_too(tmp_path):
    """A kill of the command (a scheduler's stop) reaches its runs: none goes on training, orphaned."""
    out = tmp_path / "ablation"
    command = [sys.executable, str(ROOT / "examples" / "turn_credit_ablation.py"), "--steps", "500",
               "--prompts-per-step", "2", "--group-size", "2", "--eval-episodes", "2", "--save-every", "1",
               "--max-response-tokens", "384", "--variants", "reinforce_plus_plus", "--parallel", "1", "--threads", "1",
               "--output-dir", str(out)]
    popen = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    main, seen = psutil.Process(popen.pid), set()
    metrics = out / "reinforce_plus_plus-seed0" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):  # the run's process is training
        seen |= set(main.children(recursive=True))
        if popen.poll() is not None or time.monotonic() > deadline:
            popen.kill()
            pytest.fail(f"no training step within 300 s: {popen.communicate()[1][-3000:]}")
        time.sleep(0.2)
    seen |= set(main.children(recursive=True))
    popen.send_signal(signal.SIGTERM)
    stderr = popen.communicate(timeout=120)[1]
    deadline = time.monotonic() + 10.0  # a run that is exiting gets a few seconds
    while time.monotonic() < deadline and any(alive(p) for p in seen):
        time.sleep(0.2)
    left = [p for p in seen if alive(p)]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not left, f"{len(left)} processes outlived the command: {[' '.join(p.cmdline())[:80] for p in left]}"
    assert popen.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in stderr, stderr[-3000:]
    assert len(steps_logged(out / "reinforce_plus_plus-seed0")) < 500
