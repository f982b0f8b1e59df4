#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with everything the README's
# commands need. Idempotent: reinstalls only when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${RELAYGR_EXTRAS:-dev}"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "relaygr needs Python >= 3.10"'
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.relaygr-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # torch first and exactly pinned: a resolver that sees only a range picks the CUDA build.
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
    echo "$want" > "$stamp"
fi
