"""T5's self-attention alone, forward + backward, on a GPU: our Triton kernels against FlexAttention (the path they
would replace) and SDPA without a bias (cuDNN / flash: what the same attention costs when there is no trainable
bias; a floor, not an alternative).

    python scripts/bench_attention_gpu.py --models mt5-large:64 mt5-xl:32 --out OUT [--sweep]

Per model (preset:batch) two shapes: the encoder's (512 queries, bidirectional buckets) and the decoder's (114,
causal), the heads and head size of the preset, bf16 inputs laid out as the model's fused q|k|v projection, the
position bias in fp32 with its gradient. Variants: `triton` (pretrain/model/relative_attention.py, as the model calls
it: score tiles whose offsets all lie in T5's last bucket summed whole), `triton-perdiagonal` (every tile summed along
its diagonals, `saturate=0`), `triton-nograd` (the bias without a gradient: what the bias gradient costs), `flex`
(the model's `flex_self_attention` on a `FlexBias`, as `attention: flex` runs it, compiled), `flex-nograd`,
`sdpa-nobias`. Each is timed by
`triton.testing.do_bench` (median of its repeats) three times: median (min-max) of the three. TFLOP/s counts the
matmuls of forward (4 B H L^2 D) and backward (2.5x forward), causal masking not subtracted. Before timing, each
variant's output and gradients are compared with `triton`'s and with the same attention computed in float64 from
the same inputs (relative norm of the difference; the bias gradient as the bucket table gets it, summed per
bucket): the second says which variant rounds more in bf16.

`--sweep` first times our kernels under a few block shapes and launch settings on the first model's encoder shape,
prints each, and keeps the fastest of each kernel for the rest of the run (the defaults in relative_attention.py
are the ones a sweep on one H200 picked); OUT/settings.json holds the settings used, the value of
T5ZERO_ATTENTION_SETTINGS that gives them to `pretrain` and the model benchmark. The table is printed last;
results.json goes to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pretrain.model.relative_attention as kernels  # noqa: E402
from pretrain.model import t5  # noqa: E402

FORWARD_SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
                 for m, n, w, s in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                                    (128, 32, 4, 4), (64, 128, 4, 3), (128, 64, 4, 2)]]
KV_SWEEP = [dict(BLOCK=b, num_warps=w, num_stages=s)
            for b, w, s in [(64, 4, 3), (64, 4, 2), (64, 8, 2), (64, 4, 1), (128, 8, 2), (32, 4, 3)]]
Q_SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
           for m, n, w, s in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2),
                              (128, 128, 8, 2)]]
VARIANTS = ("triton", "triton-perdiagonal", "triton-nograd", "flex", "flex-nograd", "sdpa-nobias")


def make_case(preset: str, batch: int, decoder: bool, seed: int = 0):
    """Inputs of one self-attention of `preset`: qkv [B, L, 3HD] bf16, a stack of the preset's width (one block)
    whose position bias gives both the offset vector and FlexAttention's dense bias, and dout."""
    config = dataclasses.replace(t5.load_config(preset), num_layers=1, num_decoder_layers=1)
    length = 114 if decoder else 512
    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.device("cuda"):
        stack = t5.Stack(config, is_decoder=decoder)
    torch.nn.init.normal_(stack.relative_attention_bias.weight, std=config.d_model ** -0.5, generator=generator)
    qkv = torch.randn(batch, length, 3 * config.inner_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    dout = torch.randn(batch, length, config.inner_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    return config, stack, qkv, dout, length


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, H, L, D] of a fused q|k|v [B, L, 3HD] (views)."""
    batch, length, width = qkv.shape
    return qkv.view(batch, length, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B, L, H*D], the layout the output projection reads."""
    batch, heads, length, d_kv = out.shape
    return out.transpose(1, 2).reshape(batch, length, heads * d_kv)


def runner(variant: str, config, stack, qkv, length: int, decoder: bool):
    """(fn, bias): fn computes the variant's output [B, L, H*D] from qkv; bias is the position-bias tensor it reads
    (made once, as the model makes it once per stack for all its layers; a leaf with a gradient unless -nograd),
    or None."""
    heads = config.num_heads
    grad = not variant.endswith("-nograd")
    if variant.startswith("triton"):
        bias = stack.relative_attention_bias(length, length, by_offset=True).detach().requires_grad_(grad)
        saturate = 0 if variant == "triton-perdiagonal" else stack.relative_attention_bias.saturate
        return lambda: kernels.relative_attention(qkv, bias, heads, decoder, saturate=saturate), bias
    if variant.startswith("flex"):
        flex_bias = stack.flex_self_attention_bias(length, None)
        flex_bias = flex_bias._replace(position=flex_bias.position.detach().requires_grad_(grad))
        return lambda: merge_heads(t5.flex_self_attention(*split_heads(qkv, heads), flex_bias)), flex_bias.position

    def sdpa():
        return merge_heads(F.scaled_dot_product_attention(*split_heads(qkv, heads), is_causal=decoder, scale=1.0))
    return sdpa, None


def exact_outputs(config, stack, qkv, dout, length: int, decoder: bool):
    """(out, d qkv, d bias per offset) of the same attention in float64 from the same bf16 inputs and bias."""
    leaf = qkv.detach().double().requires_grad_()
    bias = stack.relative_attention_bias(length, length)[0].detach().double().requires_grad_()
    q, k, v = split_heads(leaf, config.num_heads)
    scores = q @ k.transpose(-1, -2) + bias
    if decoder:
        future = torch.ones(length, length, dtype=torch.bool, device=qkv.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = merge_heads(scores.softmax(-1) @ v)
    out.backward(dout.double())
    return out.detach(), leaf.grad, per_bucket(per_offset(bias.grad, length), stack, length)


def per_bucket(dbias: torch.Tensor, stack, length: int) -> torch.Tensor:
    """A bias gradient per key - query offset [H, 2L - 1] summed into the buckets it reaches, [H, buckets]: what the
    bucket table gets (with `saturate`, ours is exact as such sums, not per offset)."""
    bias = stack.relative_attention_bias
    offsets = torch.arange(1 - length, length, device=dbias.device)
    buckets = t5.relative_position_bucket(offsets, bias.bidirectional, bias.num_buckets, bias.max_distance)
    return torch.zeros(dbias.shape[0], bias.num_buckets, dtype=dbias.dtype, device=dbias.device).index_add_(
        1, buckets, dbias)


def per_offset(dense: torch.Tensor, length: int) -> torch.Tensor:
    """A dense [H, P, P] bias gradient summed along its diagonals (over the true length): [H, 2L - 1]."""
    i = torch.arange(length, device=dense.device)[:, None]
    j = torch.arange(length, device=dense.device)[None, :]
    index = (j - i + length - 1).expand(length, length).reshape(-1)
    summed = torch.zeros(dense.shape[0], 2 * length - 1, device=dense.device, dtype=dense.dtype)
    return summed.index_add_(1, index, dense[:, :length, :length].reshape(dense.shape[0], -1))


def timed(fn, repeats: int = 3, rep: int = 100) -> list[float]:
    """ms of fn: the median of do_bench's runs (over `rep` ms), `repeats` times."""
    from triton.testing import do_bench
    return [do_bench(fn, warmup=25, rep=rep, return_mode="median") for _ in range(repeats)]


def write_table(out_dir: Path, lines: list[str]) -> None:
    """The markdown table to OUT/results.md, and printed last."""
    table = "\n".join(lines)
    (out_dir / "results.md").write_text(table + "\n")
    print("\n" + table, flush=True)


def spread(values) -> str:
    """Median (min-max) of timed()'s figures, as the tables print them."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def forward_backward(fn, qkv, dout, bias):
    def step():
        qkv.grad = None
        if bias is not None:
            bias.grad = None
        fn().backward(dout)
    return step


def outputs(fn, qkv, dout, bias, stack):
    """(out, d qkv, d bias per bucket [H, buckets]) in float64; d bias None where the bias has no gradient.
    FlexAttention's dense [H, P, P] bias gradient is summed along its diagonals (over the true length) first."""
    forward_backward(fn, qkv, dout, bias)()
    out = fn().detach().double()
    dbias = None
    if bias is not None and bias.grad is not None:
        dbias = bias.grad.double()
        if dbias.dim() == 3:
            dbias = per_offset(dbias, qkv.shape[1])
        dbias = per_bucket(dbias, stack, qkv.shape[1])
    return out, qkv.grad.double(), dbias


def relative(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def sweep(preset: str, batch: int) -> dict:
    """Time our kernels under each setting of FORWARD_SWEEP / KV_SWEEP / Q_SWEEP (one kernel varied at a time, the
    others at their current setting) on the encoder shape; keep the fastest of each."""
    config, stack, qkv, dout, length = make_case(preset, batch, decoder=False)
    qkv.requires_grad_()
    fn, bias = runner("triton", config, stack, qkv, length, False)
    step = forward_backward(fn, qkv, dout, bias)
    chosen = {}
    for name, candidates, measure in (("FORWARD", FORWARD_SWEEP, lambda: timed(lambda: fn(), 1)[0]),
                                      ("BACKWARD_KV", KV_SWEEP, lambda: timed(step, 1)[0]),
                                      ("BACKWARD_Q", Q_SWEEP, lambda: timed(step, 1)[0])):
        results = []
        for candidate in candidates:
            setattr(kernels, name, candidate)
            try:
                ms = measure()
            except Exception as err:     # a setting that does not compile (shared memory, registers)
                print(f"sweep {name} {candidate}: {type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
                continue
            results.append((ms, candidate))
            print(f"sweep {name} {candidate}: {ms:.3f} ms", flush=True)
        best = min(results, key=lambda r: r[0])
        setattr(kernels, name, best[1])
        chosen[name] = {"best": best[1], "ms": best[0], "all": [{"ms": ms, **c} for ms, c in results]}
        print(f"sweep {name}: kept {best[1]} ({best[0]:.3f} ms)", flush=True)
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mt5-large:64", "mt5-xl:32"], help="preset:batch ...")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--sweep", action="store_true", help="sweep our kernels' block shapes first (see above)")
    parser.add_argument("--out", default="bench_attention_out")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64
    cases = [(preset, int(batch)) for preset, batch in (m.split(":") for m in args.models)]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "rows": []}
    if args.sweep:
        result["sweep"] = sweep(*cases[0])
    result["settings"] = {"FORWARD": kernels.FORWARD, "BACKWARD_KV": kernels.BACKWARD_KV,
                          "BACKWARD_Q": kernels.BACKWARD_Q}
    (out_dir / "settings.json").write_text(json.dumps(result["settings"]))
    print(f"kernel settings: {result['settings']} (as {kernels.SETTINGS_VARIABLE}: {out_dir / 'settings.json'})",
          flush=True)
    for preset, batch in cases:
        for decoder in (False, True):
            config, stack, qkv, dout, length = make_case(preset, batch, decoder)
            qkv.requires_grad_()
            flops = 4 * batch * config.num_heads * length * length * config.d_kv
            exact = exact_outputs(config, stack, qkv, dout, length, decoder)
            reference = None
            for variant in args.variants:
                fn, bias = runner(variant, config, stack, qkv, length, decoder)
                row = {"model": preset, "batch": batch, "attention": "decoder" if decoder else "encoder",
                       "length": length, "heads": config.num_heads, "variant": variant}
                try:
                    got = outputs(fn, qkv, dout, bias, stack)
                    if reference is None:
                        reference = got
                    row["error_vs_triton"] = {name: relative(a, b) for name, a, b in
                                              zip(("out", "dqkv", "dbias"), got, reference)
                                              if a is not None and b is not None}
                    row["error_vs_exact"] = {name: relative(a, b) for name, a, b in
                                             zip(("out", "dqkv", "dbias"), got, exact)
                                             if a is not None and b is not None}
                    forward = timed(lambda: fn())
                    both = timed(forward_backward(fn, qkv, dout, bias))
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                    print(json.dumps(row), flush=True)
                    result["rows"].append(row)
                    continue
                row.update(forward_ms=forward, forward_backward_ms=both,
                           forward_tflops=flops / statistics.median(forward) / 1e9,
                           forward_backward_tflops=3.5 * flops / statistics.median(both) / 1e9)
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
            del stack, qkv, dout
            torch.cuda.empty_cache()
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    lines = [f"{result['device']}, torch {result['torch']}, triton {result['triton']}; bf16, bias fp32; ms: median "
             f"(min-max) of 3 do_bench medians; x flex: forward + backward against flex's; errors: relative norm "
             f"of the difference (out, dqkv, dbias)",
             "", "| model | batch | attention | variant | forward ms | TFLOP/s | fwd+bwd ms | TFLOP/s | x flex | "
                 "error vs triton | error vs float64 |", "|---|---:|---|---|---|---:|---|---:|---:|---|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['batch']} | {row['attention']} | {row['variant']} | "
                         f"{row['error']} |||||||")
            continue
        flex = next((r for r in result["rows"] if r["variant"] == "flex" and "error" not in r and
                     (r["model"], r["attention"]) == (row["model"], row["attention"])), None)
        ratio = (statistics.median(flex["forward_backward_ms"]) / statistics.median(row["forward_backward_ms"])
                 if flex else float("nan"))
        errors = ", ".join(f"{v:.1e}" for v in row["error_vs_triton"].values())
        exact = ", ".join(f"{v:.1e}" for v in row["error_vs_exact"].values())
        lines.append(f"| {row['model']} | {row['batch']} | {row['attention']} | {row['variant']} | "
                     f"{spread(row['forward_ms'])} | {row['forward_tflops']:.0f} | "
                     f"{spread(row['forward_backward_ms'])} | {row['forward_backward_tflops']:.0f} | {ratio:.2f} | "
                     f"{errors} | {exact} |")
    write_table(out_dir, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
