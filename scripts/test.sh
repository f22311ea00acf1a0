#!/usr/bin/env bash
# Set up (see scripts/setup.sh), lint, and run the whole test suite: unit, slow and integration tests.
# README's second command; CI runs it. A bare `pytest` runs only the unit part (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check .
# the slowest 20 listed: the suite must stay near 30 min
exec .venv/bin/python -m pytest -q --durations=20 -m "slow or integration or not slow" "$@"
