#!/usr/bin/env bash
# Session 6, call C: pretrain --cudagraphs against the same run without, mt5-large ZeRO 2, fp8 and bf16, micro 32 x 2.
set -uo pipefail
./scripts/gpu_study.sh configs/study/h200-large-cudagraphs.yaml .gpu/shards-s 470 > "$OUT/study-log.txt" 2>&1
echo "study rc=$?"; grep -E "mt5-large|Error|error" "$OUT/study-log.txt" | tail -12
