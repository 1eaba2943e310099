"""AdamW over a ZeRO partition in one pass that reads the bf16 gradients where ZeRO keeps them (a Triton kernel).

    adamw_one_pass(gradients, param, exp_avg, exp_avg_sq, step, scale, lr=..., betas=..., eps=...,
                   weight_decay=..., cache=cache)

`param`, `exp_avg` and `exp_avg_sq` are the rank's flat fp32 partition and its moments; `gradients` the list of bf16
(or fp32) tensors whose concatenation, in order, is the partition's gradient (ZeRO 1-3's `averaged_gradients`; at ZeRO
2 views of its contiguous gradient buffer, filled in backward order; at ZeRO 3 of its flat gradient-partition buffer,
per sub-group). The kernel reads each gradient in place through a table of (offset in the gradients' storage, offset
in the partition, count) rows, so the concatenation into an fp32 buffer that DeepSpeed's step and `--optimizer-step
fused` make first (6 bytes a parameter, 12.6 ms for mt5-xl on an H200) is not made at all (gradients that are not
views of one storage, ZeRO 1's, are concatenated in their own dtype first), and the gradient is read as bf16 (2 bytes,
not an fp32 copy's 4). Per element: g = grad / scale (the clipping factor), m = b1 m + (1 - b1) g, v = b2 v + (1 - b2)
g^2, p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), t the step count read from the
device: AdamW as torch's, 26 bytes a parameter. Elements of the partition past the gradients (ZeRO's alignment
padding) are left alone: with zero gradients and zero weights there, AdamW leaves them zero too.

Runs on CUDA, and on the CPU only in Triton's interpreter (`TRITON_INTERPRET=1`, the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024          # elements per load
BLOCKS = 16           # loads per table row: a row covers up to BLOCK * BLOCKS elements of one gradient


@triton.jit
def _adamw_kernel(TABLE, GRADS, PARAM, EXP_AVG, EXP_AVG_SQ, STEP, SCALE, lr, beta1, beta2, eps, weight_decay,
                  HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """One table row: up to BLOCK * BLOCKS consecutive elements of one gradient and of the partition."""
    row = tl.program_id(0)
    grad_start = tl.load(TABLE + 3 * row)
    param_start = tl.load(TABLE + 3 * row + 1)
    count = tl.load(TABLE + 3 * row + 2)
    step = tl.load(STEP)
    step_size = lr / (1.0 - tl.exp2(step * tl.log2(beta1)))
    correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    if HAS_SCALE:
        inverse_scale = 1.0 / tl.load(SCALE)
    else:
        inverse_scale = 1.0
    for block in range(BLOCKS):
        index = block * BLOCK + tl.arange(0, BLOCK)
        mask = index < count
        grad = tl.load(GRADS + grad_start + index, mask=mask, other=0.0).to(tl.float32) * inverse_scale
        param = tl.load(PARAM + param_start + index, mask=mask, other=0.0)
        exp_avg = tl.load(EXP_AVG + param_start + index, mask=mask, other=0.0)
        exp_avg_sq = tl.load(EXP_AVG_SQ + param_start + index, mask=mask, other=0.0)
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        param = param * (1.0 - lr * weight_decay)
        param = param - step_size * exp_avg / (tl.sqrt(exp_avg_sq) / correction2_sqrt + eps)
        tl.store(PARAM + param_start + index, param, mask=mask)
        tl.store(EXP_AVG + param_start + index, exp_avg, mask=mask)
        tl.store(EXP_AVG_SQ + param_start + index, exp_avg_sq, mask=mask)


def in_place(gradients: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], tuple]:
    """(base, views, layout key) for the kernel: gradients that are contiguous views of one storage are read where
    they are (base: a tensor from that storage's first element); others are concatenated first, one copy in their
    own dtype (base and the single view: the copy). The key is what the table of rows depends on."""
    first = gradients[0]
    storage = first.untyped_storage()
    if all(g.is_contiguous() and g.untyped_storage().data_ptr() == storage.data_ptr() for g in gradients):
        base = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            storage, 0, (storage.nbytes() // first.element_size(),))
        # the rows depend on where the views lie in their storage, not on where the storage is
        return base, gradients, ("in place", tuple((g.storage_offset(), g.numel()) for g in gradients))
    flat = torch.cat([g.reshape(-1) for g in gradients])
    return flat, [flat], ("concatenated", flat.numel())


def table_rows(views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The kernel's rows for `views`, in order the partition's gradient: int64 [rows, 3] of (offset in their
    storage, offset in the partition, count), each row at most BLOCK * BLOCKS elements of one view."""
    span = BLOCK * BLOCKS
    counts = torch.tensor([v.numel() for v in views], dtype=torch.int64)
    offsets = torch.tensor([v.storage_offset() for v in views], dtype=torch.int64)
    positions = torch.cumsum(counts, 0) - counts                  # where each gradient starts in the partition
    per_view = (counts + span - 1) // span
    view = torch.repeat_interleave(torch.arange(len(views)), per_view)
    start = (torch.arange(int(per_view.sum())) - (torch.cumsum(per_view, 0) - per_view)[view]) * span
    return torch.stack([offsets[view] + start, positions[view] + start,
                        torch.clamp(counts[view] - start, max=span)], dim=1).to(device)


def adamw_one_pass(gradients: list[torch.Tensor], param: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, step: torch.Tensor, scale: torch.Tensor | None, *, lr: float,
                   betas: tuple[float, float], eps: float, weight_decay: float, cache: dict | None = None) -> str:
    """One AdamW update of the flat fp32 `param` and its moments from `gradients` (whose concatenation is the
    partition's gradient), in place; `step` (a float tensor on the device) already counts this step; the gradients
    are divided by `scale` if given. `cache` (a dict the caller keeps per partition) holds the table of rows for the
    last layout, so that it is built again only when the layout changes. Returns how the gradients were read: "in
    place" or "concatenated"."""
    base, views, key = in_place(gradients)
    count = sum(v.numel() for v in views)
    if count > param.numel():
        raise ValueError(f"the gradients hold {count} elements, the partition {param.numel()}")
    cache = {} if cache is None else cache
    if cache.get("key") != key:
        cache.update(key=key, rows=table_rows(views, param.device))
    rows = cache["rows"]
    if rows.shape[0]:
        _adamw_kernel[(rows.shape[0],)](rows, base, param, exp_avg, exp_avg_sq, step,
                                        scale if scale is not None else step, float(lr), float(betas[0]),
                                        float(betas[1]), float(eps), float(weight_decay),
                                        HAS_SCALE=scale is not None, BLOCK=BLOCK, BLOCKS=BLOCKS)
    return key[0]
