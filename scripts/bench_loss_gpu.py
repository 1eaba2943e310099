"""The LM-head loss chunk alone on a GPU: `cross_entropy_chunk` compiled as the model compiles it, against the form it
replaced (the target's -1 added by a scatter, which makes Inductor write the chunk's fp32 probabilities and read them
back) and against its three matmuls alone (the floor).

    python scripts/bench_loss_gpu.py --model mt5-large --tokens 4096 --out OUT

One chunk of `--tokens` target rows (the model's loss_chunk_tokens: mt5-large at batch 64 has 7,296 target tokens,
two chunks) of the preset's width against its vocabulary, bf16, with gradients. Each variant is timed by
`triton.testing.do_bench` (median of its repeats) three times: median (min-max). Before timing, the loss and both
gradients are compared with the eager function's. results.json and the table go to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.model.t5 import at_least_fp32, cross_entropy_chunk, load_config  # noqa: E402
from bench_attention_gpu import spread, timed, write_table  # noqa: E402  (this script's folder is on sys.path)


def scatter_chunk(h, weight, targets, token_weights, num_valid, with_grads: bool):
    """cross_entropy_chunk as it was before 2026-12-03: the target's -1 by scatter_add_ also when compiled."""
    logits = at_least_fp32(h @ weight.t())
    log_normaliser = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, targets[:, None]).squeeze(1)
    loss_sum = ((log_normaliser - target_logit) * token_weights).sum()
    probs = logits.sub_(log_normaliser[:, None]).exp_()
    probs.scatter_add_(1, targets[:, None], -torch.ones_like(token_weights)[:, None])
    grad_logits = probs.mul_((token_weights / num_valid)[:, None]).to(h.dtype)
    return loss_sum, grad_logits @ weight, grad_logits.t() @ h


def matmuls_only(h, weight, targets, token_weights, num_valid, with_grads: bool):
    """The chunk's three matmuls and nothing else: what the loss costs with free elementwise work."""
    logits = h @ weight.t()
    return logits[0, 0].float(), logits @ weight, logits.t() @ h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mt5-large", help="preset: its d_model and vocabulary")
    parser.add_argument("--tokens", type=int, default=4096, help="target rows in the chunk")
    parser.add_argument("--out", default="bench_loss_out")
    args = parser.parse_args()
    config = load_config(args.model)
    generator = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(args.tokens, config.d_model, device="cuda", dtype=torch.bfloat16, generator=generator)
    weight = torch.randn(config.vocab_size, config.d_model, device="cuda", dtype=torch.bfloat16,
                         generator=generator) * config.d_model ** -0.5
    targets = torch.randint(0, config.vocab_size, (args.tokens,), device="cuda", generator=generator)
    token_weights = (torch.rand(args.tokens, device="cuda", generator=generator) > 0.05).float()
    num_valid = token_weights.sum()
    inputs = (h, weight, targets, token_weights, num_valid, True)
    want = cross_entropy_chunk(*inputs)
    flops = 3 * 2 * args.tokens * config.d_model * config.vocab_size
    rows = []
    for name, fn in (("compare (now)", cross_entropy_chunk), ("scatter (before)", scatter_chunk),
                     ("matmuls only", matmuls_only)):
        compiled = torch.compile(fn, dynamic=False)
        got = compiled(*inputs)
        error = {part: ((a.float() - b.float()).norm() / b.float().norm()).item()
                 for part, a, b in zip(("loss", "dh", "dw"), got, want)} if fn is not matmuls_only else {}
        times = timed(lambda: compiled(*inputs), rep=200)
        rows.append({"variant": name, "ms": times, "tflops": flops / statistics.median(times) / 1e9,
                     "error_vs_eager": error})
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "model": args.model, "tokens": args.tokens, "rows": rows}, indent=2))
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.model} loss chunk: {args.tokens} "
             f"tokens x {config.d_model} x {config.vocab_size:,} vocabulary, bf16, with gradients; ms: median "
             f"(min-max) of 3 do_bench medians", "",
             "| variant | ms | TFLOP/s of its 3 matmuls | relative error vs eager (loss, dh, dw) |",
             "|---|---|---:|---|"]
    lines += [f"| {row['variant']} | {spread(row['ms'])} | {row['tflops']:.0f} | "
              f"{', '.join(f'{v:.1e}' for v in row['error_vs_eager'].values())} |" for row in rows]
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
