"""The LM-head loss on a GPU: one chunk (`cross_entropy_chunk` compiled as the model compiles it, then its two
gradient matmuls), against the form it replaced (the target's -1 added by a scatter, which makes Inductor write the
chunk's fp32 probabilities and read them back) and against its three matmuls alone (the floor); then the whole head
over all target rows (`_chunked_cross_entropy` and the backward's scale-and-cast), against the weight gradient's
earlier accumulation (each chunk's product written in bf16, added into fp32 zeros, cast, then scaled).

    python scripts/bench_loss_gpu.py --model mt5-large --tokens 4096 --head-tokens 7296 --out OUT

One chunk of `--tokens` target rows (the model's loss_chunk_tokens: mt5-large at batch 64 has 7,296 target tokens,
two chunks) of the preset's width against its vocabulary, bf16, with gradients. Each variant is timed by
`triton.testing.do_bench` (median of its repeats) three times: median (min-max). Before timing, the loss and both
gradients are compared with the eager chunk's (the head: with the eager chunk walked the same way, fp32 sums in
both). results.json and the table go to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.model.t5 import (_chunked_cross_entropy, add_weight_grad, at_least_fp32,  # noqa: E402
                               cross_entropy_chunk, load_config)
from bench_attention_gpu import spread, timed, write_table  # noqa: E402  (this script's folder is on sys.path)


def scatter_chunk(h, weight, targets, token_weights, num_valid, with_grads: bool):
    """cross_entropy_chunk as it was before 2026-12-03: the target's -1 by scatter_add_ also when compiled."""
    logits = at_least_fp32(h @ weight.t())
    log_normaliser = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, targets[:, None]).squeeze(1)
    loss_sum = ((log_normaliser - target_logit) * token_weights).sum()
    probs = logits.sub_(log_normaliser[:, None]).exp_()
    probs.scatter_add_(1, targets[:, None], -torch.ones_like(token_weights)[:, None])
    return loss_sum, probs.mul_((token_weights / num_valid)[:, None]).to(h.dtype)


def with_matmuls(chunk_fn):
    """chunk_fn followed by the chunk's two gradient matmuls, as `_chunked_cross_entropy` runs them."""
    def run(h, weight, targets, token_weights, num_valid, with_grads):
        loss, grad_logits = chunk_fn(h, weight, targets, token_weights, num_valid, with_grads)
        return loss, grad_logits @ weight, add_weight_grad(None, grad_logits, h, torch.float32)
    return run


def matmuls_only(h, weight, targets, token_weights, num_valid, with_grads: bool):
    """The chunk's three matmuls and nothing else: what the loss costs with free elementwise work."""
    logits = h @ weight.t()
    return logits[0, 0].float(), logits @ weight, logits.t() @ h


def head_now(hidden, weight, targets, valid, chunk_tokens, chunk_fn):
    """The whole head's loss and gradients as the model computes them (`_LMHeadLoss`, grad_loss 1)."""
    loss, grad_hidden, grad_weight = _chunked_cross_entropy(hidden, weight, targets, valid, chunk_tokens, True,
                                                            chunk_fn)
    scaled = torch.empty(grad_weight.shape, dtype=weight.dtype, device=weight.device)
    torch.mul(grad_weight, loss.new_ones(()), out=scaled)
    return loss, grad_hidden, scaled


def head_before(hidden, weight, targets, valid, chunk_tokens, chunk_fn):
    """The same before 2026-12-04: fp32 zeros, each chunk's bf16 weight product added, cast, then scaled."""
    num_valid = valid.sum().clamp(min=1).float()
    loss_sum = torch.zeros((), device=hidden.device)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, device=weight.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, hidden.shape[0])
        chunk_loss, grad_logits = chunk_fn(hidden[start:stop], weight, targets[start:stop], valid[start:stop].float(),
                                           num_valid, True)
        loss_sum = loss_sum + chunk_loss
        grad_hidden[start:stop] = grad_logits @ weight
        grad_weight += grad_logits.t() @ hidden[start:stop]
    return loss_sum / num_valid, grad_hidden, grad_weight.to(weight.dtype) * loss_sum.new_ones(()).to(weight.dtype)


def relative_errors(got, want) -> dict:
    return {part: ((a.float() - b.float()).norm() / b.float().norm()).item()
            for part, a, b in zip(("loss", "dh", "dw"), got, want)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mt5-large", help="preset: its d_model and vocabulary")
    parser.add_argument("--tokens", type=int, default=4096, help="target rows in the chunk")
    parser.add_argument("--head-tokens", type=int, default=7296,
                        help="target rows of the whole head (batch x target length; mt5-large at 64 x 114: 7,296)")
    parser.add_argument("--out", default="bench_loss_out")
    args = parser.parse_args()
    config = load_config(args.model)
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows_needed = max(args.tokens, args.head_tokens)
    h = torch.randn(rows_needed, config.d_model, device="cuda", dtype=torch.bfloat16, generator=generator)
    weight = torch.randn(config.vocab_size, config.d_model, device="cuda", dtype=torch.bfloat16,
                         generator=generator) * config.d_model ** -0.5
    targets = torch.randint(0, config.vocab_size, (rows_needed,), device="cuda", generator=generator)
    token_weights = (torch.rand(rows_needed, device="cuda", generator=generator) > 0.05).float()
    chunk = (h[:args.tokens], weight, targets[:args.tokens], token_weights[:args.tokens])
    inputs = (*chunk, token_weights[:args.tokens].sum(), True)
    want = with_matmuls(cross_entropy_chunk)(*inputs)
    flops = 3 * 2 * args.tokens * config.d_model * config.vocab_size
    rows = []
    for name, compiled in (   # the chunk compiled, its gradient matmuls after it, as the model runs them
            ("chunk: compare (now)", with_matmuls(torch.compile(cross_entropy_chunk, dynamic=False))),
            ("chunk: scatter (before 2026-12-03)", with_matmuls(torch.compile(scatter_chunk, dynamic=False))),
            ("chunk: matmuls only", torch.compile(matmuls_only, dynamic=False))):
        got = compiled(*inputs)
        error = relative_errors(got, want) if not name.endswith("only") else {}
        times = timed(lambda: compiled(*inputs), rep=200)
        rows.append({"variant": name, "ms": times, "tflops": flops / statistics.median(times) / 1e9,
                     "error_vs_eager": error})
        print(json.dumps(rows[-1]), flush=True)
    head = (h[:args.head_tokens], weight, targets[:args.head_tokens], token_weights[:args.head_tokens] > 0,
            config.loss_chunk_tokens)
    head_flops = 3 * 2 * args.head_tokens * config.d_model * config.vocab_size
    want = head_now(*head, cross_entropy_chunk)
    compiled_chunk = torch.compile(cross_entropy_chunk, dynamic=False)   # as compile_regions compiles it
    for name, fn in (("head: fp32 sums in the GEMM (now)", head_now),
                     ("head: bf16 products added (before 2026-12-04)", head_before)):
        got = fn(*head, compiled_chunk)
        times = timed(lambda: fn(*head, compiled_chunk), rep=200)
        rows.append({"variant": name, "ms": times, "tflops": head_flops / statistics.median(times) / 1e9,
                     "error_vs_eager": relative_errors(got, want)})
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "model": args.model, "tokens": args.tokens,
                                                  "head_tokens": args.head_tokens, "rows": rows}, indent=2))
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.model} loss chunk: {args.tokens} "
             f"tokens (the head: {args.head_tokens}) x {config.d_model} x {config.vocab_size:,} vocabulary, bf16, "
             f"with gradients; ms: median (min-max) of 3 do_bench medians; errors against the eager chunk "
             f"(the head: walked with the eager chunk, fp32 sums in the GEMM)", "",
             "| variant | ms | TFLOP/s of its 3 matmuls | relative error (loss, dh, dw) |",
             "|---|---|---:|---|"]
    lines += [f"| {row['variant']} | {spread(row['ms'])} | {row['tflops']:.0f} | "
              f"{', '.join(f'{v:.1e}' for v in row['error_vs_eager'].values())} |" for row in rows]
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
