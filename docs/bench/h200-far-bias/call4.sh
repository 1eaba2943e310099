#!/usr/bin/env bash
# Device call 4 (issue 19): the shipped kernels (far tiles of both backward passes with their range's one bias value):
# the CUDA tests of that path, then the model step against HF compiled, 4 rounds in turn, with the clocks sampled.
set -uo pipefail
NAME=call4; source scripts/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_relative_attention.py \
  -k "backward_gives or compiled_kernels" > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 500 > "$OUT/gpu.csv" &
SMI=$!
OUT=$OUT/m ./scripts/gpu_bench_model.sh hf 400 --models mt5-large --batch 64 --variants hf-compile ours-compile-triton \
  --steps 6 --warmup 2 --rounds 4 > /dev/null 2>&1; echo "model rc=$?"
kill $SMI
grep -E "^\| mt5|round" "$OUT/m/hf/log.txt" | tail -8
python3 - "$OUT/gpu.csv" <<'PY'
import statistics, sys
rows = [line.split(", ") for line in open(sys.argv[1]) if line.count(",") >= 3]
busy = [(float(r[1].split()[0]), float(r[2].split()[0])) for r in rows if r[2][0].isdigit() and float(r[2].split()[0]) > 300]
print("samples", len(rows), "busy (>300 W)", len(busy))
for name, values in (("sm MHz", [c for c, _ in busy]), ("W", [p for _, p in busy])):
    if values:
        print(name, "min/median/max", min(values), statistics.median(values), max(values))
PY
cd "$OUT" && tar czf all.tgz m tests.txt gpu.csv && rm -rf m
