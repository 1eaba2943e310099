#!/usr/bin/env bash
# `study tune` on a GPU machine without registry access (the lent H200s), as gpu_study.sh runs a grid:
#   ./scripts/gpu_tune.sh SPACE.yaml SHARDS SECONDS [study tune flags...]
#   ./scripts/gpu_tune.sh configs/tune/h200-mt5-large.yaml .gpu/shards-s 300 --rung-steps 12 --skip-steps 5 \
#       --min-measured 2 --compare-grid docs/study/h200/mt5-large
# runs the tune in .gpu/tunes/SPACE-NAME for at most SECONDS (a rerun goes on: carry .gpu/tunes), then puts its log and
# the tune (tune.md, tune.json, best.yaml, space.yaml, plots, runs/ and logs/ without checkpoints, as tune.tar.gz)
# into $OUT/SPACE-NAME, on any exit. Give the device call 90 s more than SECONDS.
set -uo pipefail
cd "$(dirname "$0")/.."
SPACE=${1:?space file}; DATA=${2:?shard set}; SECONDS_FOR_TUNE=${3:?seconds}; shift 3
NAME_=$(basename "$SPACE" .yaml)
DEST=${OUT:-gpu-out}/$NAME_; mkdir -p "$DEST"
NAME=gpu_tune; source scripts/gpu_env.sh
TUNE=${TUNE_DIR:-.gpu/tunes/$NAME_}
finish() {
  tar -czf "$DEST/tune.tar.gz" -C "$TUNE" --exclude='checkpoints' --exclude='tb' --exclude='*.gate' . 2>/dev/null
  ls -la "$DEST"
}
trap finish EXIT
timeout -s INT -k 60 "$SECONDS_FOR_TUNE" python3 -m pretrain.study.cli tune --space "$SPACE" --data "$DATA" \
  --out "$TUNE" "$@" 2>&1 | grep --line-buffered -v 'real_accelerator.py' | tee "$DEST/tune.log"
