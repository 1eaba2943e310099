#!/usr/bin/env bash
# A/Bs of `pretrain` settings on a 2-GPU machine, one table. One `pretrain` launch per variant, all mt5-large, bf16,
# --compile, micro batch 64, global 128, 16 steps: the medians are steps 6-14 and the last PROFILE_STEPS steps
# (default 2) run under torch.profiler (`--profile-steps`), so the table also says how busy the GPU was, how long the
# host sat in device syncs and how the host's time split into forward / backward / DeepSpeed's step:
#   ./scripts/gpu_ab.sh SHARDS [VARIANT ...]      (default: z2 z3 z3-stack z3-mel-on z0, about 7 minutes)
# variants: z0 z1 z2 z3 (that stage), z3-stack (--stage3-gather-unit stack), z3-mel-on
#   (zero_optimization.memory_efficient_linear true: DeepSpeed's own F.linear, which zero3.yaml turns off),
#   z3-expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). Variants start only while DEADLINE seconds
#   (default 540) have not passed. Measured with it: docs/pretrain.md ("Where ZeRO 0 and ZeRO 3 lost time").
# Here first: ./scripts/gpu_wheels.sh; carry .whl and the shard set (see scripts/gpu_study.sh). Results go to $OUT:
# ab.md (the table), ab.log, profiles.tar (each variant's summary.json and profile/{summary.json,ops.txt}) and the
# Chrome traces of the variants in TRACES (default "z0 z2 z3") as VARIANT-trace.json.gz. MODEL, MICRO_BATCH,
# GLOBAL_BATCH and PRECISION (--bf16 / --fp32) override the defaults, e.g. for a CPU smoke run:
#   PATH=.venv/bin:$PATH MODEL=t5-tiny MICRO_BATCH=4 GLOBAL_BATCH=16 PRECISION=--fp32 ./scripts/gpu_ab.sh SHARDS z2 z3
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${1:?shard set}; shift
VARIANTS=${*:-z2 z3 z3-stack z3-mel-on z0}
DEST=${OUT:-gpu-out}; WORK=${WORK:-/tmp/gpu-ab}; DEADLINE=${DEADLINE:-540}; TRACES=${TRACES:-z0 z2 z3}
mkdir -p "$DEST" "$WORK"
NAME=gpu_ab; source scripts/gpu_env.sh
printf 'deepspeed:\n  zero_optimization:\n    memory_efficient_linear: true\n' > "$WORK/mel-on.yaml"
COMMON=(--model "${MODEL:-mt5-large}" --data "$DATA" --steps 16 --steady-skip 5 --micro-batch "${MICRO_BATCH:-64}"
        --global-batch "${GLOBAL_BATCH:-128}" --nproc 2 "${PRECISION:---bf16}" --lr 1e-4 --warmup-steps 2
        --loader-workers 1 --seed 0 --profile-steps "${PROFILE_STEPS:-2}")
for variant in $VARIANTS; do
  envs=()
  case $variant in
    z[0-3]) args=(--zero "${variant#z}" --compile) ;;
    z3-stack) args=(--zero 3 --compile --stage3-gather-unit stack) ;;
    z3-mel-on) args=(--zero 3 --compile --config "$WORK/mel-on.yaml") ;;
    z3-expandable) args=(--zero 3 --compile); envs=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
    *) echo "gpu_ab: unknown variant $variant (z0-z3, z3-stack, z3-mel-on, z3-expandable)" >&2; exit 2 ;;
  esac
  left=$((DEADLINE - SECONDS))
  if ((left < 60)); then echo "== $variant: skipped, ${left}s left of DEADLINE=$DEADLINE" | tee -a "$DEST/ab.log"; continue; fi
  rm -rf "${WORK:?}/$variant"
  echo "== $variant: pretrain ${args[*]} (${left}s left)" | tee -a "$DEST/ab.log"
  env "${envs[@]}" timeout "$((left < 300 ? left : 300))" python3 -m pretrain.cli "${args[@]}" "${COMMON[@]}" \
    --out "$WORK/$variant" 2>&1 | grep -E '^\[(done|startup|profile)\]|rror' | cut -c1-600 | tee -a "$DEST/ab.log"
  trace=$WORK/$variant/profile/trace-rank0.json.gz
  [[ " $TRACES " == *" $variant "* && -f $trace ]] && (($(stat -c %s "$trace") < 16000000)) \
    && cp "$trace" "$DEST/$variant-trace.json.gz"
done
(cd "$WORK" && tar cf "$DEST/profiles.tar" ./*/profile/summary.json ./*/profile/ops.txt ./*/summary.json 2>/dev/null)
python3 - "$WORK" $VARIANTS <<'PY' | tee "$DEST/ab.md"
import json, sys
from pathlib import Path
work, variants = Path(sys.argv[1]), sys.argv[2:]
def load(path):
    return json.loads(path.read_text()) if path.is_file() else {}
rows, base = [], None
for name in variants:
    summary, profile = load(work / name / "summary.json"), load(work / name / "profile" / "summary.json")
    median, phases = summary.get("median") or {}, profile.get("host_phases") or {}
    rows.append((name, summary.get("status", "missing"), median.get("tokens_per_s"), median.get("mfu"),
                 median.get("step_time_s"), summary.get("peak_mem_gib"), profile.get("device_busy_share"),
                 profile.get("host_sync_share"), *(phases.get(p, {}).get("share") for p in ("forward", "backward", "step"))))
    if name == "z2" and median.get("tokens_per_s"):
        base = median["tokens_per_s"]
first = load(work / variants[0] / "config.json")
train, device = first.get("train", {}), first.get("device") or {}
print(f"{train.get('model')}, {first.get('precision')}, {first.get('world_size')} ranks, {device.get('count')} x "
      f"{device.get('name')}, micro {train.get('micro_batch')}, global {first.get('global_batch')}; medians of steps "
      f"6-14; profile of the last {train.get('profile_steps')} steps on rank 0 (shares of the profiled wall time)\n")
print("| variant | status | tok/s | MFU | step s | peak GiB | vs z2 | GPU busy | host in syncs | host fwd / bwd / step |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
for name, status, tokens, mfu, step, peak, busy, sync, fwd, bwd, opt in rows:
    ratio = f"{tokens / base:.2f}x" if tokens and base else "-"
    print(f"| {name} | {status} | {fmt(tokens, ',.0f')} | {fmt(mfu, '.1%')} | {fmt(step, '.3f')} | {fmt(peak, '.1f')} | "
          f"{ratio} | {fmt(busy, '.0%')} | {fmt(sync, '.0%')} | {fmt(fwd, '.0%')} / {fmt(bwd, '.0%')} / {fmt(opt, '.0%')} |")
PY
