"""FP8 GEMMs for the blocks' linear layers through torchao's float8 training: a measurement, not a `pretrain` choice.

    names = convert_to_fp8(model, "cuda", recipe="rowwise_with_gw_hp", layers="all")

Issue 19 asks for opt-in FP8 GEMMs at >= 1.5x HF compiled. Their first cut (`--precision fp8`, tensorwise scales,
every block linear; history: ac70fef) was slower than bf16 on one H200 (mt5-base 0.87x, mt5-large 0.97x) and was
left out. This module lets `scripts/bench_model_gpu.py` measure the recipes that cut its costs before `pretrain`
offers any of them again (docs/model.md, "FP8 GEMMs"):
- `recipe`: torchao's `Float8LinearRecipeName`: `tensorwise` (one scale per tensor: an amax pass over each input,
  weight and gradient before its cast; cuBLAS's FP8 GEMM), `rowwise` (a scale per row, e4m3 throughout, found in
  the same pass that casts; CUTLASS's rowwise GEMM), `rowwise_with_gw_hp` (rowwise for the output and input-gradient
  GEMMs, the weight gradient in bf16: no transposed FP8 copies of the activations and output gradients).
- `layers`: `all` (every `nn.Linear` in the encoder and decoder blocks: q|k|v, o, cross-attention q, k|v, o, the
  FFN's wi_0|wi_1 and wo) or `ffn` (wi and wo only: the widest GEMMs, whose FP8 speed is likeliest to cover the
  casts).

The weights stay the bf16 parameters the optimizer updates (same names, same state dict). The LM head (the chunked
loss), the embedding and attention's own matmuls stay bf16. On CPU the GEMMs are emulated (`emulate=True`), so a CPU
run checks only that the conversion trains.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from pipeline.common import UserError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
LAYERS = {"all": (".self_attn.", ".cross_attn.", ".ffn."), "ffn": (".ffn.",)}
FP8_MIN_CAPABILITY = (8, 9)          # CUDA compute capability with FP8 tensor cores (Ada, Hopper, Blackwell)
FP8_ALIGNMENT = 16                   # torch._scaled_mm: both dimensions of a weight, and every inner dimension
CONVERTED_STACKS = ("encoder.blocks.", "decoder.blocks.")
# loggers that warn while torchao is imported: its CUDA-only kernels that a CPU build cannot load, and torch on an
# enum torchao registers with pytree; neither matters to float8 training
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def fp8_emulated(device: torch.device | str) -> bool:
    """Whether FP8 GEMMs on `device` are emulated (CPU) or real (a CUDA device of compute capability >= 8.9); a
    UserError for any other device."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        raise UserError(f"FP8 GEMMs need a GPU of compute capability >= 8.9 (L4/L40, H100/H200, B200) or the CPU "
                        f"(emulated); {device} has none")
    return False


def import_torchao_float8():
    """torchao's float8 training module, imported with its import-time warnings silenced; a UserError if missing."""
    quiet = [logging.getLogger(name) for name in IMPORT_NOISE]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise UserError(f"FP8 GEMMs need torchao's float8 training ({err}): pip install torchao") from None
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return float8


def layer_filter(layers: str):
    """The module filter of `convert_to_float8_training`: an `nn.Linear` in a block, of the chosen kind, whose
    dimensions FP8 GEMMs take."""
    if layers not in LAYERS:
        raise UserError(f"FP8 layers must be one of {', '.join(LAYERS)}; got {layers!r}")
    kinds = LAYERS[layers]

    def wanted(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn.startswith(CONVERTED_STACKS)
                and any(kind in f".{fqn}." for kind in kinds)
                and module.in_features % FP8_ALIGNMENT == 0 and module.out_features % FP8_ALIGNMENT == 0)
    return wanted


def convert_to_fp8(model: nn.Module, device: torch.device | str, *, recipe: str = "tensorwise",
                   layers: str = "all", token_counts: tuple[int, ...] = ()) -> list[str]:
    """Swap the chosen block linears of a built `T5Model` for torchao `Float8Linear`s in place; returns their names.
    Call it before `compile_regions()` and before the optimizer is made. `token_counts`: the GEMMs' row counts
    (micro batch x input length, x target length); one that is not a multiple of 16 turns on torchao's padding of
    the grad-weight GEMM's inner dimension, which `torch._scaled_mm` needs then."""
    if recipe not in RECIPES:
        raise UserError(f"FP8 recipe must be one of {', '.join(RECIPES)}; got {recipe!r}")
    emulate = fp8_emulated(device)
    float8 = import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    pad_inner_dim = any(count % FP8_ALIGNMENT for count in token_counts)
    config = dataclasses.replace(config, emulate=emulate, pad_inner_dim=pad_inner_dim)
    wanted = layer_filter(layers)
    names = [name for name, module in model.named_modules() if wanted(module, name)]
    float8.convert_to_float8_training(model, module_filter_fn=wanted, config=config)
    return names
