"""inspect on damaged files (issue 30): good lines followed by a huge NUL tail or by binary garbage are shown,
each bad stretch one warning, exit status 0, in memory bounded by the line cap (not the file)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_loop.cli.inspect import main
from agent_loop.inspect.load import Problems, iter_records
from agent_loop.types import Trajectory

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


def good_lines(count: int) -> bytes:
    return b"".join(Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], spans=[1, 1], turn_ids=[0, 0],
                               logprobs=[-0.5, -0.25], messages=[{"role": "user", "content": "q"}], reward=1.0,
                               info={"task": "t", "index": i, "seed": 0}).to_json().encode() + b"\n"
                    for i in range(count))


def test_good_lines_then_binary_garbage_are_shown_with_a_warning(tmp_path, capsys):
    """The probe: good lines followed by binary garbage showed nothing (exit 2)."""
    path = tmp_path / "run.jsonl"
    path.write_bytes(good_lines(12) + bytes(range(256)) * 40 + b"\n\x00\x01garbage\n")
    assert main([str(path), "--quiet", "--html", str(tmp_path / "o.html")]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and f"{path}:13" in err and "Traceback" not in err
    problems = Problems()
    assert [r.trajectory.info["index"] for r in iter_records(path, problems)] == list(range(12))
    assert len(problems) == 42  # each garbage line (the 40 copies of bytes 0-255 hold 40 newlines) counted


MEASURED = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print('peak_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_good_lines_then_a_huge_nul_tail_in_bounded_memory(tmp_path):
    """The probe: 12 good episodes then a 1 GB NUL tail peaked at 2.3 GB; here 400 MB of NULs, in a subprocess
    whose peak memory is measured."""
    path = tmp_path / "run.jsonl"
    path.write_bytes(good_lines(12))
    with open(path, "ab") as f:
        for _ in range(400):
            f.write(b"\0" * (1 << 20))
    # the peak of the inspect process alone: a fresh parent's RUSAGE_CHILDREN (this test process's would hold
    # the peak of every earlier child of the session)
    done = subprocess.run([sys.executable, "-c", MEASURED, sys.executable, "-m", "agent_loop.cli", "inspect", str(path),
                           "--quiet", "--html", str(tmp_path / "o.html")], env=ENV, capture_output=True, text=True,
                          timeout=280)
    peak_kb = int(done.stderr.strip().splitlines()[-1].removeprefix("peak_kb "))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "longer than" in done.stderr and f"{path}:13" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "o.html").exists()
    print(f"peak {peak_kb} KB")
    assert peak_kb < 600_000, peak_kb  # KB: the interpreter + the 32 MB line cap (314 MB measured), not 400 MB more
