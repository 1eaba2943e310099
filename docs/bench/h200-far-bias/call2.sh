#!/usr/bin/env bash
# Device call 2 (issue 19): the forward back to one loop (its far split cost 0.085 ms an encoder layer in call 1);
# the query-block pass with its far split (a) against without (b), alternated twice in separate processes; the
# CUDA test of the backward's far path; then the faster one's model step against HF compiled, 3 rounds.
set -uo pipefail
NAME=call2; source scripts/gpu_env.sh
use() { cp ".gpu/ra_$1.py" pretrain/model/relative_attention.py; }
for round in 1 2; do
  for which in a b; do
    use $which; mkdir -p "$OUT/att-$which-$round"
    timeout 90 python3 scripts/bench_attention_gpu.py --models mt5-large:64 --variants triton triton-nograd \
      --out "$OUT/att-$which-$round" > "$OUT/att-$which-$round/log.txt" 2>&1; echo "att $which $round rc=$?"
    grep -E "^\| mt5" "$OUT/att-$which-$round/results.md" | cut -d'|' -f4-10 | sed "s/^/$which$round /"
  done
done
best=$(python3 - "$OUT" <<'PY'
import re, statistics, sys, pathlib
times = {}
for which in "ab":
    for path in pathlib.Path(sys.argv[1]).glob(f"att-{which}-*/results.md"):
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) > 8 and cells[3] == "encoder" and cells[4] == "triton":
                times.setdefault(which, []).append(float(cells[7].split()[0]))
print(min(times, key=lambda w: statistics.median(times[w])))
PY
)
echo "faster: $best"; use "$best"
timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/pretrain/test_relative_attention.py \
  -k "backward_gives or compiled_kernels" > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.txt"
OUT=$OUT/m ./scripts/gpu_bench_model.sh hf 290 --models mt5-large --batch 64 --variants hf-compile ours-compile-triton \
  --steps 6 --warmup 2 --rounds 3 > /dev/null 2>&1; echo "model rc=$?"
grep -E "^\| mt5|^ms|round" "$OUT/m/hf/log.txt" | tail -12
cd "$OUT" && tar czf all.tgz att-* m tests.txt && rm -rf att-* m
