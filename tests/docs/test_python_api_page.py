"""docs/python_api.md cannot rot: every ``python`` block of the page runs as it stands (each on its own, in
an empty folder, on the built-in tiny agent), and the page names every public name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "python_api.md"


def blocks(page: Path = PAGE) -> list[tuple[str, int, str]]:
    """(the section heading, the line the block starts on, its code) of each ```python block of ``page``."""
    out, heading = [], ""
    lines = page.read_text(encoding="utf-8").splitlines()
    k = 0
    while k < len(lines):
        line = lines[k]
        if line.startswith("## "):
            heading = line[3:].strip()
        if line.strip() == "```python":
            end = next(j for j in range(k + 1, len(lines)) if lines[j].strip() == "```")
            out.append((heading, k + 2, "\n".join(lines[k + 1:end]) + "\n"))
            k = end
        k += 1
    return out


def block_id(heading: str, line: int) -> str:
    return f"line{line}-" + re.sub(r"[^a-z]+", "-", heading.lower().split(":")[0]).strip("-")


BLOCKS = blocks()
PARAMS = [pytest.param(code, line, id=block_id(heading, line),
                       marks=[pytest.mark.slow] + ([pytest.mark.integration] if "import ray" in code else []))
          for heading, line, code in BLOCKS]


@pytest.mark.parametrize("code, line", PARAMS)
def test_every_block_of_the_page_runs(code, line, tmp_path, monkeypatch):
    """The block runs without an error (its own asserts included) in an empty folder; what it registers in
    advantages' estimator registry is taken out again, so the rest of the session does not see it."""
    import advantages

    monkeypatch.chdir(tmp_path)
    before = dict(advantages.ESTIMATORS)
    try:  # compiled at its own lines of the page, so a traceback names the page's line
        exec(compile("\n" * (line - 1) + code, str(PAGE), "exec"), {"__name__": "docs_python_api"})
    finally:
        for name in set(advantages.ESTIMATORS) - set(before):
            del advantages.ESTIMATORS[name]


def test_the_page_is_found_and_has_a_block_per_section():
    headings = [h for h in re.findall(r"^## (.+)$", PAGE.read_text(encoding="utf-8"), re.M)]
    with_code = {h for h, _, _ in BLOCKS}
    assert len(BLOCKS) >= 12 and set(headings) == with_code, set(headings) - with_code


def test_the_page_names_every_public_name():
    """Each name ``agent_loop`` exports, and the other public entry points, appear in the page."""
    import agent_loop

    text = PAGE.read_text(encoding="utf-8")
    others = ["run_rollouts_ray", "stream_rollouts", "RunSpec", "made_with", "RolloutStats", "BackendSettings",
              "trajectories_to_batch", "collate", "uncollate", "SpanKind", "get_estimator", "register_adv_est",
              "ESTIMATORS", "grpo", "rloo", "reinforce_plus_plus_baseline", "gae", "output_path=", ".train()",
              "scan", "build_view", "episode_rng"]
    missing = [name for name in [*agent_loop.__all__, *others]
               if not any(form in text for form in (f"`{name}", f".{name}", f"{name}("))]
    assert missing == []
    assert "(docs/python_api.md)" in (REPO / "README.md").read_text(encoding="utf-8")  # README links the page
