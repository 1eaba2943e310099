"""The benchmarks' variant names, one grammar for scripts/bench_model_gpu.py and scripts/bench_parity.py.

A variant is `hf` or `ours`, then the parts it adds, in this order:
  -compile      torch.compile: HF's whole model, or our regional compilation (`T5Model.compile_regions`)
  -flex|triton  our self-attention's kernel (`T5Config.attention`), else SDPA
  -perdiagonal  the position bias's gradient along every score tile's diagonals (saturate 0)
  -fp8          the blocks' linears as FP8 GEMMs (pretrain/model/fp8.py)
  -torchgate    the gated GELU by torch's ops, not our fused kernel
  -cudagraphs   (with -compile) the blocks compiled with mode="reduce-overhead": Inductor's CUDA graphs per block
  -graphed      (bench_model_gpu only: its step, not the model) the whole step in one CUDA graph
e.g. `ours-compile-triton-fp8`. Which names each script offers is its own `--variants` list.
"""

from __future__ import annotations

import dataclasses

import torch

from pretrain.model.t5 import T5Model


def parts(variant: str) -> list[str]:
    return variant.split("-")


def attention_of(variant: str) -> str:
    """T5Config.attention of one of our variants."""
    return next((kind for kind in ("flex", "triton") if kind in parts(variant)), "sdpa")


def build_variant(variant: str, ours_cpu: T5Model, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `ours_cpu` (its weights; HF's model by `to_hf`) for `variant`, on `device` in `dtype`, in train mode
    and compiled as the variant says."""
    if variant.startswith("hf"):
        from pretrain.model.hf import to_hf
        model = to_hf(ours_cpu)
    else:
        gate = "torch" if "torchgate" in parts(variant) else ours_cpu.config.gated_gelu
        with torch.device(device):
            model = T5Model(dataclasses.replace(ours_cpu.config, attention=attention_of(variant), gated_gelu=gate))
        model.load_state_dict(ours_cpu.state_dict())
        if "perdiagonal" in parts(variant):
            for stack in (model.encoder, model.decoder):
                stack.relative_attention_bias.saturate = 0
        if "fp8" in parts(variant):
            from pretrain.model.fp8 import convert_to_fp8
            convert_to_fp8(model, device)
    model = model.to(device=device, dtype=dtype).train()
    if "compile" in parts(variant):
        if variant.startswith("hf"):
            model = torch.compile(model, dynamic=False)
        else:   # every block shares one compiled graph per stack type, + the loss chunk
            model.compile_regions(mode="reduce-overhead" if "cudagraphs" in parts(variant) else None)
    return model
