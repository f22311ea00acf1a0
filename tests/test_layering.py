"""The architecture as rules: which package may import what, and the repo standing alone."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ["masking", "advantages"])
def test_math_packages_import_only_torch(package):
    third_party = imported_modules(package) - set(sys.stdlib_module_names) - {"masking", "advantages"}
    assert third_party <= {"torch", "triton"}, third_party  # triton: the optional CUDA kernels


def test_rollout_path_imports_without_torch():
    code = "import sys, agent_loop.loop, agent_loop.runner, agent_loop.tasks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_nothing_reads_the_folder_beside_the_repo():
    needles = ('"shared"', "../shared")
    offenders = [str(p.relative_to(ROOT)) for folder in ("agent_loop", "masking", "advantages", "trainer", "tests",
                                                         "benchmarks", "examples", "scripts")
                 for p in (ROOT / folder).rglob("*.py")
                 if p != Path(__file__).resolve() and any(n in p.read_text() for n in needles)]
    assert offenders == []
