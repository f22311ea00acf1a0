#!/usr/bin/env bash
# Set up (see scripts/setup.sh), lint, and run the whole test suite: unit, slow and integration tests.
# README's second command; CI runs it. A bare `pytest` runs only the unit part (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check .
# the slowest 20 listed: the suite must stay near 30 min. Two pytest-xdist workers, a test file each at a time
# (--dist loadfile: a file's module fixtures are built once): the tests run on one torch thread each
# (tests/conftest.py), so two of them use the two cores; AGENT_LOOP_TEST_WORKERS=0 runs them in this process.
workers=${AGENT_LOOP_TEST_WORKERS:-2}
parallel=()
# files in collection order, the longest recorded first (tests/conftest.py, tests/data/test_durations.json)
[[ "$workers" != 0 ]] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
exec .venv/bin/python -m pytest -q --durations=20 "${parallel[@]}" -m "slow or integration or not slow" "$@"
