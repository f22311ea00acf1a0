#!/usr/bin/env bash
# Set up (see scripts/setup.sh) and run the whole test suite. README's second command; CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q --durations=20 "$@"  # the slowest 20 listed: the suite must stay near 30 min
