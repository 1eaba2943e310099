"""The passes of ZeRO 1-2's optimizer step over one rank's partition, alone on the device: where its time goes.

    python3 scripts/bench_optimizer_gpu.py --model mt5-xl --out OUT

Pure torch (no DeepSpeed, no model forward): the model's parameter shapes (built on the meta device), their bf16
gradients as views of one flat buffer in reverse order (ZeRO 2 copies each gradient into its partition buffer as
the backward produces it, so in about reverse order), and the fp32 master weights, moments and bf16 weights of a
world of one. Each pass is timed with CUDA events, `--repeats` times after one warm-up: median (min-max). Passes:
DeepSpeed's step (`flatten`: concatenate the bf16 gradients; `.to(fp32)`; `unscale_and_clip_grads`: multiply by
the clipping factor; AdamW over fp32, here PyTorch's fused kernel as a stand-in for DeepSpeed's FusedAdam, which
needs DeepSpeed's CUDA build; the copy of the weights back to bf16), the fused step's (pretrain/fused_step.py: the
gradients concatenated straight into fp32, fused AdamW dividing by the factor as it reads), the overflow check and
the gradient norm (`torch._foreach_norm`, as pretrain/trainer.py and pretrain/grad_norm.py) and a plain fp32 copy of the partition as the bandwidth reference.
The table gives each pass's bytes moved and GB/s; the last lines the two steps' sums and what one pass of 28 bytes a
parameter (read fp32 weights, bf16 gradient, two moments; write them and the bf16 weights) would take at the copy's
rate. `--device cpu --model t5-tiny` is a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.model.t5 import T5Model, resolve_config  # noqa: E402

CHUNK = 1 << 30      # the fused step's piece size (pretrain/fused_step.py)


def parameter_shapes(model: str) -> list[torch.Size]:
    with torch.device("meta"):
        return [p.shape for p in T5Model(resolve_config(model)).parameters()]


def reversed_gradients(shapes, device: str, generator: torch.Generator) -> list[torch.Tensor]:
    """Random bf16 gradients of `shapes`, in parameter order, as views of one buffer that holds them in reverse
    order (ZeRO 2 copies each gradient into its buffer as the backward produces it, so about in reverse)."""
    count = sum(s.numel() for s in shapes)
    buffer = torch.empty(count, dtype=torch.bfloat16, device=device).normal_(generator=generator)
    grads, offset = [], count
    for shape in shapes:
        offset -= shape.numel()
        grads.append(buffer[offset:offset + shape.numel()].view(shape))
    return grads


def timed(fn, repeats: int, device: str) -> list[float]:
    """Milliseconds of `fn` per call, each call timed alone (CUDA events on a GPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    return times


def check_agreement(model: str, device: str) -> str:
    """Three AdamW steps of `model`'s partition by the fused step's path (cat to fp32, torch's fused AdamW with
    grad_scale) and by the one-pass kernel from the same state: the largest differences of weights and moments."""
    from pretrain.one_pass_adamw import adamw_one_pass
    shapes = parameter_shapes(model)
    count = sum(s.numel() for s in shapes)
    generator = torch.Generator(device=device).manual_seed(1)
    grads = reversed_gradients(shapes, device, generator)
    start = torch.empty(count, dtype=torch.float32, device=device).normal_(generator=generator)
    states = [[start.clone(), torch.zeros_like(start), torch.zeros_like(start)] for _ in range(2)]
    factor = torch.full((), 2.5, dtype=torch.float32, device=device)
    cache: dict = {}
    for number in range(1, 4):
        step = torch.full((), float(number), dtype=torch.float32, device=device)
        flat = torch.cat([g.reshape(-1) for g in grads]).float()
        p, m, v = states[0]
        torch._fused_adamw_([p], [flat], [m], [v], [], [step], amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, maximize=False, grad_scale=factor, found_inf=None)
        adamw_one_pass(grads, *states[1], step, factor, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                       cache=cache)
    diffs = [float((a - b).abs().max()) for a, b in zip(*states)]
    scale = float(states[0][0].abs().max())
    return (f"agreement ({model}, {count / 1e6:.0f} M parameters, 3 steps, from the same state): max |difference| "
            f"of the one-pass kernel to torch's fused AdamW: weights {diffs[0]:.2e} (of max |weight| {scale:.2f}), "
            f"first moment {diffs[1]:.2e}, second {diffs[2]:.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mt5-xl", help="model preset whose parameter shapes make the partition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-model", default="t5-tiny",
                        help="the preset whose partition checks the one-pass kernel against torch's fused AdamW")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_optimizer_out"))
    args = parser.parse_args()
    device = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    agreement = check_agreement(args.check_model, device)
    print(agreement, flush=True)
    shapes = parameter_shapes(args.model)
    count = sum(s.numel() for s in shapes)
    print(f"{args.model}: {len(shapes)} tensors, {count / 1e9:.3f} B parameters, on {device}", flush=True)
    generator = torch.Generator(device=device).manual_seed(0)
    grads = reversed_gradients(shapes, device, generator)
    torch._foreach_mul_(grads, 1e-3)
    master = torch.empty(count, dtype=torch.float32, device=device).normal_(generator=generator)
    exp_avg = torch.zeros_like(master)
    exp_avg_sq = torch.zeros_like(master)
    weights = torch.empty(count, dtype=torch.bfloat16, device=device)
    grad32 = torch.empty_like(master)
    step = torch.ones((), dtype=torch.float32, device=device)
    factor = torch.full((), 1.7, dtype=torch.float32, device=device)
    flat16 = {}

    def pieces(*tensors):
        return [list(t.split(CHUNK)) for t in tensors]

    def adamw(grad, grad_scale=None):
        p, g, m, v = pieces(master, grad, exp_avg, exp_avg_sq)
        torch._fused_adamw_(p, g, m, v, [], [step] * len(p), amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, maximize=False, grad_scale=grad_scale, found_inf=None)

    def flatten():
        flat16["g"] = torch.cat([g.reshape(-1) for g in grads])

    def to_fp32():
        flat16["g32"] = flat16["g"].to(torch.float32)

    from pretrain.one_pass_adamw import adamw_one_pass
    cache: dict = {}

    def one_pass():
        adamw_one_pass(grads, master, exp_avg, exp_avg_sq, step, factor, lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0.0, cache=cache)

    passes = [
        # name, function, bytes moved per parameter
        ("overflow check (max-abs by torch._foreach_norm, as pretrain.trainer)",
         lambda: torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all(), 2),
        ("norm (torch._foreach_norm of the bf16 gradients)", lambda: torch._foreach_norm(grads, 2, dtype=torch.float32), 2),
        ("DeepSpeed: flatten (cat of the bf16 gradients)", flatten, 4),
        ("DeepSpeed: .to(fp32)", to_fp32, 6),
        ("DeepSpeed: unscale_and_clip_grads (mul_)", lambda: flat16["g32"].mul_(1 / 1.7), 8),
        ("DeepSpeed: AdamW over fp32 (fused, stand-in)", lambda: adamw(flat16["g32"]), 28),
        ("copy of the fp32 weights back to bf16", lambda: weights.copy_(master), 6),
        ("fused step: cat(out=fp32) of the bf16 gradients", lambda: torch.cat([g.reshape(-1) for g in grads], out=grad32), 6),
        ("fused step: fused AdamW with grad_scale", lambda: adamw(grad32, factor), 28),
        ("one pass: AdamW reading the bf16 gradients in place (pretrain/one_pass_adamw.py)", one_pass, 26),
        ("reference: fp32 copy of the partition", lambda: grad32.copy_(master), 8),
    ]
    rows = []
    for name, fn, per_parameter in passes:
        ms = timed(fn, args.repeats, device)
        median = statistics.median(ms)
        rows.append({"pass": name, "ms": median, "ms_min": min(ms), "ms_max": max(ms),
                     "bytes_per_parameter": per_parameter,
                     "gb_per_s": per_parameter * count / (median / 1e3) / 1e9})
        print(json.dumps(rows[-1]), flush=True)

    by = {r["pass"]: r for r in rows}
    deepspeed_ms = sum(r["ms"] for r in rows if r["pass"].startswith("DeepSpeed")) + by["copy of the fp32 weights back to bf16"]["ms"]
    fused_ms = sum(r["ms"] for r in rows if r["pass"].startswith("fused step")) + by["copy of the fp32 weights back to bf16"]["ms"]
    one_pass_step_ms = by[passes[-2][0]]["ms"] + by["copy of the fp32 weights back to bf16"]["ms"]
    rate = by[passes[-1][0]]["gb_per_s"]
    one_pass_ms = 28 * count / (rate * 1e9) * 1e3
    lines = ["| pass | ms median (min-max) | bytes / parameter | GB/s |", "|---|---|---:|---:|"]
    lines += [f"| {r['pass']} | {r['ms']:.2f} ({r['ms_min']:.2f}-{r['ms_max']:.2f}) | {r['bytes_per_parameter']} | "
              f"{r['gb_per_s']:,.0f} |" for r in rows]
    summary = (f"{args.model}, {count / 1e9:.3f} B parameters, {len(shapes)} gradient tensors, "
               f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}; "
               f"{args.repeats} timed calls per pass after one warm-up\n\n" + "\n".join(lines) +
               f"\n\nDeepSpeed's passes (flatten, to fp32, scale, AdamW, copy back): {deepspeed_ms:.1f} ms; the fused "
               f"step's (cat to fp32, AdamW with grad_scale, copy back): {fused_ms:.1f} ms; the one-pass kernel's and the "
               f"copy back: {one_pass_step_ms:.1f} ms; one pass of 28 bytes a parameter (the bf16 weights written "
               f"too) at the copy's {rate:,.0f} GB/s: {one_pass_ms:.1f} ms.\n\n{agreement}")
    (out / "results.json").write_text(json.dumps({"model": args.model, "parameters": count, "rows": rows,
                                                  "deepspeed_ms": deepspeed_ms, "fused_ms": fused_ms,
                                                  "one_pass_step_ms": one_pass_step_ms, "agreement": agreement,
                                                  "one_pass_ms": one_pass_ms}, indent=2))
    (out / "results.md").write_text(summary + "\n")
    print("\n" + summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
