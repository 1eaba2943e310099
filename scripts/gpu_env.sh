# Sourced by the GPU-machine scripts (gpu_study.sh, gpu_ab.sh) from the repository root, with NAME set to the
# caller's name: the environment a lent H200 machine needs, and DeepSpeed + its requirements from the carried .whl/
# (made here by scripts/gpu_wheels.sh) when python3 cannot import deepspeed yet.
# NVLink multicast stays off on shared hosts. The image sets TORCH_CUDA_ARCH_LIST=9.0a, which DeepSpeed 0.19's op
# builder cannot parse (int("0a")): force 9.0, which also keeps the JIT builds (FusedAdam, CPU Adam) short.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
if ! python3 -c 'import deepspeed' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "$NAME: could not install .whl/ (run scripts/gpu_wheels.sh here and carry .whl)" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
