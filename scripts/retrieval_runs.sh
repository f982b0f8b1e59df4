#!/usr/bin/env bash
# Every retrieval figure of docs/retrieval.md for one pair: SCCDR and its trained baselines on the
# cvgae split (3 seeds) and the disencdr split, then the three protocols' reports.
#   scripts/retrieval_runs.sh sport_cloth [SEEDS_CVGAE] [SEEDS_DISENCDR] [PRESETS]
# (an empty SEEDS argument skips that split)
set -euo pipefail
PAIR=${1:?pair, e.g. sport_cloth}
SEEDS_A=${2-"0 1 2"}
SEEDS_B=${3-"0"}
PRESETS=${4-"sccdr mixed single lightgcn"}
DATA=${DATA:-/work/shared/datasets/cross-domain/amazon-disencdr}
RUNS=${RUNS:-/work/runs/sccdr}/$PAIR
PY=${PY:-python}
relaygr() { PYTHONPATH=src $PY -m relaygr "$@"; }
for split in cvgae disencdr; do
  seeds=$SEEDS_A; [ "$split" = disencdr ] && seeds=$SEEDS_B
  [ -z "$seeds" ] && continue
  for preset in $PRESETS; do
    out=$RUNS/$split-$preset
    [ -f "$out/done" ] && continue
    start=$(date +%s)
    relaygr train-retrieval --pair "$PAIR" --data-dir "$DATA" --out "$out" --preset "$preset" \
      --split "$split" --seeds $seeds --threads 1 --no-progress
    echo "$(( $(date +%s) - start ))" > "$out/done"
    echo "$PAIR $split $preset: $(cat "$out/done") s"
  done
done
baselines() {
  local split=$1 args=()
  for preset in $PRESETS; do
    [ "$preset" = sccdr ] && continue
    [ -f "$RUNS/$split-$preset/done" ] && args+=(--baseline "$preset=$RUNS/$split-$preset")
  done
  echo "${args[@]}"
}
if [ -n "$SEEDS_A" ]; then
  relaygr eval-retrieval --checkpoint "$RUNS/cvgae-sccdr" --protocol cvgae \
    --json "$RUNS/report-cvgae.json" $(baselines cvgae)
  relaygr eval-retrieval --checkpoint "$RUNS/cvgae-sccdr" --protocol full \
    --json "$RUNS/report-full-cvgae.json" $(baselines cvgae)
fi
if [ -n "$SEEDS_B" ]; then
  relaygr eval-retrieval --checkpoint "$RUNS/disencdr-sccdr" --protocol disencdr \
    --json "$RUNS/report-disencdr.json" $(baselines disencdr)
  relaygr eval-retrieval --checkpoint "$RUNS/disencdr-sccdr" --protocol full \
    --json "$RUNS/report-full-disencdr.json" $(baselines disencdr)
fi
