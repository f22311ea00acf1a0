"""docs/verl.md read as a verl user reads it: its finish-reason table is the loop's, its install command is the
one the side environments are built with (scripts/side_env.sh), its multi-node Hydra override is quoted
(the override itself is composed with verl's config in tests/integrations/test_verl_real.py)."""

import re
import shlex
from pathlib import Path

from agent_loop.types import FINISH_REASONS

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "verl.md").read_text()
SIDE_ENV = (ROOT / "scripts" / "side_env.sh").read_text()


def finish_reason_table() -> list[tuple[str, str]]:
    """``(finish_reason, truncated)`` of each row of the table under ``non_tensor_batch["finish_reason"]``."""
    start = DOC.index("| finish_reason | truncated | when |")
    rows = []
    for line in DOC[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        reason, truncated = (cell.strip() for cell in line.strip("|").split("|")[:2])
        rows.append((reason.strip("`"), truncated))
    return rows


def test_the_docs_finish_reasons_are_the_loops():
    table = finish_reason_table()
    assert tuple(reason for reason, _ in table) == FINISH_REASONS
    # the loop marks only a cut episode truncated (episode/loop.py), so observation_overflow is not
    assert [truncated for _, truncated in table] == [str(reason == "length") for reason in FINISH_REASONS]


def install_commands() -> list[list[str]]:
    """The ``pip install`` lines of the bash blocks under "Installing into a verl environment", shell-split."""
    section = DOC[DOC.index("## Installing into a verl environment"):DOC.index("verl's undeclared run-time dependencies")]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if line.startswith("pip install")]


def side_env_install(name: str) -> list[str]:
    """The arguments scripts/side_env.sh gives pip for agent-loop in side environment ``name``."""
    line = next(line for line in SIDE_ENV.splitlines() if line.strip().startswith(f"{name})"))
    command = shlex.split(line.strip()[len(name) + 1:].rstrip(";"))
    assert command[0] == "${pip[@]}" and command[-1] == "torch==2.13.0", line  # pip install, the CPU torch kept
    return command[1:-1]


def test_the_docs_install_commands_are_the_side_environments():
    """A clone (editable, with the verl extra) or a wheel: the side environments run the doc's lines verbatim,
    so the tests against verl (verl_check included) run on what a verl user gets from the doc."""
    commands = install_commands()
    assert ["pip", "install", "-e", ".[verl]"] in commands
    assert any(c[:2] == ["pip", "install"] and c[2].endswith(".whl)[verl]") for c in commands), commands
    assert not any(c[2:] == ["agent-loop"] for c in commands)  # not on the package index
    assert side_env_install("verl-0.9.1") == ["-e", ".[verl]"]
    assert ["pip", "install", *side_env_install("verl-0.8.0")] in commands
    side_requirements = (ROOT / "scripts" / "side_envs" / "verl-0.9.1.txt").read_text()
    assert "cachetools" not in side_requirements  # what verl misses must come from the doc's command
