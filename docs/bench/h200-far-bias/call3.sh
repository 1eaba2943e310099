#!/usr/bin/env bash
# Device call 3 (issue 19): the forward with far tiles chosen inside its one loop (c) against without (a), alternated
# twice; the bits of HEAD's kernels (old), a and c at mt5-large's shapes; then the faster one's model step alone,
# 3 rounds at batch 64 and once at 96 and 128 (best fitting batch), with the GPU's clocks and power sampled.
set -uo pipefail
NAME=call3; source scripts/gpu_env.sh
use() { cp ".gpu/ra_$1.py" pretrain/model/relative_attention.py; }
for round in 1 2; do
  for which in a c; do
    use $which; mkdir -p "$OUT/att-$which-$round"
    timeout 80 python3 scripts/bench_attention_gpu.py --models mt5-large:64 --variants triton triton-nograd \
      --out "$OUT/att-$which-$round" > "$OUT/att-$which-$round/log.txt" 2>&1; echo "att $which $round rc=$?"
    grep -E "^\| mt5" "$OUT/att-$which-$round/results.md" | cut -d'|' -f4-10 | sed "s/^/$which$round /"
  done
done
for which in old a c; do use $which; timeout 60 python3 .gpu/bits.py 2>&1 | grep "^bits" | sed "s/^/$which /"; done
best=$(python3 - "$OUT" <<'PY'
import statistics, sys, pathlib
times = {}
for which in "ac":
    for path in pathlib.Path(sys.argv[1]).glob(f"att-{which}-*/results.md"):
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) > 8 and cells[3] == "encoder" and cells[4] == "triton":
                times.setdefault(which, []).append(float(cells[7].split()[0]))
a, c = statistics.median(times["a"]), statistics.median(times["c"])
print("c" if c < 0.99 * a else "a")
PY
)
echo "kept: $best"; use "$best"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 500 > "$OUT/gpu.csv" &
SMI=$!
OUT=$OUT/m ./scripts/gpu_bench_model.sh ours 200 --models mt5-large --batch 64 --batches 96 128 --variants ours-compile-triton \
  --steps 6 --warmup 2 --rounds 3 > /dev/null 2>&1; echo "model rc=$?"
kill $SMI
grep -E "^\| mt5|round" "$OUT/m/ours/log.txt" | tail -12
python3 - "$OUT/gpu.csv" <<'PY'
import statistics, sys
rows = [line.split(", ") for line in open(sys.argv[1]) if line.count(",") >= 3]
clocks = [float(r[1].split()[0]) for r in rows]; power = [float(r[2].split()[0]) for r in rows if r[2][0].isdigit()]
busy = [(c, p) for c, p in zip(clocks, power) if p > 300]
print("samples", len(rows), "busy (>300 W)", len(busy))
for name, values in (("sm MHz", [c for c, _ in busy]), ("W", [p for _, p in busy])):
    if values:
        print(name, "min/median/max", min(values), statistics.median(values), max(values))
print("throttle reasons", sorted({r[3].strip() for r in rows}))
PY
cd "$OUT" && tar czf all.tgz att-* m gpu.csv && rm -rf att-* m
