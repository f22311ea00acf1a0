"""benchmarks/verl_loop_overhead.py in the verl 0.9.1 side environment (``--quick``): verl's ``tool_agent``
and our AgentLoop run in the same ``AgentLoopWorker`` on the same canned replies, play every turn (the
benchmark checks verl's ``__num_turns__``) and give identical prompts, responses, masks and logprobs."""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".side-envs" / "verl-0.9.1" / "bin" / "python"


def test_quick_run_both_loops_same_token_ids(tmp_path):
    assert SIDE_PYTHON.exists(), (f"the verl 0.9.1 side environment is missing ({SIDE_PYTHON}); build it with "
                                  "`bash scripts/side_env.sh verl-0.9.1`")
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"} | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(SIDE_PYTHON), "benchmarks/verl_loop_overhead.py", "--quick", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, f"the benchmark failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert "ours/theirs" in run.stdout
    results = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["turns"]) for r in results] == [(1, 2), (4, 2)]
    for r in results:
        assert r["same_ids"] is True, r
        for loop in ("tool_agent", "agent_loop"):
            assert 0 < r[loop]["loop_only_ms_per_turn"] <= r[loop]["ms_per_turn"], r
            assert 0 < r[loop]["own_ms_per_turn"] < r[loop]["loop_only_ms_per_turn"], r  # hydra's instantiation out
