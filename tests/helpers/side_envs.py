"""The side environments scripts/side_env.sh builds (.side-envs/NAME): their python, run from the repo root
(tests/integrations, tests/advantages, tests/ecosystem)."""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def side_python(name: str) -> Path:
    """The side environment's python; pytest.fail (not skip) when it is missing or older than its recipe."""
    env, files = ROOT / ".side-envs" / name, (f"scripts/side_envs/{name}.txt", "scripts/side_env.sh", "pyproject.toml")
    if not (ROOT / files[0]).is_file():
        pytest.fail(f"no side environment recipe {files[0]}")
    recipe = b"".join((ROOT / p).read_bytes() for p in files)
    stamp = env / f".built-{hashlib.sha256(recipe).hexdigest()[:16]}"
    if not (env / "bin" / "python").exists() or not stamp.exists():
        pytest.fail(f"side environment {name} is missing or out of date ({stamp.relative_to(ROOT)} not found): "
                    f"build it with `bash scripts/side_env.sh {name}` (scripts/setup.sh --test builds them all)")
    return env / "bin" / "python"


def run_side(name: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the side python with ``args`` from the repo root, with the caller's verl variables removed."""
    base = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "AGENT_LOOP_VERL_REPLACE_GAE")}
    out = subprocess.run([str(side_python(name)), *args], cwd=ROOT, env={**base, **(env or {})}, capture_output=True,
                         text=True, timeout=timeout)
    return out


def side_json(name: str, *args: str, env: dict | None = None):
    out = run_side(name, *args, env=env)
    assert out.returncode == 0, f"{' '.join(args)} failed in {name}:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def relative(mine, theirs) -> float:
    mine, theirs = torch.as_tensor(mine, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    scale = float(theirs.abs().max())
    return float((mine - theirs).abs().max()) / (scale or 1.0)
