"""The feed-forward's gate alone on a GPU: gelu_tanh(gate) * linear on the fused wi_0|wi_1 projection, forward and
backward, by our Triton kernels (pretrain/model/gated_gelu.py, `gated_gelu="triton"`) against the same function
compiled by Inductor (`gated_gelu="torch"` under `compile_regions`, whose backward is one pointwise-cat kernel).

    python scripts/bench_gate_gpu.py --models mt5-large:64 mt5-xl:32 --out OUT

Per model: the encoder's shape (batch x 512 rows of 2 x d_ff) and the decoder's (batch x 114), bf16. Each variant
is timed by `triton.testing.do_bench` (median of its repeats) three times: median (min-max); GB/s counts the bytes
each direction must move (forward: read 2F, write F per row; backward: read 3F, write 2F). Before timing, both
outputs are compared with a float64 reference on the same bf16 values. results.json and the table go to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.model.gated_gelu import gated_gelu  # noqa: E402
from pretrain.model.t5 import load_config  # noqa: E402
from bench_attention_gpu import spread, timed, write_table  # noqa: E402  (this script's folder is on sys.path)


def torch_gate(u):
    gate, linear = u.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * linear


def relative_error(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mt5-large:64"], help="PRESET:BATCH")
    parser.add_argument("--out", default="bench_gate_out")
    args = parser.parse_args()
    rows = []
    for spec in args.models:
        preset, batch = spec.split(":")
        config = load_config(preset)
        for stack, length in (("encoder", 512), ("decoder", 114)):
            generator = torch.Generator(device="cuda").manual_seed(0)
            shape = (int(batch), length, 2 * config.d_ff)
            u = (torch.randn(shape, device="cuda", generator=generator) * 2).to(torch.bfloat16)
            dout = torch.randn(*shape[:-1], config.d_ff, device="cuda", generator=generator).to(torch.bfloat16)
            exact_u = u.double().requires_grad_()
            exact = torch_gate(exact_u)
            exact.backward(dout.double())
            elements = u.numel() // 2
            for name, fn in (("triton (ours)", gated_gelu), ("inductor", torch.compile(torch_gate, dynamic=False))):
                leaf = u.clone().requires_grad_()
                out = fn(leaf)
                out.backward(dout)
                error = {"out": relative_error(out.detach(), exact.detach()), "du": relative_error(leaf.grad, exact_u.grad)}
                forward_ms = timed(lambda: fn(u))
                held = fn(leaf)
                backward_ms = timed(lambda: torch.autograd.grad(held, leaf, dout, retain_graph=True))
                rows.append({"model": preset, "batch": int(batch), "stack": stack, "variant": name,
                             "forward_ms": forward_ms, "backward_ms": backward_ms, "error_vs_float64": error,
                             "forward_gbs": 3 * elements * 2 / statistics.median(forward_ms) / 1e6,
                             "backward_gbs": 5 * elements * 2 / statistics.median(backward_ms) / 1e6})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "rows": rows}, indent=2))
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; the gate of the fused projection, bf16; ms: "
             f"median (min-max) of 3 do_bench medians; errors against float64 on the same values", "",
             "| model, batch | stack | variant | forward ms | GB/s | backward ms | GB/s | relative error (out, du) |",
             "|---|---|---|---|---:|---|---:|---|"]
    lines += [f"| {r['model']}, {r['batch']} | {r['stack']} | {r['variant']} | {spread(r['forward_ms'])} | "
              f"{r['forward_gbs']:.0f} | {spread(r['backward_ms'])} | {r['backward_gbs']:.0f} | "
              f"{r['error_vs_float64']['out']:.1e}, {r['error_vs_float64']['du']:.1e} |" for r in rows]
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
