#!/usr/bin/env bash
# Build the wheels a GPU machine without registry access needs to run `pretrain`/`study` (it already has
# torch, numpy, pyarrow, tokenizers, transformers, matplotlib, tensorboard, psutil, ninja, msgpack, einops,
# py-cpuinfo, pyyaml, tqdm): a pure-python DeepSpeed (ops JIT-built there on first use), the cp312 wheels
# of DeepSpeed's remaining requirements and tabulate (deepspeed --autotuning). Output: ./.whl (git-ignored), well
# under the 64 MiB carry limit.
#
#   ./scripts/gpu_wheels.sh            # then, on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')}
rm -rf .whl && mkdir -p .whl
echo "[gpu-wheels] deepspeed==$DEEPSPEED_VERSION, pure python (DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$DEEPSPEED_VERSION"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for req in hjson pydantic pydantic_core annotated-types typing-inspection typing-extensions tabulate; do
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$req'))")
  .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$req==$version"
done
ls -la .whl && du -sh .whl
