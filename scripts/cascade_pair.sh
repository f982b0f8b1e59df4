#!/usr/bin/env bash
# The two-model ML-1M cascade of docs/training.md in one command: two runs of one preset that
# differ only in their seed, trained side by side (A: the retrieval stage, B: the ranker), then
# B ranking A's top 200 against its cached prefix, the stage weight fitted on the validation
# users, evaluated on all 6,040 test users beside A alone.
#   scripts/cascade_pair.sh [PRESET] [EXTRA train args...]
# RANKER=PRESET trains B from another preset (e.g. paper-large: a bigger ranker behind the same
# stage), RANKER_ARGS adds train args to B alone.
# e.g. DEVICE=cuda THREADS=6 scripts/cascade_pair.sh paper          (the issue's target preset)
#      DEVICE=cuda THREADS=4 RANKER=paper-large RANKER_ARGS="--set max_epochs=60" \
#          scripts/cascade_pair.sh paper                              (the best pair measured)
#      scripts/cascade_pair.sh quick                                 (2 cores: ~20 min)
#      scripts/cascade_pair.sh paper --set max_epochs=50
set -euo pipefail
PRESET=${1:-paper}
shift || true
DATA=${DATA:-../shared/datasets/ml-1m}
RUNS=${RUNS:-runs/cascade-$PRESET}
DEVICE=${DEVICE:-cpu}
THREADS=${THREADS:-1}
PY=${PY:-python}
RANKER=${RANKER:-$PRESET}
read -r -a ranker_args <<< "${RANKER_ARGS:-}"
relaygr() { PYTHONPATH=src $PY -m relaygr "$@"; }
mkdir -p "$RUNS"
start=$(date +%s)
train() {   # train SEED PRESET [args...]
  local seed=$1 preset=$2
  shift 2
  relaygr train --dataset ml-1m --data-dir "$DATA" --out "$RUNS/seed$seed" --preset "$preset" \
    --device "$DEVICE" --threads "$THREADS" --seed "$seed" --no-progress "$@" \
    > "$RUNS/train-seed$seed.log" 2>&1
}
train 0 "$PRESET" "$@" & stage=$!
train 1 "$RANKER" "$@" "${ranker_args[@]}" & ranker=$!
wait "$stage"
wait "$ranker"
echo "trained both in $(( $(date +%s) - start )) s (logs: $RUNS/train-seed*.log)"
relaygr eval --checkpoint "$RUNS/seed1" --retrieval "$RUNS/seed0" --fit-stage-weight \
  --dataset ml-1m --data-dir "$DATA" --device "$DEVICE" --threads $(( 2 * THREADS )) \
  --heads retrieval,cascade --json "$RUNS/cascade.json" --no-progress
