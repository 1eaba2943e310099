#!/usr/bin/env bash
# The main job end to end on the built-in sample corpus (Python's own documentation text, no download),
# on this machine's CPUs: set up ./.venv, train a tokenizer, write span-corruption shards on a local Ray
# cluster, inspect and verify them, pretrain t5-tiny with ZeRO stage 2 on 2 gloo ranks, resume it, and run
# the tiny ZeRO x loader x workers study. Everything lands under ./demo (rerunning reuses what is finished).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH" PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
OUT=${DEMO_DIR:-demo}
mkdir -p "$OUT"
step() { printf '\n=== %s\n' "$*"; }

step "1/6 the built-in sample corpus"
prep sample-corpus --out "$OUT/corpus"

step "2/6 prep tokenizer: Unigram, T5 layout (<pad>=0 </s>=1 <unk>=2, 100 sentinels on top)"
[ -f "$OUT/tok/tokenizer.json" ] || prep tokenizer --input "$OUT/corpus" --vocab-size 2048 --out "$OUT/tok"

step "3/6 prep corpus on a local Ray cluster (2 workers): span-corruption shards + manifest"
prep corpus --config configs/prep/sample.yaml --input "$OUT/corpus" --tokenizer "$OUT/tok/tokenizer.json" \
  --out "$OUT/shards"
prep inspect "$OUT/shards" --examples 2
prep verify "$OUT/shards"

step "4/6 pretrain --zero 2: t5-tiny, 2 CPU ranks (gloo), 24 steps with a checkpoint at 12"
rm -rf "$OUT/runs/zero2"
pretrain --zero 2 --model t5-tiny --data "$OUT/shards" --out "$OUT/runs/zero2" --nproc 2 \
  --steps 24 --stop-after 12 --micro-batch 4 --global-batch 16 --lr 1e-3 --warmup-steps 4 --log-every 4

step "5/6 pretrain --resume: continue exactly from the step-12 checkpoint"
pretrain --zero 2 --model t5-tiny --data "$OUT/shards" --out "$OUT/runs/zero2" --nproc 2 \
  --steps 24 --micro-batch 4 --global-batch 16 --lr 1e-3 --warmup-steps 4 --log-every 4 --resume

step "6/6 study: t5-tiny x ZeRO {0, 3} x loader {shards, online} x workers {0, 2} on the same shard set"
study run configs/study/cpu-tiny.yaml --data "$OUT/shards" --out "$OUT/study"

printf '\nDemo finished. Shards: %s/shards  run: %s/runs/zero2  study: %s/study/report.md\n' "$OUT" "$OUT" "$OUT"
