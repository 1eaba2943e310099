#!/usr/bin/env bash
# Session 3, call 3: mt5-large batch 64, HF compiled / bf16 Triton / FP8 in the same 4 rounds (FP8 step profiled);
# then mt5-xl through `pretrain` at ZeRO 2 and 3, bf16 against fp8 (configs/study/h200-xl-fp8.yaml).
set -uo pipefail
(OUT=$OUT/m ./scripts/gpu_bench_model.sh fp8 215 --models mt5-large --batch 64 --variants hf-compile ours-compile-triton \
  ours-compile-triton-fp8 --steps 6 --warmup 2 --rounds 4 --profile ours-compile-triton-fp8 > /dev/null 2>&1); echo "model rc=$?"
grep -E "^\| mt5|^round|profile" "$OUT/m/fp8/log.txt" | tail -14
(cd "$OUT" && tar czf model.tgz m && rm -rf m)
./scripts/gpu_study.sh configs/study/h200-xl-fp8.yaml .gpu/shards-s 270 > "$OUT/study-log.txt" 2>&1; echo "study rc=$?"
grep -E "mt5-xl|step|fp8|Error" "$OUT/study-log.txt" | tail -20
