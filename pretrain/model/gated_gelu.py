"""The gated GELU of T5 v1.1's feed-forward on the fused wi_0|wi_1 projection, in two Triton kernels.

    hidden = gated_gelu(projected)        # projected [..., 2F] (gate | linear) -> gelu_tanh(gate) * linear [..., F]

Inductor fuses this forward well, but not its backward: the gradient of the fused projection is the concatenation
of the gate's and the linear half's gradients, which Inductor lowers on the GPU as a pointwise cat. Every element
of that kernel then evaluates both halves' expressions (two tanh per element pair, each a libdevice call), and
the kernel runs compute-bound at about 1.8 TB/s (mt5-large: 15.4 ms of a 248 ms step, docs/model.md). Here one
program computes both gradients of a tile of element pairs from one tanh and writes each into its half: the
kernel moves the same bytes and is bound by them. The forward is the same elementwise formula in Triton, so that
both directions are `torch.library` custom ops that `torch.compile` keeps whole inside the compiled blocks.

The math is PyTorch's tanh approximation in fp32, rounded once to the output's dtype (as Inductor's fused kernels
do): with y = sqrt(2/pi) (g + 0.044715 g^3) and s = sigmoid(2y) = (1 + tanh y) / 2,
    gelu(g) = g s,    gelu'(g) = s + 2 g s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 g^2)
(1 - tanh^2 y = 4 s (1 - s)); s takes one exp2 and one division. On a machine without a GPU the kernels run in
Triton's interpreter when TRITON_INTERPRET=1 is set before this module is imported (the tests do).

With an AMAX buffer (zeros, fp32) each kernel also folds max |output| into it (`launch_forward`,
`launch_backward`): the FP8 feed-forward (pretrain/model/fp8.py) casts the gate's output and its gradient with
that maximum instead of reading them again in a reduction of their own. The maximum is of the values as stored
(rounded to the output's dtype), so it equals torch's amax of the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_COLUMNS, NUM_WARPS = 16, 256, 8   # 4,096 pairs a program, 16 B per thread and load


@triton.jit
def _gelu_and_slope(gate):
    """gelu_tanh(gate) and its derivative, fp32."""
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    s = 1.0 / (1.0 + tl.exp2(-2.8853900817779268 * inner))        # sigmoid(2 * inner), 2.885... = 2 log2(e)
    slope = s + 2.0 * gate * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * gate * gate)
    return gate * s, slope


@triton.jit
def _tile(rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's rows [BLOCK_R, 1] (int64) and columns [1, BLOCK_C] of the [rows, width] half, and its mask."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    return r, c, (r < rows) & (c < width)


@triton.jit
def _abs_max(stored):
    """max |stored| of a tile, fp32 (masked elements are zeros)."""
    return tl.max(tl.max(tl.abs(stored.to(tl.float32)), axis=1), axis=0)


@triton.jit
def _gated_gelu_fwd_kernel(U, OUT, AMAX, rows, width, stride_u, stride_out,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WITH_AMAX: tl.constexpr):
    r, c, mask = _tile(rows, width, BLOCK_R, BLOCK_C)
    gate = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(tl.float32)
    linear = tl.load(U + r * stride_u + width + c, mask=mask, other=0.0).to(tl.float32)
    gelu, _ = _gelu_and_slope(gate)
    out = (gelu * linear).to(OUT.dtype.element_ty)
    tl.store(OUT + r * stride_out + c, out, mask=mask)
    if WITH_AMAX:
        tl.atomic_max(AMAX, _abs_max(out), sem="relaxed")     # read only after the kernel


@triton.jit
def _gated_gelu_bwd_kernel(U, DOUT, DU, AMAX, rows, width, stride_u, stride_dout, stride_du,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WITH_AMAX: tl.constexpr):
    """dU[:, :F] = dout * linear * gelu'(gate), dU[:, F:] = dout * gelu(gate): one tanh (as a sigmoid) per pair."""
    r, c, mask = _tile(rows, width, BLOCK_R, BLOCK_C)
    gate = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(tl.float32)
    linear = tl.load(U + r * stride_u + width + c, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + r * stride_dout + c, mask=mask, other=0.0).to(tl.float32)
    gelu, slope = _gelu_and_slope(gate)
    dgate = (dout * linear * slope).to(DU.dtype.element_ty)
    dlinear = (dout * gelu).to(DU.dtype.element_ty)
    tl.store(DU + r * stride_du + c, dgate, mask=mask)
    tl.store(DU + r * stride_du + width + c, dlinear, mask=mask)
    if WITH_AMAX:
        tl.atomic_max(AMAX, tl.maximum(_abs_max(dgate), _abs_max(dlinear)), sem="relaxed")


def _rows(u: torch.Tensor) -> torch.Tensor:
    """u as [rows, 2F] with unit stride along the last axis (a copy only if it had none)."""
    u = u.reshape(-1, u.shape[-1])
    return u if u.stride(-1) == 1 else u.contiguous()


def _grid(rows: int, width: int) -> tuple[int, int]:
    return triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(width, BLOCK_COLUMNS)


def _as_is(kernel):
    return kernel


def launch_forward(flat: torch.Tensor, out: torch.Tensor, amax: torch.Tensor | None = None, launch=_as_is) -> None:
    """out [rows, F] = gelu_tanh(gate) * linear of flat [rows, 2F] (`_rows`); with amax (a zeroed fp32 buffer) also
    amax[0] = max |out|. launch: how the caller launches a kernel (fp8.py's ops hand torch.library.wrap_triton)."""
    rows, width = flat.shape[0], flat.shape[1] // 2
    if rows and width:
        launch(_gated_gelu_fwd_kernel)[_grid(rows, width)](
            flat, out, out if amax is None else amax, rows, width, flat.stride(0), out.stride(0),
            BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLUMNS, WITH_AMAX=amax is not None, num_warps=NUM_WARPS)


def launch_backward(flat: torch.Tensor, dflat: torch.Tensor, du: torch.Tensor, amax: torch.Tensor | None = None,
                    launch=_as_is) -> None:
    """du [rows, 2F], the gradient of flat [rows, 2F] given dflat [rows, F], the output's; with amax (a zeroed fp32
    buffer) also amax[0] = max |du|. launch: as in `launch_forward`."""
    rows, width = flat.shape[0], flat.shape[1] // 2
    if rows and width:
        launch(_gated_gelu_bwd_kernel)[_grid(rows, width)](
            flat, dflat, du, du if amax is None else amax, rows, width, flat.stride(0), dflat.stride(0), du.stride(0),
            BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLUMNS, WITH_AMAX=amax is not None, num_warps=NUM_WARPS)


@torch.library.custom_op("t5zero::gated_gelu", mutates_args=())
def _forward(u: torch.Tensor) -> torch.Tensor:
    flat = _rows(u)
    out = flat.new_empty(flat.shape[0], flat.shape[1] // 2)
    launch_forward(flat, out)
    return out.view(*u.shape[:-1], out.shape[1])


@_forward.register_fake
def _(u):
    return u.new_empty(*u.shape[:-1], u.shape[-1] // 2)


@torch.library.custom_op("t5zero::gated_gelu_backward", mutates_args=())
def _backward(dout: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    flat, dflat = _rows(u), _rows(dout)
    du = flat.new_empty(flat.shape)
    launch_backward(flat, dflat, du)
    return du.view(u.shape)


@_backward.register_fake
def _(dout, u):
    return torch.empty_like(u, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _autograd_backward(ctx, dout):
    (u,) = ctx.saved_tensors
    return _backward(dout, u)


torch.library.register_autograd("t5zero::gated_gelu", _autograd_backward, setup_context=_setup_context)


def gated_gelu(u: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * linear for u = gate | linear along its last axis ([..., 2F] -> [..., F], u's dtype)."""
    return _forward(u)
