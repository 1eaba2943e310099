#!/usr/bin/env bash
# Session 5, call 2: the shipped FP8 (feed-forwards fused) against HF compiled, 7 rounds, and -fastdx on top; the
# CUDA tests of the FP8 ops first (two test bugs fixed since call 1).
set -uo pipefail
NAME=a2; source scripts/gpu_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_fp8.py \
  tests/pretrain/test_gated_gelu.py -k "cast or linear or converted or compiles or fused or ffn or hand_over or fuses" \
  > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"
grep -E "^FAILED|passed|failed" "$OUT/tests.txt" | tail -6
(OUT=$OUT/m ./scripts/gpu_bench_model.sh fp8 430 --models mt5-large --batch 64 --variants hf-compile \
  ours-compile-triton-fp8 ours-compile-triton-fp8-fastdx --steps 6 --warmup 2 --rounds 7 \
  --profile ours-compile-triton-fp8 > /dev/null 2>&1); echo "model rc=$?"
grep -E "^\| mt5|^round|profile" "$OUT/m/fp8/log.txt" | cut -c1-900 | tail -16
cd "$OUT" && tar czf model.tgz m && rm -rf m
