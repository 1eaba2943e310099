#!/usr/bin/env bash
# Create (or reuse) ./.venv and install the project with its test extras.
# torch is installed first at the pinned CPU build so that no range ever pulls a multi-GB CUDA wheel;
# on a GPU machine torch is already present and the project's range (torch>=2.4) admits it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU build)"
  .venv/bin/pip install -q torch==2.13.0
fi
echo "[setup] installing t5zero and its test extras"
.venv/bin/pip install -q -e '.[test]' 2>&1 | grep -v 'is ignored: it is neither a file nor a directory' || true
.venv/bin/python -c 'import torch, deepspeed, ray, tokenizers, pyarrow, datasets' >/dev/null 2>&1 \
  || { echo "[setup] the environment is incomplete: rerun scripts/setup_env.sh" >&2; exit 1; }
# Every DeepSpeed rank on the CPU loads DeepSpeed's shared-memory collective op, JIT-compiled on first use (~1 min,
# silent): build it here once, so that the first run or test does not stall on it.
# (DeepSpeed's own build_shm_op, what its ranks call: the same checks, the same cache)
echo "[setup] DeepSpeed's CPU shared-memory op (built once, ~1 min the first time)"
.venv/bin/python -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()' 2>&1 \
  | grep -v 'real_accelerator.py' || true
