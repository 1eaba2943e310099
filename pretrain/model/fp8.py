"""FP8 GEMMs for the blocks' linear layers, opt-in: one scale per tensor, applied by our own cast kernel.

    convert_to_fp8(model)                  # before compile_regions() and before the optimizer is made
    y = fp8_linear(x, weight)              # = x @ weight.T, through torch._scaled_mm

Forward: x and the weight in e4m3 (max 448); backward: the output gradient in e5m2 (max 57344, the range gradients
need), both gradient GEMMs in FP8 too (e5m2 x e4m3). Each tensor's scale is FP8_MAX / amax, found in the same step
("dynamic" scaling, torchao's `tensorwise` recipe): the largest |value| is a torch reduction (`amax`), which
Inductor folds into the kernel that makes the tensor where it can; our kernel then scales, saturates and casts, and
writes the FP8 copy both as it is and transposed, since `_scaled_mm` takes its first operand row-major and its
second column-major, and the weight gradient needs the activations and the output gradient the other way round.
The forward keeps x's transposed FP8 copy (1 byte an element) for the weight gradient instead of x itself.
Our gate kernels are custom ops, which Inductor cannot fold a reduction into: `fp8_gated_ffn` runs a whole
feed-forward as one op whose gate kernels hand max |x| of their outputs over to the casts (`Fp8GatedGeluFFN`; 1.09x
the step of mt5-large with separate linears by the median of 5 rounds, every round as fast or faster).

torchao's float8 training did the same casts through Inductor and was slower than bf16 here (0.94x at mt5-large,
docs/model.md "FP8 GEMMs"); the GEMMs alone are 1.6-1.9x faster in FP8 on an H200 (same page). The weights stay
the bf16 parameters that the optimizer updates: same names, same state dict, and `to_hf` sees plain linears.

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before this module is
imported, as the tests do; torch rounds to FP8 there) and `_scaled_mm` on the CPU: slow, for the tests.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from pretrain.model.gated_gelu import launch_backward, launch_forward
from pretrain.model.t5 import FP8_ALIGNMENT, GatedGeluFFN, require_fp8, require_kernel_device

FORWARD_DTYPE, GRAD_DTYPE = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {FORWARD_DTYPE: 448.0, GRAD_DTYPE: 57344.0}
CONVERTED_STACKS = ("encoder.blocks.", "decoder.blocks.")
CAST_ROWS, CAST_COLUMNS = 64, 64


@triton.jit
def _cast_kernel(X, AMAX, OUT, OUT_T, INVERSE, rows, columns, stride_x,
                 FP8_MAX_VALUE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """OUT [rows, columns] = saturate(X * FP8_MAX_VALUE / amax) in OUT's FP8 type, and OUT_T its transpose; amax =
    AMAX[0], max |X|; INVERSE[0] = amax / FP8_MAX_VALUE, the dequantising scale. The transposed tile is loaded
    transposed (a second read of the same tile, from cache) and rounded on its own: from fp32 tiles on an H200,
    transposing in registers (tl.trans, before or after the FP8 conversion) gave wrong values in the copy."""
    amax = tl.load(AMAX)
    scale = FP8_MAX_VALUE / tl.maximum(amax, 1e-12)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    inside = (r[:, None] < rows) & (c[None, :] < columns)
    x = tl.load(X + r[:, None] * stride_x + c[None, :], mask=inside, other=0.0).to(tl.float32)
    v = tl.minimum(tl.maximum(x * scale, -FP8_MAX_VALUE), FP8_MAX_VALUE)
    tl.store(OUT + r[:, None] * columns + c[None, :], v.to(OUT.dtype.element_ty), mask=inside)   # OUT fp32: as is
    inside_t = (c[:, None] < columns) & (r[None, :] < rows)
    xt = tl.load(X + r[None, :] * stride_x + c[:, None], mask=inside_t, other=0.0).to(tl.float32)
    vt = tl.minimum(tl.maximum(xt * scale, -FP8_MAX_VALUE), FP8_MAX_VALUE)
    tl.store(OUT_T + c[:, None] * rows + r[None, :], vt.to(OUT_T.dtype.element_ty), mask=inside_t)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(INVERSE, 1.0 / scale)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"   # as Triton read it when the kernels above were defined


def _launch(kernel):
    """The kernel as the ops call it: wrapped for torch.compile to trace (on a GPU, see _register)."""
    return kernel if INTERPRETED else torch.library.wrap_triton(kernel)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor, by torch: inside a compiled block Inductor folds this reduction into the kernel
    that makes x where it can (the norms before q|k|v and wi, the residual gradients before o and wo), so that most
    casts read their tensor once, not twice; eagerly it is one reduction kernel."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def _cast(x: torch.Tensor, x_amax: torch.Tensor, dtype: torch.dtype):
    """(x8, x8 transposed, the fp32 scale that dequantises them, one element) of a contiguous 2-d x whose max |x| is
    x_amax (0-d fp32).

    The scale is shaped (1,), not 0-d: Inductor lowers an empty tensor to a bare allocation only when its size has
    a dimension (it marks the buffer as zero ranges, which is no kernel); a 0-d empty is one element of "ranges",
    so it became a kernel of its own, `triton_poi_fused_empty`, with the device idle between it and the cast 528
    times an FP8 step of mt5-large (docs/model.md). `_scaled_mm` takes any one-element scale as tensorwise.

    On the CPU (Triton's interpreter, whose FP8 conversion rounds wrongly: 7.77 to 4 in e4m3) the cast kernel writes
    the scaled, saturated values in fp32 and torch rounds them to FP8; on a GPU the kernel rounds (to nearest even,
    as torch does)."""
    rows, columns = x.shape
    stored = torch.float32 if x.device.type == "cpu" else dtype
    out = torch.empty(rows, columns, dtype=stored, device=x.device)
    out_t = torch.empty(columns, rows, dtype=stored, device=x.device)
    inverse = torch.empty(1, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, CAST_ROWS), triton.cdiv(columns, CAST_COLUMNS))
    _launch(_cast_kernel)[grid](x, x_amax, out, out_t, inverse, rows, columns, x.stride(0),
                                FP8_MAX_VALUE=FP8_MAX[dtype], BLOCK_R=CAST_ROWS, BLOCK_C=CAST_COLUMNS)
    if stored != dtype:
        out, out_t = out.to(dtype), out_t.to(dtype)
    return out, out_t, inverse


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.is_contiguous() else x.contiguous()


def _register(name: str, fake):
    """The op `t5zero::name`: on a GPU a `triton_op`, which torch.compile traces into, so that Inductor launches the
    kernels from its compiled code (as custom ops, whose every call goes through Python, the casts' ~1,600 launches
    a step of mt5-large made the step wait on the host: 314 against 237 ms in bf16, docs/model.md); under the
    interpreter a plain custom op (its kernels cannot be traced there), with `fake` for the shapes."""
    def decorate(fn):
        if INTERPRETED:
            op = torch.library.custom_op(f"t5zero::{name}", mutates_args=())(fn)
            op.register_fake(fake)
            return op
        return torch.library.triton_op(f"t5zero::{name}", mutates_args=())(fn)
    return decorate


def _forward_fake(x, weight, x_amax, w_amax):
    rows = x.numel() // x.shape[-1]
    scalar = x.new_empty(1, dtype=torch.float32)     # a scale's shape (_cast)
    return (x.new_empty(*x.shape[:-1], weight.shape[0]), x.new_empty(x.shape[-1], rows, dtype=FORWARD_DTYPE), scalar,
            x.new_empty(weight.shape[1], weight.shape[0], dtype=FORWARD_DTYPE), scalar.clone())


def _linear_forward(x2: torch.Tensor, weight: torch.Tensor, x_amax: torch.Tensor, w_amax: torch.Tensor):
    """(x2 @ weight.T for x2 [rows, in], then for the backward: x2's transposed FP8 copy, its scale, the weight's
    transposed FP8 copy, its scale); x_amax and w_amax: their max |value| (`amax`)."""
    x8, x8_t, x_scale = _cast(x2, x_amax, FORWARD_DTYPE)
    w8, w8_t, w_scale = _cast(weight, w_amax, FORWARD_DTYPE)
    y = torch._scaled_mm(x8, w8.t(), x_scale, w_scale, out_dtype=x2.dtype, use_fast_accum=True)
    return y, x8_t, x_scale, w8_t, w_scale


def _linear_backward(dy2: torch.Tensor, dy_amax: torch.Tensor, x8_t: torch.Tensor, x_scale: torch.Tensor,
                     w8_t: torch.Tensor, w_scale: torch.Tensor, weight_dtype: torch.dtype):
    """(dx, dweight) of a product `_linear_forward` made, dy2 [rows, out] its output's gradient, dy_amax its max
    |value|: dx = dy @ W (dy e5m2 row-major, W column-major), dW = dy.T @ x, both FP8 GEMMs, both with cuBLAS's
    promoted accumulation (partial sums added in fp32 at intervals). The fast one in dx was measured and did not pay
    (docs/model.md); dW sums over every token."""
    dy8, dy8_t, dy_scale = _cast(dy2, dy_amax, GRAD_DTYPE)
    dx = torch._scaled_mm(dy8, w8_t.t(), dy_scale, w_scale, out_dtype=dy2.dtype)
    dw = torch._scaled_mm(dy8_t, x8_t.t(), dy_scale, x_scale, out_dtype=weight_dtype)
    return dx, dw


@_register("fp8_linear", _forward_fake)
def _forward(x: torch.Tensor, weight: torch.Tensor, x_amax: torch.Tensor, w_amax: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x @ weight.T, and for the backward: x's transposed FP8 copy, its scale, the weight's transposed FP8 copy,
    its scale); x_amax and w_amax: their max |value| (`amax`)."""
    y, *saved = _linear_forward(_rows(x), weight, x_amax, w_amax)
    return y.view(*x.shape[:-1], weight.shape[0]), *saved


def _backward_fake(dy, dy_amax, x8_t, x_scale, w8_t, w_scale, weight_dtype):
    return dy.new_empty(*dy.shape[:-1], w8_t.shape[0]), dy.new_empty(w8_t.shape[1], w8_t.shape[0], dtype=weight_dtype)


@_register("fp8_linear_backward", _backward_fake)
def _backward(dy: torch.Tensor, dy_amax: torch.Tensor, x8_t: torch.Tensor, x_scale: torch.Tensor,
              w8_t: torch.Tensor, w_scale: torch.Tensor, weight_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of `_forward`'s product (`_linear_backward`)."""
    dx, dw = _linear_backward(_rows(dy), dy_amax, x8_t, x_scale, w8_t, w_scale, weight_dtype)
    return dx.view(*dy.shape[:-1], w8_t.shape[0]), dw


def _setup_context(ctx, inputs, output):
    _, x8_t, x_scale, w8_t, w_scale = output
    ctx.save_for_backward(x8_t, x_scale, w8_t, w_scale)
    ctx.weight_dtype = inputs[1].dtype


def _autograd_backward(ctx, dy, *unused):
    x8_t, x_scale, w8_t, w_scale = ctx.saved_tensors
    dx, dw = _backward(dy, amax(dy), x8_t, x_scale, w8_t, w_scale, ctx.weight_dtype)   # amax: in the traced backward
    return dx, dw, None, None


torch.library.register_autograd("t5zero::fp8_linear", _autograd_backward, setup_context=_setup_context)


def _ffn_forward_fake(x, wi, wo, x_amax, wi_amax, wo_amax):
    rows, scalar = x.numel() // x.shape[-1], x.new_empty(1, dtype=torch.float32)
    return (x.new_empty(*x.shape[:-1], wo.shape[0]), x.new_empty(rows, wi.shape[0]),
            x.new_empty(x.shape[-1], rows, dtype=FORWARD_DTYPE), scalar,
            x.new_empty(wi.shape[1], wi.shape[0], dtype=FORWARD_DTYPE), scalar.clone(),
            x.new_empty(wo.shape[1], rows, dtype=FORWARD_DTYPE), scalar.clone(),
            x.new_empty(wo.shape[1], wo.shape[0], dtype=FORWARD_DTYPE), scalar.clone())


FFN_OUTPUTS = tuple[(torch.Tensor,) * 10]     # spelt out: torch.library infers the op's schema from the annotation


@_register("fp8_gated_ffn", _ffn_forward_fake)
def _ffn_forward(x: torch.Tensor, wi: torch.Tensor, wo: torch.Tensor, x_amax: torch.Tensor, wi_amax: torch.Tensor,
                 wo_amax: torch.Tensor) -> FFN_OUTPUTS:
    """T5's gated feed-forward, wo(gelu_tanh(wi_0 x) * wi_1 x), as one op: the two linears as `_forward` does them,
    with the gate kernel (pretrain/model/gated_gelu.py) handing over max |hidden| for wo's cast. Returns the output,
    then for the backward: the projection u = x @ wi.T (the gate's input), and the FP8 copies and scales of both
    products (`_linear_forward`)."""
    u, *wi_saved = _linear_forward(_rows(x), wi, x_amax, wi_amax)
    hidden = u.new_empty(u.shape[0], wo.shape[1])
    hidden_amax = torch.zeros(1, dtype=torch.float32, device=u.device)
    launch_forward(u, hidden, hidden_amax, launch=_launch)
    y, *wo_saved = _linear_forward(hidden, wo, hidden_amax, wo_amax)
    return y.view(*x.shape[:-1], wo.shape[0]), u, *wi_saved, *wo_saved


def _ffn_backward_fake(dy, dy_amax, u, x8_t, x_scale, wi8_t, wi_scale, h8_t, h_scale, wo8_t, wo_scale, weight_dtype):
    return (dy.new_empty(*dy.shape[:-1], wi8_t.shape[0]),
            dy.new_empty(wi8_t.shape[1], wi8_t.shape[0], dtype=weight_dtype),
            dy.new_empty(wo8_t.shape[1], wo8_t.shape[0], dtype=weight_dtype))


@_register("fp8_gated_ffn_backward", _ffn_backward_fake)
def _ffn_backward(dy: torch.Tensor, dy_amax: torch.Tensor, u: torch.Tensor, x8_t: torch.Tensor, x_scale: torch.Tensor,
                  wi8_t: torch.Tensor, wi_scale: torch.Tensor, h8_t: torch.Tensor, h_scale: torch.Tensor,
                  wo8_t: torch.Tensor, wo_scale: torch.Tensor, weight_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dwi, dwo) of `_ffn_forward`: wo's gradients, the gate's (its kernel handing over max |du| for the cast),
    then wi's, as `_linear_backward` does them."""
    dhidden, dwo = _linear_backward(_rows(dy), dy_amax, h8_t, h_scale, wo8_t, wo_scale, weight_dtype)
    du = torch.empty_like(u)
    du_amax = torch.zeros(1, dtype=torch.float32, device=u.device)
    launch_backward(u, dhidden, du, du_amax, launch=_launch)
    dx, dwi = _linear_backward(du, du_amax, x8_t, x_scale, wi8_t, wi_scale, weight_dtype)
    return dx.view(*dy.shape[:-1], wi8_t.shape[0]), dwi, dwo


def _ffn_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    ctx.weight_dtype = inputs[1].dtype


def _ffn_autograd_backward(ctx, dy, *unused):
    dx, dwi, dwo = _ffn_backward(dy, amax(dy), *ctx.saved_tensors, ctx.weight_dtype)
    return dx, dwi, dwo, None, None, None


torch.library.register_autograd("t5zero::fp8_gated_ffn", _ffn_autograd_backward, setup_context=_ffn_setup_context)


def fp8_shapes_fit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether _scaled_mm takes this product: both weight dimensions and the token count multiples of 16."""
    rows = x.numel() // x.shape[-1]
    return all(size % FP8_ALIGNMENT == 0 for size in (*weight.shape, rows))   # tokens: dW's inner


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with FP8 GEMMs forward and backward (module docstring); F.linear where a dimension is not a
    multiple of 16 (e.g. a decoder of 114 targets at an odd micro batch)."""
    if not fp8_shapes_fit(x, weight):
        return F.linear(x, weight)
    device = x.device.type
    if torch.is_autocast_enabled(device):     # the op is not autocast's: its output in the dtype autocast would give
        x = x.to(torch.get_autocast_dtype(device))
    return _forward(x, weight, amax(x), amax(weight))[0]


class Fp8Linear(nn.Linear):
    """An `nn.Linear` without bias whose product runs through `fp8_linear`; same parameter, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight)


def fp8_gated_ffn(x: torch.Tensor, wi: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """wo(gelu_tanh(wi_0 x) * wi_1 x) (`GatedGeluFFN` without dropout) in one op, `_ffn_forward`: the same values and
    gradients as fp8_linear, the gate kernel and fp8_linear again, without the two reductions that find max |x| of
    the gate's output and of its gradient. Needs `fp8_shapes_fit` for both weights."""
    device = x.device.type
    if torch.is_autocast_enabled(device):     # as fp8_linear
        x = x.to(torch.get_autocast_dtype(device))
    return _ffn_forward(x, wi, wo, amax(x), amax(wi), amax(wo))[0]


class Fp8GatedGeluFFN(GatedGeluFFN):
    """A `GatedGeluFFN` whose linears are `Fp8Linear`s, run by `fp8_gated_ffn` where it applies (the gate by our
    kernel, no dropout, shapes FP8 takes), else as before; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = (self.config.gated_gelu_kind(x.device.type) == "triton"
                 and (self.config.dropout_rate == 0 or not self.training)
                 and fp8_shapes_fit(x, self.wi.weight) and fp8_shapes_fit(x, self.wo.weight))
        if not fused:
            return super().forward(x)
        require_kernel_device("gated_gelu", x.device.type, instead="torch")
        return fp8_gated_ffn(x, self.wi.weight, self.wo.weight)


def convert_to_fp8(model: nn.Module, device: torch.device | str | None = None) -> list[str]:
    """Make every bias-free `nn.Linear` in the encoder and decoder blocks an `Fp8Linear` in place (the LM head, the
    embedding and attention's own products stay in bf16); returns their names. Call before `compile_regions()`.
    A UserError if `device` (default: where the model's parameters are) has no FP8 tensor cores.
    Each feed-forward whose two linears it converts becomes an `Fp8GatedGeluFFN` (one op, the same values)."""
    device = torch.device(device if device is not None else next(model.parameters()).device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    require_fp8(device.type, capability, str(device))
    names = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.bias is None and name.startswith(CONVERTED_STACKS):
            module.__class__ = Fp8Linear
            names.append(name)
    for name, module in model.named_modules():
        if type(module) is GatedGeluFFN and f"{name}.wi" in names and f"{name}.wo" in names:
            module.__class__ = Fp8GatedGeluFFN
    return names
