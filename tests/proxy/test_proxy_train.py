"""``agent-loop train --agent``: the trainer's steps played by an unchanged openai-client agent through the in-process
proxy, which serves each step's new weights; the recorded tokens are the ones the trainer recomputes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from proxy_helpers import ROOT

pytestmark = pytest.mark.integration
AGENT = "examples/agents/openai_tools_agent.py:agent"


def _train(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent_loop.cli", "train", "--agent", AGENT, "--task", "arithmetic",
                           *argv], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(ROOT.parent)})


@pytest.mark.slow
def test_train_with_an_agent_trains_two_steps_on_its_recorded_sessions(tmp_path, tiny_agent_dir):
    run = tmp_path / "run"
    done = _train("--steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--mini-batches", "1",
                  "--output-dir", str(run), "--no-tensorboard", "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["tool_calls"] > 0 for s in steps)
    # the proxy's recorded logprobs are the trainer's own on the recorded tokens (exp(old - sampled) ~ 1)
    assert all(abs(s["mismatch/ratio_min"] - 1) < 1e-3 and abs(s["mismatch/ratio_max"] - 1) < 1e-3 for s in steps)
    for step in (1, 2):
        rows = [json.loads(line) for line in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 8 and all(r["info"]["session_id"].startswith("arithmetic:") for r in rows)
        assert all(r["advantages"] is not None for r in rows)  # trained on
        versions = {v for r in rows for v, s in zip(r["policy_versions"], r["spans"]) if s == 1}
        assert versions == {step - 1}  # step 2 was sampled by the weights step 1 pushed to the proxy's backend


def test_train_agent_refuses_asynchronous_steps_in_one_line(tmp_path):
    done = _train("--max-staleness", "1", "--output-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--agent" in done.stderr
