#!/usr/bin/env bash
# Set up ./.venv and run the test suite: real Ray (local clusters), real DeepSpeed (CPU, gloo, 2 ranks),
# real tokenizers and real Arrow files. Extra arguments go to pytest (e.g. `-m slow`, `-k resume`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -m "not slow" -p no:cacheprovider -ra --durations=15 "$@"
