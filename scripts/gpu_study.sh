#!/usr/bin/env bash
# Run a study grid on a GPU machine that has torch but no registry access (the lent H200 machines).
# Here first: ./scripts/gpu_wheels.sh (DeepSpeed + its requirements into .whl/) and a shard set prepared with
# `prep corpus` (the GPU machine has no Ray). Carry both; then on the GPU machine:
#   ./scripts/gpu_study.sh GRID.yaml SHARDS [SECONDS]
# runs `study run` for at most SECONDS (default 330; unfinished points are left for a rerun), rebuilds the
# report, and puts the log and the study (study.json, runs/, logs/ as runs.tar.gz) into $OUT/GRID-NAME (or
# ./gpu-out/GRID-NAME): two files per study, as a call brings back at most 8. Give the device call 90 s more than
# SECONDS: an interrupted study stops its launches (up to 40 s), then the report and the archive are written.
# A call cut short anyway (less device time left than asked) still brings back runs.tar.gz as of the last 30 s.
# Here, unpack runs.tar.gz into a directory and run `study report DIR` for results.csv, report.md and the plots.
# The study lives in STUDY_DIR (default .gpu/studies/GRID-NAME). A machine kept warm between calls does NOT keep
# it (the carried .gpu/ paths replace that folder): to go on with a grid, unpack the last runs.tar.gz into
# .gpu/studies/GRID-NAME here and carry .gpu/studies too; finished points are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
GRID=${1:?grid file}; DATA=${2:?shard set}; SECONDS_FOR_STUDY=${3:-330}
DEST=${OUT:-gpu-out}/$(basename "$GRID" .yaml); mkdir -p "$DEST"
NAME=gpu_study; source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "gpus", torch.cuda.device_count())' 2>&1 | grep -v WARNING
STUDY=${STUDY_DIR:-.gpu/studies/$(basename "$GRID" .yaml)}
archive() {  # what is finished so far -> $DEST/runs.tar.gz, replaced whole (a profiled point's Chrome trace,
  # trace-rank0.json.gz, tens of MiB at mt5-xl, stays there: its summary.json and ops.txt come back, and a call
  # brings back at most 16 MiB a file)
  local part="$DEST/.runs-$BASHPID.tar.gz"    # the loop's and finish()'s never share one
  tar -czf "$part" -C "$STUDY" --exclude='checkpoints' --exclude='tb' --exclude='*.gate' \
    --exclude='trace-rank0.json.gz' study.json runs logs 2>/dev/null && mv -f "$part" "$DEST/runs.tar.gz"
  rm -f "$part"
}
finish() {   # whatever ended the study (its time, an error): the report and the archive of what is finished
  [ -n "${ARCHIVER:-}" ] && kill "$ARCHIVER" 2>/dev/null
  python3 -m pretrain.study.cli report "$STUDY" 2>&1 | tee -a "$DEST/study.log"
  archive
  ls -la "$DEST"
}
trap finish EXIT
# a device call cut at its limit (less device time left than asked) kills this script before finish(): archive
# every 30 s too, so that the points finished by then come back
( while sleep 30; do archive; done ) & ARCHIVER=$!
timeout -s INT -k 60 "$SECONDS_FOR_STUDY" python3 -m pretrain.study.cli run "$GRID" --data "$DATA" --out "$STUDY" 2>&1 \
  | grep --line-buffered -v 'real_accelerator.py' | tee "$DEST/study.log"
