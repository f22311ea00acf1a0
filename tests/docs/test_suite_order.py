"""The record that orders README's test command (tests/conftest.py: the longest files first, so neither pytest-xdist
worker idles at the end) stays true to the tree: a file renamed or moved after the record would go last, unrecorded,
and a long one there makes the suite's tail (the layout change of issue 55 moved tests/trainer to tests/training, and
the 3.5-minute turn-credit ablation ran last)."""

import json
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def test_the_recorded_durations_name_existing_files_and_every_file_with_slow_tests():
    recorded = json.loads((TESTS / "data" / "test_durations.json").read_text())
    gone = sorted(name for name in recorded if not (ROOT / name).is_file())
    assert not gone, f"recorded but no longer there (re-record: AGENT_LOOP_RECORD_DURATIONS, tests/conftest.py): {gone}"
    slow = sorted(str(path.relative_to(ROOT)) for path in TESTS.rglob("test_*.py")
                  if "pytest.mark.slow" in path.read_text() or "pytest.mark.integration" in path.read_text())
    unrecorded = [name for name in slow if name not in recorded]
    assert not unrecorded, f"slow or integration tests with no recorded duration (they would run last): {unrecorded}"
