#!/usr/bin/env bash
# Session 3, call 2: the cast's transposed copy loaded transposed (no tl.trans); CUDA tests of the cast and linear,
# and only if they pass, 400-step loss parity of FP8 against bf16 Triton (t5-v1_1-base, batch 64, seeds 0 1).
set -uo pipefail
NAME=call2; source scripts/gpu_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_fp8.py \
  -k "cast or linear or converted or compiles" > "$OUT/tests.txt" 2>&1
rc=$?; echo "tests rc=$rc"; grep -E "^FAILED|passed|failed" "$OUT/tests.txt" | tail -8
[ $rc -eq 0 ] || exit 1
./scripts/gpu_parity.sh fp8 470 --data .gpu/shards-s --model t5-v1_1-base --batch 64 --steps 400 --seeds 0 1 --jobs 4 \
  --variants ours-compile-triton ours-compile-triton-fp8 > "$OUT/parity-log.txt" 2>&1; echo "parity rc=$?"
tail -30 "$OUT/fp8/parity.md" 2>/dev/null
