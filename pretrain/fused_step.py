"""ZeRO 1-3's optimizer step in fewer passes over the partition (`--optimizer-step auto | triton | fused`).

    fuse_optimizer_step(optimizer, mode)   # after deepspeed.initialize, before the trainer's guard wraps the inner step

DeepSpeed's ZeRO 1-3 step (no offload) walks each rank's partition five times: it concatenates the bf16 gradients
(`flatten`), converts the result to fp32 (`.to`), multiplies it by the clipping factor (`unscale_and_clip_grads`),
runs the inner AdamW over the fp32 weights and moments, and copies the weights back to bf16: about 52 bytes moved
per parameter, 3.74 B parameters for mt5-xl, where the optimizer step of a global batch of 32 was 72 ms of 430 on one
H200 (docs/pretrain.md). Two replacements, both AdamW as the inner optimizer's up to the order of floating-point
operations:

- "fused": the bf16 gradients are concatenated straight into an fp32 buffer (one pass), the clipping factor is
  recorded instead of applied, and the inner step is PyTorch's fused AdamW (`torch._fused_adamw_`), which divides
  the gradient by that factor as it reads it: about 40 bytes per parameter.
- "triton" (what "auto" picks on CUDA; "fused" elsewhere): no fp32 gradient at all; DeepSpeed gets a placeholder
  that holds no memory, and one Triton kernel (pretrain/one_pass_adamw.py) reads the bf16 gradients where ZeRO
  keeps them, divides by the factor and updates weights and moments: 26 bytes per parameter (mt5-xl's ZeRO 2 step
  on an H200: 397.5 against the fused step's 414.5 ms, docs/pretrain.md).

Only DeepSpeed's own methods are replaced, on this optimizer object: `flatten` (and at ZeRO 1-2
`flatten_dense_tensors_aligned`) for the step's own gradient lists only, `unscale_and_clip_grads`, and the inner
optimizer's `step`; the step itself, its overflow check, norm, partition bookkeeping (ZeRO 3's sub-groups), bf16
copy and all-gather stay DeepSpeed's. The moments and step count stay where the inner optimizer (DeepSpeed's
FusedAdam on GPUs, torch's AdamW on the CPU) keeps them, so checkpoints are the same files and any step resumes
another's.
"""

from __future__ import annotations

import os

import torch

from pipeline.common import UserError

CHUNK = 1 << 30           # elements per tensor handed to the fused kernel (mt5-xl's partition is 3.7 B)


def _inner_kind(inner) -> str | None:
    """'fused_adam' (DeepSpeed's FusedAdam in AdamW mode), 'torch_adamw' (torch.optim.AdamW), or None."""
    from deepspeed.ops.adam import FusedAdam

    groups = inner.param_groups
    if isinstance(inner, FusedAdam):
        if inner.adam_w_mode and all(group.get("bias_correction", True) for group in groups):
            return "fused_adam"
        return None
    if type(inner) is torch.optim.AdamW:
        if any(group.get("amsgrad") or group.get("maximize") or group.get("capturable") for group in groups):
            return None
        return "torch_adamw"
    return None


def _stage(zero) -> int | None:
    """2 for DeepSpeed's ZeRO 1-2 optimizer, 3 for ZeRO 3's, None for anything else."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(zero, DeepSpeedZeroOptimizer):
        return 2
    return 3 if isinstance(zero, DeepSpeedZeroOptimizer_Stage3) else None


def _supported(zero, stage: int | None) -> str | None:
    """The inner optimizer's kind where the fused step applies (ZeRO 1-3 without offload, no loss scaling to undo
    dynamically, AdamW), else None; `stage` is `_stage(zero)`."""
    if stage is None or getattr(zero, "zenflow", False):
        return None
    if stage == 2 and zero.cpu_offload:
        return None
    if stage == 3 and (zero.offload_optimizer or zero.offload_param or zero.swap_optimizer):
        return None
    if getattr(zero, "torch_autocast_gradscaler", None) is not None or zero.dtype == torch.float16:
        return None
    groups = len(zero.bit16_groups if stage == 2 else zero.fp16_groups)
    if any(getattr(zero, "_muon_update_lacks_loss_scale", lambda i: False)(i) for i in range(groups)):
        return None
    kind = _inner_kind(zero.optimizer)
    if kind == "torch_adamw" and torch.device(zero.device).type != "cpu":
        return None        # its step counts live on the host, which torch's fused CUDA kernel does not read
    return kind


def _one_pass_runs_here(zero, mode: str) -> bool:
    """The one-pass kernel is Triton's: on CUDA where Triton imports ("triton" asks for it and says so when it
    does not; "auto" then takes the fused step), or on the CPU only in Triton's interpreter (the tests)."""
    if torch.device(zero.device).type != "cuda" and (mode == "auto" or os.environ.get("TRITON_INTERPRET") != "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError as error:
        if mode == "auto":
            return False
        raise UserError(f"--optimizer-step triton needs the triton package (PyTorch's CUDA builds bring it): {error};"
                        f" use --optimizer-step fused")
    return True


def fuse_optimizer_step(zero, mode: str = "auto") -> str:
    """Install the fused step (`mode` "fused"), or the fused step with its AdamW in one pass over the gradients
    where ZeRO keeps them ("triton", pretrain/one_pass_adamw.py; "auto": triton on CUDA, fused elsewhere), on
    DeepSpeed's ZeRO 1-3 optimizer `zero` where it applies; the step that runs: "triton", "fused" (also for "triton"
    on a CPU outside Triton's interpreter) or "deepspeed"."""
    stage = _stage(zero)
    kind = _supported(zero, stage) if mode in ("auto", "fused", "triton") else None
    if kind is None:
        return "deepspeed"
    one_pass = mode in ("auto", "triton") and _one_pass_runs_here(zero, mode)
    if one_pass:
        from pretrain.one_pass_adamw import adamw_one_pass
    inner = zero.optimizer
    original_aligned, original_flatten = getattr(zero, "flatten_dense_tensors_aligned", None), zero.flatten
    scales: dict[int, torch.Tensor | None] = {}        # id(fp32 gradient) -> the factor to divide it by
    device_steps: dict[int, tuple[int, torch.Tensor]] = {}
    captured: dict[int, list[torch.Tensor]] = {}       # one pass: id(placeholder gradient) -> the gradients behind it
    tables: dict[int, dict] = {}                       # one pass: id(fp32 partition) -> its table of rows

    def step_gradients(tensors) -> bool:
        return any(tensors is grads for grads in zero.averaged_gradients.values())

    def sizes(tensors, alignment: int | None) -> tuple[int, int]:
        """The gradients' element count and the partition's: that count padded to a multiple of `alignment`."""
        count = sum(t.numel() for t in tensors)
        return count, (count if not alignment or count % alignment == 0 else count + alignment - count % alignment)

    def to_fp32(tensors, alignment: int | None) -> torch.Tensor:
        """The step's gradient list concatenated into an fp32 tensor (zero padded to `alignment`) in one pass: the
        `.to(fp32)` DeepSpeed's step applies next is then a no-op."""
        count, padded = sizes(tensors, alignment)
        flat = torch.empty(padded, dtype=torch.float32, device=tensors[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:count])
        flat[count:].zero_()
        return flat

    def placeholder(tensors, alignment: int | None) -> torch.Tensor:
        """One pass: an fp32 tensor of the partition's size that holds no memory (one element, expanded), what
        DeepSpeed's step assigns as the fp32 partition's gradient; the kernel reads `tensors` themselves."""
        _, padded = sizes(tensors, alignment)
        stand_in = torch.zeros((), dtype=torch.float32, device=tensors[0].device).expand(padded)
        if tensors is zero.averaged_gradients.get(0):   # a new step: what a skipped one left (the guard's verdict
            captured.clear()                            # skips the inner step) must not hold its gradients on
        captured[id(stand_in)] = list(tensors)
        return stand_in

    gradient_of = placeholder if one_pass else to_fp32

    def flatten_dense_tensors_aligned(tensor_list, alignment, use_cpu_data=False, param_padding=None):
        if use_cpu_data or param_padding is not None or not step_gradients(tensor_list):
            return original_aligned(tensor_list, alignment, use_cpu_data=use_cpu_data, param_padding=param_padding)
        return gradient_of(tensor_list, alignment)

    def flatten(tensors):
        return gradient_of(tensors, None) if step_gradients(tensors) else original_flatten(tensors)

    def factor_for(total_norm) -> torch.Tensor | None:
        """The factor DeepSpeed would divide the gradients by: the loss scale times the clipping ratio."""
        def on_device(value) -> torch.Tensor:   # made there (a fill), not copied from the host: no sync in the step
            if torch.is_tensor(value):
                return value.to(zero.device)
            return torch.full((), float(value), dtype=torch.float32, device=zero.device)

        factor = None
        if zero.clip_grad > 0.0:
            norm = on_device(float("inf") if total_norm is None else total_norm)
            # a non-finite norm (and DeepSpeed's -1 for one) clips by infinity, as DeepSpeed's; here without its
            # host sync
            norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, torch.full_like(norm, float("inf")))
            ratio = torch.clamp(((norm / zero.loss_scale) + 1e-6) / zero.clip_grad, min=1.0)
            factor = (ratio * zero.loss_scale).float()
        elif zero.loss_scale != 1.0:
            factor = on_device(zero.loss_scale)
        return factor

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        """ZeRO 1-2's: record the factor for each group's fp32 gradient; apply nothing."""
        factor = factor_for(total_norm)
        for grad in grad_groups_flat:
            scales[id(grad)] = factor

    def unscale_and_clip_sub_group(sub_group_id, total_norm):
        """ZeRO 3's, called for each sub-group of the partition in turn: record the factor for its fp32 gradient."""
        scales[id(zero.fp32_partitioned_groups_flat[sub_group_id].grad)] = factor_for(total_norm)

    def step_tensor(state: dict, param: torch.Tensor) -> torch.Tensor:
        """The step count as the fused kernel reads it (a float tensor on the parameter's device), incremented as
        the inner optimizer increments its own: torch's AdamW keeps a tensor, FusedAdam an int."""
        if kind == "torch_adamw":
            state["step"] += 1
            return state["step"]
        count = int(state["step"]) + 1
        state["step"] = count
        held = device_steps.get(id(param))
        if held is None or held[0] != count - 1:   # first step, or the state was loaded from a checkpoint
            held = (count, torch.full((), float(count), dtype=torch.float32, device=param.device))
        else:
            held[1].add_(1.0)
            held = (count, held[1])
        device_steps[id(param)] = held
        return held[1]

    def fused_inner_step(closure=None):
        loss = closure() if closure is not None else None
        for group in inner.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = inner.state[param]
                if len(state) == 0:      # as the inner optimizer would make it
                    state["step"] = (torch.zeros((), dtype=torch.float32) if kind == "torch_adamw"
                                     else group.get("step", 0))
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                step = step_tensor(state, param)
                factor = scales.pop(id(param.grad), None)
                gradients = captured.pop(id(param.grad), None)
                if gradients is not None:          # one pass over the gradients where ZeRO keeps them
                    adamw_one_pass(gradients, param.view(-1), state["exp_avg"].view(-1),
                                   state["exp_avg_sq"].view(-1), step, factor, lr=group["lr"], betas=(beta1, beta2),
                                   eps=group["eps"], weight_decay=group["weight_decay"],
                                   cache=tables.setdefault(id(param), {}))
                    continue
                pieces = [t.view(-1).split(CHUNK) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                torch._fused_adamw_(list(pieces[0]), list(pieces[1]), list(pieces[2]), list(pieces[3]), [],
                                    [step] * len(pieces[0]), amsgrad=False, lr=float(group["lr"]), beta1=beta1,
                                    beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                                    maximize=False, grad_scale=factor, found_inf=None)
        scales.clear()
        captured.clear()
        return loss

    if stage == 2:
        zero.flatten_dense_tensors_aligned = flatten_dense_tensors_aligned
        zero.unscale_and_clip_grads = unscale_and_clip_grads
    else:    # ZeRO 3 concatenates each sub-group's gradients with `flatten` (no alignment: they fill its partition)
        zero.unscale_and_clip_grads = unscale_and_clip_sub_group
    zero.flatten = flatten
    inner.step = fused_inner_step
    return "triton" if one_pass else "fused"
