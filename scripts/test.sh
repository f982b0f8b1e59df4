#!/usr/bin/env bash
# Set up and run the checks CI runs: lint, types, and the default (fast) test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m slow` for the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
