#!/usr/bin/env bash
# scripts/bench_model_gpu.py on a GPU machine without registry access (the lent H200s), cut at a time limit:
#   ./scripts/gpu_bench_model.sh NAME SECONDS [bench_model_gpu flags...]
#   ./scripts/gpu_bench_model.sh large 280 --models mt5-large --batch 64 --variants ours-compile-triton hf-compile --rounds 3
# runs it for at most SECONDS (SIGINT: the script still writes the rows it measured), with the environment of the
# other gpu_*.sh scripts (scripts/gpu_env.sh); its log, results.json and results.md in $OUT/NAME (3 of the 8 files
# a device call brings back).
set -uo pipefail
cd "$(dirname "$0")/.."
NAME_=${1:?name}; SECONDS_FOR_RUN=${2:?seconds}; shift 2
DEST=${OUT:-gpu-out}/$NAME_; mkdir -p "$DEST"
NAME=gpu_bench_model; source scripts/gpu_env.sh
timeout -s INT -k 20 "$SECONDS_FOR_RUN" python3 scripts/bench_model_gpu.py --out "$DEST" "$@" 2>&1 | tee "$DEST/log.txt"
