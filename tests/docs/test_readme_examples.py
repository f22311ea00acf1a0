"""README's Python examples run as they stand, each in an empty folder on the built-in tiny agent (issue 55 item 7):
the task played through ``rollout()`` on its first screen, and the carry-through returns."""

from __future__ import annotations

import re

import pytest

from tests.docs.test_python_api_page import REPO, blocks

README = REPO / "README.md"
BLOCKS = blocks(README)


def test_the_first_screen_has_the_task_example_the_two_commands_and_the_package_map():
    text = README.read_text(encoding="utf-8")
    first = text[: text.index("## Carry-through returns")]
    assert "verl" in first and "TRL" in first  # how it relates to them
    assert "bash scripts/setup.sh && .venv/bin/agent-loop rollout" in first and "bash scripts/test.sh" in first
    (task,) = [code for heading, _, code in BLOCKS if heading == "Your task, played"]
    assert "(Environment)" in task and "rollout(" in task
    assert len([line for line in task.splitlines() if line.strip()]) <= 22
    package_map = re.search(r"## The packages\n\n```\n(.*?)```", first, flags=re.S).group(1)
    assert [line.split()[0] for line in package_map.splitlines() if not line.startswith(" ")] == [
        "agent_loop/", "masking/", "advantages/", "examples/"]
    assert all((REPO / line.split()[0]).is_dir() for line in package_map.splitlines() if not line.startswith(" "))
    subpackages = [word for line in package_map.splitlines() if line.startswith("  ") and line.strip()
                   for word in line.split() if word.endswith("/")]
    assert {"training/", "recipes/", "cli/"} <= set(subpackages)
    assert all((REPO / "agent_loop" / word).is_dir() for word in subpackages)


@pytest.mark.slow
@pytest.mark.parametrize("heading, line, code", BLOCKS, ids=[f"line{line}" for _, line, _ in BLOCKS])
def test_every_python_block_of_the_readme_runs(heading, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    # compiled at its own lines of README, so a traceback names README's line
    exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
    if heading == "Your task, played":  # the tiny agent, which knows a calculator, solves some of them
        rewards = [t.reward for t in namespace["episodes"]]
        assert len(rewards) == 8 and set(rewards) <= {0.0, 1.0} and sum(rewards) >= 1, rewards
