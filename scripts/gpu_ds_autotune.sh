#!/usr/bin/env bash
# DeepSpeed's own autotuner over `pretrain` on a GPU machine (issue 17: its answer and time beside `study tune`'s).
#   ./scripts/gpu_ds_autotune.sh MODEL SHARDS GLOBAL_BATCH STAGES [SECONDS] [pretrain flags...]
#   ./scripts/gpu_ds_autotune.sh mt5-large .gpu/shards-s 64 0,2,3 540 --compile --precision bf16 --lr 1e-4
# writes ds.json (stages STAGES, micro batch searched up to GLOBAL_BATCH per GPU with the accumulation that keeps the
# global batch, DeepSpeed's fast mode: micro batch per stage only), runs `deepspeed --autotuning tune` with
# pretrain/cli.py as the script (pretrain takes each experiment's --deepspeed_config: pretrain.cli), and puts the
# log, summary.txt, ds_config_optimal.json and one line per experiment (its metrics.json) into $OUT/ds-autotune.
# MICRO_BATCH_TRIALS (default 3) is its num_tuning_micro_batch_sizes: experiments per stage after the largest fitting.
# It works in .gpu/ds-autotune/MODEL (DS_AUTOTUNE_DIR) with DeepSpeed's `overwrite: false`, and archives it as
# ds-autotune.tar.gz into $OUT/ds-autotune on any exit: a call cut by its time goes on in the next one (unpack the
# archive into that folder here, carry .gpu/ds-autotune, rerun the same command), the autotuner skipping every
# experiment that finished (its model-info run too); the total time is the calls' "autotuner: rc ... after" sum.
# Needs tabulate (in .whl from scripts/gpu_wheels.sh). What it searches and measures: docs/tune.md.
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?model}; DATA=${2:?shard set}; GLOBAL=${3:?global batch}; STAGES=${4:?stages, e.g. 0,2,3}
SECONDS_FOR_TUNE=${5:-540}; shift $(( $# < 5 ? $# : 5 ))
DEST=${OUT:-gpu-out}/ds-autotune; mkdir -p "$DEST"
NAME=gpu_ds_autotune; [ -f scripts/gpu_env.sh ] && source scripts/gpu_env.sh
WORK=${DS_AUTOTUNE_DIR:-.gpu/ds-autotune/$MODEL}; mkdir -p "$WORK"
finish() {
  tar -czf "$DEST/ds-autotune.tar.gz" -C "$WORK" --exclude='checkpoints' . 2>/dev/null
  ls -la "$DEST"
}
trap finish EXIT
python3 - "$WORK/ds.json" "$GLOBAL" "$STAGES" "${MICRO_BATCH_TRIALS:-3}" <<'PY'
import json, sys
path, global_batch, stages = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
trials = int(sys.argv[4])
json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "zero_optimization": {"stage": stages},
           "autotuning": {"enabled": True, "fast": True, "overwrite": False, "start_profile_step": 3,
                          "end_profile_step": 5,
                          "max_train_batch_size": global_batch, "num_tuning_micro_batch_sizes": trials}},
          open(path, "w"), indent=1)
PY
export PATH=/tmp/site/bin:$PATH        # each experiment is a `deepspeed` command found on PATH
LAUNCHER=$(command -v deepspeed)
start=$(date +%s)
(cd "$WORK" && timeout -s INT -k 30 "$SECONDS_FOR_TUNE" python3 "$LAUNCHER" --autotuning tune --num_gpus 1 \
   "$OLDPWD/pretrain/cli.py" --deepspeed --deepspeed_config ds.json --model "$MODEL" --data "$OLDPWD/$DATA" \
   --steps 20 --no-save-final "$@") > "$DEST/at.log" 2>&1
echo "autotuner: rc $? after $(( $(date +%s) - start )) s" | tee -a "$DEST/at.log"
cp "$WORK/ds.json" "$DEST/"; cp "$WORK"/autotuning_results/{summary.txt,ds_config_optimal.json} "$DEST/" 2>/dev/null
for m in "$WORK"/autotuning_results/*/metrics.json; do
  [ -f "$m" ] && echo "$(basename "$(dirname "$m")") $(cat "$m")"
done | tee "$DEST/experiments.txt"
grep -E "optimal|Tuning completed|not runnable" "$DEST/at.log" | tail -5
