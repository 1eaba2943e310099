#!/usr/bin/env bash
# Prepared 2026-12-04 (session 2) for the next session. Run with branch issue19-fp8 checked out (git checkout
# issue19-fp8 in /work/main, or its worktree), carry [".whl", ".gpu"]. Call 1: the CUDA tests of the FP8 ops (now
# triton_ops; the fp32 cast both ways round tells whether call D's NaN was the transposed copy), then the model step
# against bf16 and HF compiled in the same rounds, with a profile of the FP8 step (is it still host-bound?).
set -uo pipefail
NAME=next-fp8; source scripts/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_fp8.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/tests.txt" | tail -12
OUT=$OUT/m ./scripts/gpu_bench_model.sh fp8 360 --models mt5-large --batch 64 --variants hf-compile ours-compile-triton \
  ours-compile-triton-fp8 --steps 6 --warmup 2 --rounds 3 --profile ours-compile-triton-fp8 > /dev/null 2>&1; echo "model rc=$?"
grep -E "^\| mt5|profile|Error|error" "$OUT/m/fp8/log.txt" | tail -14
cd "$OUT" && tar czf all.tgz m && rm -rf m
