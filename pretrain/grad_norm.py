"""ZeRO's gradient norm in one multi-tensor kernel: DeepSpeed's ZeRO 1-2 (DeepSpeedZeroOptimizer) and ZeRO 3
(DeepSpeedZeroOptimizer_Stage3) optimizers.

    fuse_grad_norm(optimizer)       # after deepspeed.initialize; config.json["engine"]["grad_norm_fused"]

The same sum of squares taken by another kernel (DeepSpeed's accumulation dtype, another summation order); its
figures on one H200 are in docs/pretrain.md ("ZeRO 1-3: the gradient norm in one kernel").
"""

from __future__ import annotations

import torch


def _sum_of_squares(gradients, device, dtype) -> torch.Tensor:
    """The sum of the squared 2-norms of `gradients` in `dtype`, from one `torch._foreach_norm`. The accumulation
    dtype is DeepSpeed's (`get_norm_dtype()`: fp64 where the device has it), not fp32: on CPU, torch's fp32 norm of
    a 128M-element bf16 gradient (mt5-small's embedding) is 1.3% low."""
    if not gradients:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch._foreach_norm([g.detach() for g in gradients], 2, dtype=dtype)
    return torch.stack(norms).pow(2).sum()


def _finish(total: torch.Tensor, group, device) -> torch.Tensor:
    """DeepSpeed's own ending: the sum over the data-parallel group, the square root, inf and NaN masked to -1."""
    from deepspeed import comm
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    comm.all_reduce(total, op=comm.ReduceOp.SUM, group=group)
    total = total.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=device)
    return total


def _fuse_stage_1_and_2(zero) -> bool:
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if not all(hasattr(zero, name) for name in ("get_grad_norm_direct", "dp_process_group")):
        return False
    params = [p for group in zero.params_in_partition for p in group]
    if any(is_model_parallel_parameter(p) or getattr(p, "ds_pipe_replicated", False) for p in params):
        return False
    if getattr(zero, "mpu", None) is not None:
        return False
    original = zero.get_grad_norm_direct

    def grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return original(gradients, params, norm_type)
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)][:len(params)]
        total = _sum_of_squares(grads, zero.device, get_norm_dtype()).float()    # DeepSpeed's: fp64, summed to fp32
        return _finish(total, zero.dp_process_group, zero.device)

    zero.get_grad_norm_direct = grad_norm_direct
    return True


def _fuse_stage3(zero) -> bool:
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    needed = ("get_grad_norm_direct", "dp_process_group", "_get_param_partition_group",
              "_assert_same_partition_group", "model_parallel_group")
    if not all(hasattr(zero, name) for name in needed) or zero.model_parallel_group is not None:
        return False
    if getattr(zero, "offload_optimizer", False):
        return False        # the offloaded optimizer takes its norm on the host (its own function)
    params = [p for group in getattr(zero, "fp16_groups", []) for p in group]
    if any(is_model_parallel_parameter(p) for p in params):
        return False
    original = zero.get_grad_norm_direct
    expert_group = getattr(zero, "_autoep_expert_parallel_group", lambda params: None)

    def grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or not params or expert_group(params) is not None:
            return original(gradients, params, norm_type)
        if any(g.device != gradients[0].device for g in gradients):
            return original(gradients, params, norm_type)
        zero._assert_same_partition_group(params)
        total = _sum_of_squares(list(gradients), zero.device, get_norm_dtype())   # ZeRO 3's: fp64 where there is
        return _finish(total, zero._get_param_partition_group(params[0]), zero.device)

    zero.get_grad_norm_direct = grad_norm_direct
    return True


def fuse_grad_norm(optimizer) -> bool:
    """The global 2-norm of ZeRO's gradient partition from one `torch._foreach_norm`, accumulated in DeepSpeed's
    dtype (`get_norm_dtype()`: fp64 on CUDA and CPU), instead of DeepSpeed's `get_grad_norm_direct`, which copies
    each bf16 gradient to fp64 and takes its norm alone: ~390 copies and norms per step for mt5-xl, ~18 bytes
    moved per parameter where 2 suffice. The all-reduce over the data-parallel group, the square root and the
    inf/NaN masking are DeepSpeed's own. Returns whether it was installed: kept as DeepSpeed has it (False) with
    model or pipeline parallel parameters, whose norms DeepSpeed counts once per group, with ZeRO 3's optimizer
    offload (the norm is then taken on the host by another function), for expert-parallel groups and for other
    norm types."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return _fuse_stage_1_and_2(optimizer)
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return _fuse_stage3(optimizer)
    return False
