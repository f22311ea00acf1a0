"""docs/verl.md read as a verl user reads it: its finish-reason table is the loop's, its install command is the
one the side environments are built with (scripts/side_env.sh), its multi-node Hydra override is quoted
(the override itself is composed with verl's config in tests/integrations/test_verl_real.py)."""

from pathlib import Path

from agent_loop.types import FINISH_REASONS

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "verl.md").read_text()


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
