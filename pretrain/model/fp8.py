"""FP8 GEMMs for training (`pretrain --precision fp8`): the blocks' linear layers through torchao's float8 training.

    names = convert_to_fp8(model, torch.device("cuda", 0), token_counts=(micro * 512, micro * 114))

What is converted: every `nn.Linear` inside the encoder and decoder blocks (self-attention q|k|v and o,
cross-attention q, k|v and o, the gated FFN's wi_0|wi_1 and wo), by `torchao.float8.convert_to_float8_training`
with a module filter, into torchao's `Float8Linear`: dynamic tensorwise scaling, inputs and weights cast to e4m3,
output gradients to e5m2, the three GEMMs of each layer (output, grad input, grad weight) in FP8 with fp32
accumulation; the weights stay the bf16 parameters the optimizer updates (same names, same state dict, so
checkpoints and `export_hf` are unchanged). Everything else keeps its dtype (bf16 under DeepSpeed bf16):
- the embedding (a lookup, no GEMM);
- the LM head: its output is the logits the loss is taken on and its gradient is the loss's own, the place where
  gradient precision matters most (torchtitan's float8 recipe leaves its `output` layer out for the same reason).
  It is also no `nn.Linear` here but the chunked loss (`t5._LMHeadLoss`), which torchao cannot swap. The price:
  the head is 24% of mt5-base's step FLOPs, 11% of mt5-large's, and runs at bf16 speed;
- any linear whose in or out features are not multiples of 16 (what `torch._scaled_mm` requires);
- the attention's own matmuls (QK^T, AV inside SDPA) and norms: no FP8 there.

Where: on a CUDA device of compute capability >= 8.9 (Ada, Hopper and later) the real FP8 GEMM (`torch._scaled_mm`)
runs; on CPU, which has no FP8 GEMM, torchao's emulation (`Float8LinearConfig(emulate=True)`: the same casts to
e4m3/e5m2 and back, the matmul in fp32), so CPU tests check the numerics, not the speed. `torch._scaled_mm` also
needs the inner dimension of every GEMM to be a multiple of 16, and the grad-weight GEMM's inner dimension is the
token count of a micro-batch (micro batch x 114 targets is one only when the micro batch is a multiple of 8): when a
`token_counts` entry is not, torchao pads that dimension (`pad_inner_dim`, a copy per GEMM). A GPU without FP8 or a
missing torchao is a `UserError`.

Measured: on CPU only (torch 2.13, torchao 0.18.0 emulated, t5-tiny with bf16 parameters, one batch memorised over
6 AdamW steps, 10 seeds): the per-step loss is within 0.03-0.12 of bf16's (bf16 vs fp32: 0.011-0.016), and the
blocks' step-0 gradients are 0.16-0.17 from fp32's in relative norm (bf16: 0.013-0.015); the figures asserted are in
tests/pretrain/test_fp8.py. On GPUs nothing is measured yet: neither throughput nor loss parity (docs/model.md,
"FP8 GEMMs", has the command to measure both on an H200).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pipeline.common import UserError

FP8_MIN_CAPABILITY = (8, 9)          # CUDA compute capability with FP8 tensor cores (Ada, Hopper, Blackwell)
FP8_ALIGNMENT = 16                   # torch._scaled_mm: both dimensions of a weight, and every inner dimension
CONVERTED_STACKS = ("encoder.blocks.", "decoder.blocks.")
INSTALL_HINT = "pip install torchao (or pip install -e '.[fp8]')"
# loggers that warn while torchao is imported: its CUDA-only kernels that a CPU build cannot load, and torch on an
# enum torchao registers with pytree; neither matters to float8 training
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def fp8_emulated(device: torch.device | str) -> bool:
    """Whether FP8 GEMMs on `device` are emulated (CPU) or real (a CUDA device with FP8); a UserError when neither
    (a CUDA device below compute capability 8.9, or another device type)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        raise UserError(f"--precision fp8 runs on CUDA GPUs (or emulated on CPU), not on {device.type}; "
                        f"use --precision bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise UserError(f"--precision fp8 needs a GPU with FP8 tensor cores (compute capability >= 8.9: L4/L40, "
                        f"H100/H200, B200); {torch.cuda.get_device_name(device)} has "
                        f"{capability[0]}.{capability[1]}; use --precision bf16")
    return False


def require_fp8(device: torch.device | str) -> bool:
    """Check, before any model is built, that FP8 training can run on `device`: torchao's float8 training imports
    and the device has FP8 GEMMs (or is the CPU, where they are emulated). Returns whether they are emulated."""
    quiet = [logging.getLogger(name) for name in IMPORT_NOISE]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise UserError(f"--precision fp8 needs torchao's float8 training ({err}); {INSTALL_HINT}") from None
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return fp8_emulated(device)


def is_fp8_linear(module: nn.Module, fqn: str) -> bool:
    """The module filter: an `nn.Linear` inside an encoder or decoder block whose dimensions FP8 GEMMs take."""
    return (isinstance(module, nn.Linear) and fqn.startswith(CONVERTED_STACKS)
            and module.in_features % FP8_ALIGNMENT == 0 and module.out_features % FP8_ALIGNMENT == 0)


def convert_to_fp8(model: nn.Module, device: torch.device | str, token_counts: tuple[int, ...] = ()) -> list[str]:
    """Swap the block linears of a built `T5Model` for torchao `Float8Linear`s in place (see the module docstring);
    returns the converted modules' names. Call it before `compile_regions()` and before the optimizer (DeepSpeed)
    is made: the parameters stay the same objects, but the compiled graphs must see the new modules.

    `device`: where the model will train (CPU: emulated GEMMs). `token_counts`: the row counts of the GEMMs' inputs
    (micro batch x input length, micro batch x target length); any that is not a multiple of 16 turns on torchao's
    inner-dimension padding, which the grad-weight GEMM of the real `torch._scaled_mm` needs then."""
    emulate = require_fp8(device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    pad_inner_dim = any(count % FP8_ALIGNMENT for count in token_counts)
    config = Float8LinearConfig(emulate=emulate, pad_inner_dim=pad_inner_dim)
    names = [name for name, module in model.named_modules() if is_fp8_linear(module, name)]
    convert_to_float8_training(model, module_filter_fn=is_fp8_linear, config=config)
    return names
