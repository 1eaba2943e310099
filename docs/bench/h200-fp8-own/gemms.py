# The GEMMs of one mt5-large training step (batch 64, 512/114), each shape in the layout autograd gives it, timed in
# bf16 (torch.mm) and in FP8 (torch._scaled_mm, e4m3, rowwise and tensorwise scales, bf16 out): what FP8 could save
# at most, before any cast. do_bench medians, 3 repeats each (min-max).
import statistics, sys, json, os
import torch
from triton.testing import do_bench

T, t, d, ff, inner, V = 64 * 512, 64 * 114, 1024, 2816, 1024, 250112
LINEARS = [  # (name, tokens M, out N, in K, count per step)
    ("enc qkv", T, 3 * inner, d, 24), ("enc o", T, d, inner, 24), ("enc wi", T, 2 * ff, d, 24), ("enc wo", T, d, ff, 24),
    ("dec qkv", t, 3 * inner, d, 24), ("dec o", t, d, inner, 24), ("dec q-cross", t, inner, d, 24),
    ("dec kv-cross", T, 2 * inner, d, 24), ("dec o-cross", t, d, inner, 24), ("dec wi", t, 2 * ff, d, 24),
    ("dec wo", t, d, ff, 24), ("head 4096", 4096, V, d, 1), ("head 3200", 3200, V, d, 1),
]
F8 = torch.float8_e4m3fn


def bench(fn):
    return [do_bench(fn, warmup=10, rep=40, return_mode="median") for _ in range(3)]


def bf16(m, n, k, kind):
    """m x k @ k x n in the layout of `kind`: fwd X @ W^T, dgrad dY @ W, wgrad dY^T @ X."""
    if kind == "fwd":
        a, b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    elif kind == "dgrad":
        a, b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    else:
        a, b = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t(), torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(a, b)


def fp8(m, n, k, rowwise):
    a = torch.randn(m, k, device="cuda").to(F8)
    b = torch.randn(n, k, device="cuda").to(F8).t()              # column-major, as _scaled_mm needs
    if rowwise:
        sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    else:
        sa, sb = torch.ones((), device="cuda"), torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)


rows, totals = [], {"bf16": 0.0, "fp8 rowwise": 0.0, "fp8 tensorwise": 0.0}
by_linear = {}
for n8 in (8192,):
    mm_bf16 = statistics.median(bench(bf16(n8, n8, n8, "fwd")))
    mm_fp8 = statistics.median(bench(fp8(n8, n8, n8, True)))
    print(f"8192^3: bf16 {2 * n8**3 / mm_bf16 / 1e9:.0f} TFLOP/s, fp8 rowwise {2 * n8**3 / mm_fp8 / 1e9:.0f} TFLOP/s", flush=True)
for name, M, N, K, count in LINEARS:
    for kind, (m, n, k) in (("fwd", (M, N, K)), ("dgrad", (M, K, N)), ("wgrad", (N, K, M))):
        flop = 2 * m * n * k
        times = {"bf16": bench(bf16(m, n, k, kind)), "fp8 rowwise": bench(fp8(m, n, k, True)),
                 "fp8 tensorwise": bench(fp8(m, n, k, False))}
        med = {key: statistics.median(v) for key, v in times.items()}
        for key in totals:
            totals[key] += count * med[key]
        by_linear.setdefault(name, {key: 0.0 for key in totals})
        for key in totals:
            by_linear[name][key] += count * med[key]
        rows.append((name, kind, m, n, k, count, med, times, flop))
        print(f"{name:13s} {kind:5s} {m:6d}x{n:6d}x{k:6d} x{count}: bf16 {med['bf16']*1e3:7.1f} us "
              f"({flop / med['bf16'] / 1e9:4.0f} TFLOP/s)  fp8 row {med['fp8 rowwise']*1e3:7.1f} us "
              f"({flop / med['fp8 rowwise'] / 1e9:4.0f})  fp8 tensor {med['fp8 tensorwise']*1e3:7.1f} us", flush=True)

print("\n| GEMM (mt5-large, batch 64) | count a step | bf16 ms a step | fp8 rowwise | fp8 tensorwise | bf16 TFLOP/s |")
print("|---|---:|---:|---:|---:|---:|")
for name, M, N, K, count in LINEARS:
    flop = 6 * M * N * K * count
    v = by_linear[name]
    print(f"| {name} (all three) | {count} | {v['bf16']:.2f} | {v['fp8 rowwise']:.2f} | {v['fp8 tensorwise']:.2f} | {flop / v['bf16'] / 1e9:.0f} |")
print(f"| **all** | | **{totals['bf16']:.1f}** | **{totals['fp8 rowwise']:.1f}** | **{totals['fp8 tensorwise']:.1f}** | |")
wg = sum(count * r[6]["bf16"] for r in rows for count in [r[5]] if r[1] == "wgrad")
wg8 = sum(r[5] * r[6]["fp8 rowwise"] for r in rows if r[1] == "wgrad")
print(f"fp8 rowwise for fwd + dgrad only, wgrad in bf16 (torchao's gwhp): {totals['fp8 rowwise'] - wg8 + wg:.1f} ms")
json.dump({"rows": [(r[0], r[1], r[2], r[3], r[4], r[5], r[7]) for r in rows], "totals": totals},
          open(os.path.join(os.environ.get("OUT", "."), "gemms.json"), "w"))
