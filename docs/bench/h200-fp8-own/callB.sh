#!/usr/bin/env bash
# Device call B (issue 19): the step's GEMMs in bf16 against FP8 (what FP8 could save at most), then the model step
# A/B in one process: the bias-gradient sum kernel and the LM head's loss in one chunk of 8192 target tokens.
set -uo pipefail
NAME=callB; source scripts/gpu_env.sh
cp .gpu/ra_ab.py pretrain/model/relative_attention.py
timeout 150 python3 .gpu/gemms.py > "$OUT/gemms.log" 2>&1; echo "gemms rc=$?"
timeout 300 python3 .gpu/ab.py main,sumkernel,chunk8192,sumkernel-chunk8192 4 model > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -E "^\||^8192|^fp8|peak" "$OUT/gemms.log" "$OUT/ab.log" | cut -d: -f2- | tail -40
