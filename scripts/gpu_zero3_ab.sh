#!/usr/bin/env bash
# ZeRO-3 A/Bs on a 2-GPU machine (issue 5: ZeRO 3 ran at 0.59x ZeRO 2 on 2 x H200, ~0.25 s more per micro-step).
# One `pretrain` launch per variant, all mt5-large, bf16, --compile, micro batch 64, global 128, 14 steps (5 skipped),
# then a table of tok/s, MFU, step time and peak memory against ZeRO 2 measured in the same call:
#   ./scripts/gpu_zero3_ab.sh SHARDS [VARIANT ...]      (default: all variants below, about 6 minutes)
# variants: z2 (baseline), z3, z3-mel-off (zero_optimization.memory_efficient_linear false: keep torch's F.linear),
#           z3-expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), z3-stack (--stage3-gather-unit stack)
# Here first: ./scripts/gpu_wheels.sh; carry .whl and the shard set (see scripts/gpu_study.sh). Results go to $OUT.
# MODEL, MICRO_BATCH, GLOBAL_BATCH and PRECISION (--bf16 / --fp32) override the defaults, e.g. for a CPU smoke run:
#   PATH=.venv/bin:$PATH MODEL=t5-tiny MICRO_BATCH=4 GLOBAL_BATCH=16 PRECISION=--fp32 ./scripts/gpu_zero3_ab.sh SHARDS
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${1:?shard set}; shift
VARIANTS=${*:-z2 z3 z3-mel-off z3-expandable z3-stack}
DEST=${OUT:-gpu-out}; WORK=${WORK:-/tmp/zero3-ab}; mkdir -p "$DEST" "$WORK"
NAME=gpu_zero3_ab; source scripts/gpu_env.sh
printf 'deepspeed:\n  zero_optimization:\n    memory_efficient_linear: false\n' > "$WORK/mel-off.yaml"
COMMON=(--model "${MODEL:-mt5-large}" --data "$DATA" --steps 14 --steady-skip 5 --micro-batch "${MICRO_BATCH:-64}"
        --global-batch "${GLOBAL_BATCH:-128}" --nproc 2 "${PRECISION:---bf16}" --compile --lr 1e-4 --warmup-steps 2
        --loader-workers 1 --seed 0)
for variant in $VARIANTS; do
  case $variant in
    z2) args=(--zero 2); envs=() ;;
    z3) args=(--zero 3); envs=() ;;
    z3-mel-off) args=(--zero 3 --config "$WORK/mel-off.yaml"); envs=() ;;
    z3-expandable) args=(--zero 3); envs=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
    z3-stack) args=(--zero 3 --stage3-gather-unit stack); envs=() ;;
    *) echo "gpu_zero3_ab: unknown variant $variant (z2 z3 z3-mel-off z3-expandable z3-stack)" >&2; exit 2 ;;
  esac
  rm -rf "${WORK:?}/$variant"
  echo "== $variant: pretrain ${args[*]}"
  env "${envs[@]}" timeout 300 python3 -m pretrain.cli "${args[@]}" "${COMMON[@]}" --out "$WORK/$variant" 2>&1 \
    | grep -E '^\[(done|startup)\]|rror' | tee -a "$DEST/zero3_ab.log"
done
python3 - "$WORK" $VARIANTS <<'PY' | tee "$DEST/zero3_ab.md"
import json, sys
from pathlib import Path
work, variants = Path(sys.argv[1]), sys.argv[2:]
rows, base = [], None
for name in variants:
    path = work / name / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {"status": "missing"}
    median = summary.get("median") or {}
    rows.append((name, summary.get("status"), median.get("tokens_per_s"), median.get("mfu"), median.get("step_time_s"),
                 summary.get("peak_mem_gib")))
    if name == "z2" and median.get("tokens_per_s"):
        base = median["tokens_per_s"]
config_path = work / variants[0] / "config.json"
first = json.loads(config_path.read_text()) if config_path.is_file() else {}
train, device = first.get("train", {}), first.get("device") or {}
print(f"{train.get('model')}, {first.get('precision')}, --compile, {first.get('world_size')} ranks, "
      f"{device.get('count')} x {device.get('name')}, micro {train.get('micro_batch')}, "
      f"global {first.get('global_batch')}; medians of steps 6-14\n")
print("| variant | status | tok/s | MFU | step s | peak GiB | vs z2 |\n|---|---|---:|---:|---:|---:|---:|")
for name, status, tokens, mfu, step, peak in rows:
    ratio = f"{tokens / base:.2f}x" if tokens and base else "-"
    fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
    print(f"| {name} | {status} | {fmt(tokens, ',.0f')} | {fmt(mfu, '.1%')} | {fmt(step, '.3f')} | "
          f"{fmt(peak, '.1f')} | {ratio} |")
PY
