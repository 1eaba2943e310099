#!/usr/bin/env bash
# Device call 1 (issue 19, 2026-12-04 session 2): far score tiles add their saturated range's one bias value in
# every kernel (forward, dq, dk dv with and without the bias gradient) instead of loading it per score.
# A/B against the code before (.gpu/ra_old.py), old and new alternated in separate processes, twice; then the
# CUDA tests of the changed paths; then the model step, old/new alternated.
set -uo pipefail
NAME=call1; source scripts/gpu_env.sh
cp pretrain/model/relative_attention.py /tmp/ra_new.py
use() { cp "$1" pretrain/model/relative_attention.py; }
for round in 1 2; do
  for which in old new; do
    use $([ $which = old ] && echo .gpu/ra_old.py || echo /tmp/ra_new.py)
    mkdir -p "$OUT/att-$which-$round"
    timeout 90 python3 scripts/bench_attention_gpu.py --models mt5-large:64 --variants triton triton-perdiagonal triton-nograd \
      --out "$OUT/att-$which-$round" > "$OUT/att-$which-$round/log.txt" 2>&1; echo "att $which $round rc=$?"
    grep -E "^\| mt5" "$OUT/att-$which-$round/results.md" | sed "s/^/$which$round /"
  done
done
use /tmp/ra_new.py
timeout 170 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_relative_attention.py \
  -k "far_tiles or saturated or compiled_kernels or float64_reference" > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"
tail -5 "$OUT/tests.txt"
for round in 1 2; do
  for which in old new; do
    use $([ $which = old ] && echo .gpu/ra_old.py || echo /tmp/ra_new.py)
    OUT=$OUT/m ./scripts/gpu_bench_model.sh $which-$round 75 --models mt5-large --batch 64 --variants ours-compile-triton \
      --steps 6 --warmup 2 --rounds 3 > /dev/null 2>&1; echo "model $which $round rc=$?"
    grep -E "^\| mt5" "$OUT/m/$which-$round/results.md" | sed "s/^/$which$round /"
  done
done
use /tmp/ra_new.py
cd "$OUT" && tar czf all.tgz att-* m tests.txt && rm -rf att-* m
