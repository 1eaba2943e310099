# fp8_linear against F.linear (bf16), forward + backward, mt5-large's block linears at batch 64; do_bench medians x3.
import statistics, sys, os
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
from triton.testing import do_bench
from pretrain.model.fp8 import fp8_linear
T, t = 64 * 512, 64 * 114
print("| linear | M x N x K | bf16 fwd+bwd ms | fp8 fwd+bwd ms | x | bf16 fwd | fp8 fwd |")
print("|---|---|---|---|---:|---|---|")
for name, M, N, K in (("enc qkv", T, 3072, 1024), ("enc o", T, 1024, 1024), ("enc wi", T, 5632, 1024),
                      ("enc wo", T, 1024, 2816), ("dec kv-cross", T, 2048, 1024), ("dec wi", t, 5632, 1024),
                      ("dec o", t, 1024, 1024)):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    res = {}
    for kind, fn in (("bf16", F.linear), ("fp8", fp8_linear)):
        def fb():
            x.grad = w.grad = None
            fn(x, w).backward(dy)
        def f():
            with torch.no_grad():
                fn(x, w)
        res[kind] = ([do_bench(fb, warmup=10, rep=50) for _ in range(3)], [do_bench(f, warmup=10, rep=50) for _ in range(3)])
    b, e = statistics.median(res["bf16"][0]), statistics.median(res["fp8"][0])
    sp = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
    print(f"| {name} | {M} x {N} x {K} | {sp(res['bf16'][0])} | {sp(res['fp8'][0])} | {b / e:.2f} | {sp(res['bf16'][1])} | {sp(res['fp8'][1])} |", flush=True)
