#!/usr/bin/env python3
"""ZeRO's gradient norm, DeepSpeed's against pretrain.grad_norm.fuse_grad_norm's, on one model's gradients.

    python3 scripts/bench_grad_norm.py --model mt5-xl --repeats 20      # on a GPU machine (scripts/gpu_env.sh)

Both stages by default: ZeRO 1-2 (fp32 accumulation, one call over the partition) and ZeRO 3 (DeepSpeed's fp64
accumulation, one call per sub group of `--sub-group-size` elements, as its step calls it).
Random bf16 gradients of the model's parameter shapes (no model is built: the shapes come from the meta device)
on a one-rank NCCL group (gloo on CPU); each norm is called as DeepSpeed's step calls it, timed alone between
device synchronisations, `--repeats` times after 3 warm-up calls. Prints min / median / max ms of each, the ratio
of the medians and the relative difference of the two norms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mt5-xl", help="model preset whose parameter shapes to use")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each norm")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the gradients' dtype")
    parser.add_argument("--stage", type=int, nargs="+", default=[2, 3], choices=[2, 3], help="ZeRO stages to time")
    parser.add_argument("--sub-group-size", type=int, default=1_000_000_000,
                        help="ZeRO 3's sub_group_size (DeepSpeed's default): elements per norm call")
    args = parser.parse_args(argv)

    import deepspeed.comm
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pretrain.model.t5 import build
    from pretrain.grad_norm import fuse_grad_norm

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    store = dist.FileStore(tempfile.mktemp(prefix="norm-store-"), 1)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    deepspeed.comm.init_distributed("nccl" if cuda else "gloo", auto_mpi_discovery=False, verbose=False)
    with torch.device("meta"):
        shapes = [p.shape for p in build(args.model).parameters()]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    grads = [torch.randn(shape, device=device, dtype=dtype) * 1e-3 for shape in shapes]
    params = [torch.nn.Parameter(torch.empty(0)) for _ in shapes]

    norms = {}
    if 2 in args.stage:
        zero = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)   # the fields the two norms read
        zero.params_in_partition, zero.dp_process_group, zero.device = [params], dist.group.WORLD, device
        zero.model_parallel_group, zero.model_parallel_rank, zero.mpu = None, 0, None
        norms["ZeRO 1-2, deepspeed"] = lambda: DeepSpeedZeroOptimizer.get_grad_norm_direct(zero, grads, params)
        assert fuse_grad_norm(zero)
        norms["ZeRO 1-2, fused"] = lambda: zero.get_grad_norm_direct(grads, params)
    if 3 in args.stage:
        groups, size = [[]], 0          # DeepSpeed's sub groups: consecutive parameters up to sub_group_size
        for index, grad in enumerate(grads):
            if size and size + grad.numel() > args.sub_group_size:
                groups.append([])
                size = 0
            groups[-1].append(index)
            size += grad.numel()
        zero3 = DeepSpeedZeroOptimizer_Stage3.__new__(DeepSpeedZeroOptimizer_Stage3)
        zero3.fp16_groups = [[params[i] for i in group] for group in groups]
        zero3.dp_process_group, zero3.device, zero3.offload_optimizer = dist.group.WORLD, device, False
        zero3.model_parallel_group, zero3.model_parallel_rank, zero3.mpu = None, 0, None
        grad_groups = [[grads[i] for i in group] for group in groups]

        def stage3(norm):
            return torch.stack([norm(g, p) for g, p in zip(grad_groups, zero3.fp16_groups)]).pow(2).sum().sqrt()

        norms["ZeRO 3, deepspeed"] = lambda: stage3(
            lambda g, p: DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct(zero3, g, p))
        assert fuse_grad_norm(zero3)
        norms["ZeRO 3, fused"] = lambda: stage3(zero3.get_grad_norm_direct)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, values = {}, {}
    for name, norm in norms.items():
        for _ in range(3):
            norm()
        sync()
        times[name] = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            values[name] = float(norm())       # the step reads it too (is_invalid_grad_norm, the clip)
            sync()
            times[name].append((time.perf_counter() - start) * 1000)
    elements = sum(g.numel() for g in grads)
    print(f"{args.model}: {len(grads)} gradients, {elements / 1e9:.2f}e9 {args.dtype} elements on {device} "
          f"({torch.cuda.get_device_name() if cuda else 'CPU'}), torch {torch.__version__}")
    print("| norm | ms min | ms median | ms max | value |")
    print("|---|---:|---:|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {min(ms):.2f} | {statistics.median(ms):.2f} | {max(ms):.2f} | {values[name]:.6f} |")
    for stage in ("ZeRO 1-2", "ZeRO 3"):
        if f"{stage}, fused" in times:
            ours, theirs = f"{stage}, fused", f"{stage}, deepspeed"
            ratio = statistics.median(times[theirs]) / statistics.median(times[ours])
            print(f"{stage}: fused {ratio:.2f}x DeepSpeed's; relative difference of the norms "
                  f"{abs(values[ours] - values[theirs]) / values[theirs]:.2e}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
