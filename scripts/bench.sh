#!/usr/bin/env bash
# Set up and run the main job. Extra arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/relaygr demo "$@"
