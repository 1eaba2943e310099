#!/usr/bin/env bash
# Session 7, call 1: issue 19's FP8 goal (>= 1.5x HF compiled) with the blocks as CUDA graphs, on one H200.
# HF compiled (82 GiB at batch 64) and FP8 with graphs (its pools) do not fit one process together (--rounds OOMs,
# docs/bench/h200-cudagraphs-s6/a5-hf-oom-tail.txt), so each run is its own process, each variant's memory given
# back before the next, the order alternating run to run; runs go on while 170 s of the call's 540 s are left.
# The spread is over runs (each run's median of 10 timed steps). mt5-large, batch 64, 512/114.
set -uo pipefail
NAME=s7c1; source scripts/gpu_env.sh
lscpu | grep -E "Model name|^CPU\(s\)" | head -2; cat /proc/loadavg
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
B="--models mt5-large --batch 64 --steps 10 --warmup 3"
START=$SECONDS; i=0
while (( SECONDS - START < 540 - 170 )); do
  i=$((i + 1))
  if (( i % 2 )); then V="hf-compile ours-compile-triton-fp8-cudagraphs"; else V="ours-compile-triton-fp8-cudagraphs hf-compile"; fi
  (OUT=$OUT/m ./scripts/gpu_bench_model.sh run$i 200 $B --variants $V > /dev/null 2>&1); echo "run $i rc=$? at $((SECONDS - START)) s"
  grep -E "^\| mt5" "$OUT/m/run$i/log.txt" | cut -c1-400
done
cat /proc/loadavg
cd "$OUT" && tar czf model.tgz m && rm -rf m
