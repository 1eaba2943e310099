#!/usr/bin/env bash
# Device call D (issue 19): the FP8 ops as triton_ops on the GPU (Inductor launches the cast kernels): CUDA tests, then
# the model step against bf16 and HF compiled in the same rounds, with a profile of the FP8 step.
set -uo pipefail
NAME=callD; source scripts/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_fp8.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error" "$OUT/tests.txt" | tail -8
OUT=$OUT/m ./scripts/gpu_bench_model.sh fp8 360 --models mt5-large --batch 64 --variants hf-compile ours-compile-triton \
  ours-compile-triton-fp8 --steps 6 --warmup 2 --rounds 3 --profile ours-compile-triton-fp8 > /dev/null 2>&1; echo "model rc=$?"
grep -E "^\| mt5|profile|Error|error" "$OUT/m/fp8/log.txt" | tail -14
cd "$OUT" && tar czf all.tgz m && rm -rf m
