#!/usr/bin/env bash
# Session 6, call 1: does Inductor's CUDA graphs per block (compile_regions(mode="reduce-overhead")) take the host's
# launches out of the FP8 step? 1) FP8 vs FP8-cudagraphs (5 rounds, perf hints: why a graph was skipped);
# 2) HF compiled vs FP8-cudagraphs (5 rounds: the headline ratio; separate process for memory);
# 3) grads across gradient accumulation with and without the copy-out hook (t5-tiny). mt5-large, batch 64, 512/114, one H200.
set -uo pipefail
NAME=a5; source scripts/gpu_env.sh
lscpu | grep -E "Model name|^CPU\(s\)" | head -2; cat /proc/loadavg
echo "== gradient accumulation under reduce-overhead (t5-tiny, fp32):"
timeout 120 python3 .gpu/cg_accum.py 2>&1 | grep -vi warn | tail -4
B="--models mt5-large --batch 64 --steps 6 --warmup 2"
(OUT=$OUT/m TORCH_LOGS=perf_hints ./scripts/gpu_bench_model.sh fp8cg 160 $B --rounds 5 --variants \
  ours-compile-triton-fp8 ours-compile-triton-fp8-cudagraphs > /dev/null 2>&1); echo "1 rc=$?"
grep -E "^\| mt5|^round" "$OUT/m/fp8cg/log.txt" | cut -c1-600 | tail -8
grep -iE "skipping cudagraph|cudagraph" "$OUT/m/fp8cg/log.txt" | sort | uniq -c | head -8
(OUT=$OUT/m ./scripts/gpu_bench_model.sh hf 280 $B --rounds 5 --variants \
  hf-compile ours-compile-triton-fp8-cudagraphs > /dev/null 2>&1); echo "2 rc=$?"
grep -E "^\| mt5|^round" "$OUT/m/hf/log.txt" | cut -c1-600 | tail -8
cat /proc/loadavg; tail -5 "$OUT/m/fp8cg/log.txt" | cut -c1-300
cd "$OUT" && tar czf model.tgz m && rm -rf m
