#!/usr/bin/env bash
# Set up and run the main job: the relay benchmark, quick form (< 5 min on a 2-core CPU), on
# the embedded default (K in-process ranking instances); writes out/bench/. Extra arguments go
# to `relaygr bench` (e.g. `--seed 1`). The full run (< 1 h): `.venv/bin/relaygr bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/relaygr bench --quick "$@"
