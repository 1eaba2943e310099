"""DeepSpeed ZeRO 1-2's per-tensor overflow check against `pretrain.trainer.any_inf_or_nan_fused`, per optimizer step.

    python scripts/bench_overflow_check.py --model mt5-large                 # CPU: host cost, tiny tensors
    python scripts/bench_overflow_check.py --model mt5-large --device cuda   # GPU: the real gradient shapes

One bf16 gradient per parameter tensor of the preset (mt5-large: 390). On CPU each gradient has 1,024 elements, so
what is timed is the host's cost of launching the check (what a GPU waits for at the end of a step), not the
arithmetic; on CUDA they have the parameters' real shapes and the time includes a sync. Prints min / median / max
over --repeats of each and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.model.t5 import T5Model, resolve_config  # noqa: E402
from pretrain.trainer import any_inf_or_nan_fused  # noqa: E402


def serial_check(grads) -> torch.Tensor:
    """DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial's loop over one group."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    count = torch.zeros([1], dtype=torch.float, device=grads[0].device)
    for grad in grads:
        count += DeepSpeedZeroOptimizer._has_inf_or_nan(grad)
    return count.bool()


def timed(check, grads, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        bool(check(grads))                      # the host reads the answer, as DeepSpeed's step does
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mt5-large")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    with torch.device("meta"):
        shapes = [p.shape for p in T5Model(resolve_config(args.model)).parameters()]
    if args.device == "cpu":
        shapes = [(1024,)] * len(shapes)
    grads = [torch.randn(shape, device=args.device, dtype=torch.bfloat16) for shape in shapes]
    for check in (serial_check, any_inf_or_nan_fused):       # warm-up, and both give the same answer
        assert not bool(check(grads))
    grads[len(grads) // 2].view(-1)[0] = float("nan")
    assert bool(serial_check(grads)) and bool(any_inf_or_nan_fused(grads))
    rows = {name: timed(check, grads, args.repeats)
            for name, check in (("DeepSpeed serial", serial_check), ("fused", any_inf_or_nan_fused))}
    print(f"{args.model}: {len(grads)} gradient tensors on {args.device}, {args.repeats} repeats "
          f"(ms, min / median / max)")
    for name, seconds in rows.items():
        print(f"  {name:16s} {1e3 * min(seconds):7.2f} / {1e3 * statistics.median(seconds):7.2f} / "
              f"{1e3 * max(seconds):7.2f}")
    ratio = statistics.median(rows["DeepSpeed serial"]) / statistics.median(rows["fused"])
    print(f"  fused is {ratio:.1f}x faster (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
