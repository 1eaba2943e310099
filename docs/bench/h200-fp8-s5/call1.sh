#!/usr/bin/env bash
# Next session, call A (main checked out; carry [".whl", ".gpu"]; a cold machine compiles HF for ~125-200 s, so the
# benchmark gets 420 s): the CUDA tests of the FP8 ops (~60 s; the (1,) scale of e9cd38a and the fused feed-forward
# are new), then mt5-large batch 64, HF compiled / FP8 / FP8 with the input gradient's fast accumulation / FP8 with
# the fused feed-forward in the same 5 rounds, FP8 profiled (is fused_empty gone? who issues the memsets?).
# bf16 is left out (43.3% at stop 40, its code unchanged since): four models held are what fit beside HF's peak.
set -uo pipefail
NAME=next-a; source scripts/gpu_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_fp8.py \
  tests/pretrain/test_gated_gelu.py -k "cast or linear or converted or compiles or fused or ffn or hand_over" \
  > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"
grep -E "^FAILED|passed|failed" "$OUT/tests.txt" | tail -6
(OUT=$OUT/m ./scripts/gpu_bench_model.sh fp8 420 --models mt5-large --batch 64 --variants hf-compile \
  ours-compile-triton-fp8 ours-compile-triton-fp8-fastdx ours-compile-triton-fp8-fusedffn --steps 6 --warmup 2 \
  --rounds 5 --profile ours-compile-triton-fp8 > /dev/null 2>&1); echo "model rc=$?"
grep -E "^\| mt5|^round|profile" "$OUT/m/fp8/log.txt" | cut -c1-700 | tail -14
cd "$OUT" && tar czf model.tgz m && rm -rf m
