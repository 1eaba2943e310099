#!/usr/bin/env bash
# Device call C (issue 19): our FP8 linear (pretrain/model/fp8.py): its CUDA tests, the block linears alone against
# bf16, then the model step against bf16 and HF compiled in the same rounds, and a profile of the FP8 step.
set -uo pipefail
NAME=callC; source scripts/gpu_env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_fp8.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$?"; tail -15 "$OUT/tests.txt"
timeout 90 python3 .gpu/fp8_micro.py > "$OUT/micro.txt" 2>&1; echo "micro rc=$?"; cat "$OUT/micro.txt" | tail -12
OUT=$OUT/m ./scripts/gpu_bench_model.sh fp8 330 --models mt5-large --batch 64 --variants hf-compile ours-compile-triton \
  ours-compile-triton-fp8 --steps 6 --warmup 2 --rounds 3 --profile ours-compile-triton-fp8 > /dev/null 2>&1; echo "model rc=$?"
grep -E "^\| mt5|round|kernel" "$OUT/m/fp8/log.txt" | tail -14
cd "$OUT" && tar czf all.tgz m && rm -rf m
