#!/usr/bin/env bash
# Set up and run the main job: the relay benchmark, quick form (< 5 min on a 2-core CPU), on
# the embedded default (K ranking instances; on CPU each in a process of its own); writes
# out/bench/. Extra arguments go to `relaygr bench` (e.g. `--seed 1`). The full run (hours on
# 2 cores: up to 10 minutes of measuring per mode in each search; docs/benchmark.md):
# `.venv/bin/relaygr bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/relaygr bench --quick "$@"
