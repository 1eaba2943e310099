"""Fingerprints of our attention's outputs and gradients at mt5-large's shapes (batch 64), encoder and decoder, with
and without the bias gradient: sha256 of each tensor's bytes. Run once per version of relative_attention.py; equal
lines mean the same bits."""
import hashlib
import sys

sys.path.insert(0, "scripts")
import torch  # noqa: E402
import bench_attention_gpu as bench  # noqa: E402

for decoder in (False, True):
    for variant in ("triton", "triton-nograd"):
        config, stack, qkv, dout, length = bench.make_case("mt5-large", 64, decoder)
        qkv.requires_grad_()
        fn, bias = bench.runner(variant, config, stack, qkv, length, decoder)
        out = fn()
        out.backward(dout)
        torch.cuda.synchronize()
        tensors = [out, qkv.grad] + ([bias.grad] if bias.grad is not None else [])
        digests = [hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
                   for t in tensors]
        print("bits", "decoder" if decoder else "encoder", variant, *digests, flush=True)
