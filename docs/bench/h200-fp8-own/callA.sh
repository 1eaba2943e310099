#!/usr/bin/env bash
# Device call A (issue 19, 2026-12-04 session 2): in-process A/B of the bias-gradient sum kernel and the forward's
# far-tile masked load (.gpu/ra_ab.py over the module; switches read at each call), attention layer then model step;
# then the CUDA tests with both switches on.
set -uo pipefail
NAME=callA; source scripts/gpu_env.sh
cp .gpu/ra_ab.py pretrain/model/relative_attention.py
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 1000 > "$OUT/gpu.csv" &
SMI=$!
timeout 330 python3 .gpu/ab.py main,sumkernel,fwdfar,both 4 attention,model > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
kill $SMI
RA_FWD_FAR=1 RA_SUM_KERNEL=1 timeout 150 python3 -m pytest -q -x -p no:cacheprovider -p no:warnings --tb=short \
  tests/pretrain/test_relative_attention.py -k "far_tiles or saturated or compiled_kernels or float64_reference or backward_gives" \
  > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.txt"
grep -E "^\||^round" "$OUT/ab.log" | tail -40
