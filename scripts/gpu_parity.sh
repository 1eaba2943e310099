#!/usr/bin/env bash
# scripts/bench_parity.py on a GPU machine without registry access (the lent H200s), archived on any exit:
#   ./scripts/gpu_parity.sh NAME SECONDS [bench_parity flags...]
#   ./scripts/gpu_parity.sh autocast 540 --data .gpu/shards-s --model t5-v1_1-base --batch 64 --steps 400 --seeds 0 1 --jobs 2
#   ./scripts/gpu_parity.sh pretrain 480 --pretrain --data .gpu/shards-s --model t5-v1_1-base --batch 64 --steps 400 --seeds 0 1 --jobs 4
# runs it in .gpu/parity/NAME for at most SECONDS, then puts its log, parity.md, parity.png and everything else
# (parity.json, each run's result and log) as parity.tar.gz into $OUT/NAME. A run that finished is kept in its
# result file: to go on after a cut, unpack parity.tar.gz into .gpu/parity/NAME here, carry .gpu/parity, and rerun
# the same command (finished runs are read, not run again). Give the device call 60 s more than SECONDS.
set -uo pipefail
cd "$(dirname "$0")/.."
NAME_=${1:?name}; SECONDS_FOR_RUN=${2:?seconds}; shift 2
DEST=${OUT:-gpu-out}/$NAME_; mkdir -p "$DEST"
NAME=gpu_parity; source scripts/gpu_env.sh
RUN=.gpu/parity/$NAME_; mkdir -p "$RUN"
finish() {
  cp "$RUN"/parity.md "$RUN"/parity.png "$DEST/" 2>/dev/null
  tar -czf "$DEST/parity.tar.gz" -C "$RUN" --exclude=checkpoints . 2>/dev/null   # a pretrain run cut by the time
  # limit saves a checkpoint on SIGINT (GiBs): its losses so far are in metrics.jsonl, the weights are not needed
  ls -la "$DEST"
}
trap finish EXIT
timeout -s INT -k 30 "$SECONDS_FOR_RUN" python3 scripts/bench_parity.py --out "$RUN" "$@" 2>&1 | tee "$DEST/parity.log"
