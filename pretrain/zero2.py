"""ZeRO 1 and 2 (DeepSpeed's DeepSpeedZeroOptimizer): the work its step does that has nothing to do, left out.

    fuse_grad_norm(optimizer)            # every world size: one multi-tensor norm instead of one per gradient
    skip_one_rank_reduction(optimizer)   # one rank: the gradient "average" over a world of one is not run

Both keep DeepSpeed's numbers: the gradient norm is the same sum of squares taken by another kernel (fp32
accumulation either way, another summation order), and on one rank the reduction is an identity (a division by 1,
a one-rank NCCL reduce, copies there and back). The trainer calls them after `deepspeed.initialize` and records
what they did in config.json["engine"]; docs/pretrain.md ("ZeRO 1 and 2 on one rank") has the measurements.
"""

from __future__ import annotations

import torch


def _zero_optimizer(optimizer):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return optimizer if isinstance(optimizer, DeepSpeedZeroOptimizer) else None


def fuse_grad_norm(optimizer) -> bool:
    """The global 2-norm of ZeRO 1-2's gradient partition from one `torch._foreach_norm` (fp32 accumulation, fp32
    results) instead of DeepSpeed's `get_grad_norm_direct`, which copies each bf16 gradient to fp32 and takes its
    norm alone: ~390 copies and norms per step for mt5-xl, ~10 bytes moved per parameter where 2 suffice. The
    all-reduce over the data-parallel group, the square root and the inf/NaN masking are DeepSpeed's own. Kept as
    it is (returns False) with model or pipeline parallel parameters, whose norms DeepSpeed counts once per group,
    and for other norm types."""
    from deepspeed import comm
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace

    zero = _zero_optimizer(optimizer)
    if zero is None or not all(hasattr(zero, name) for name in ("get_grad_norm_direct", "dp_process_group")):
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
        if grads:
            norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)
            total = torch.stack(norms).pow(2).sum()
        else:
            total = torch.zeros((), dtype=torch.float32, device=zero.device)
        comm.all_reduce(total, op=comm.ReduceOp.SUM, group=zero.dp_process_group)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=zero.device)
        return total

    zero.get_grad_norm_direct = grad_norm_direct
    return True


def skip_one_rank_reduction(optimizer) -> bool:
    """On one rank, leave out ZeRO 1-2's reduction of each gradient bucket: an average over a world of one, which
    DeepSpeed still runs as a division by 1, a flattening copy, a one-rank NCCL reduce and a copy back, per bucket of
    `reduce_bucket_size` elements (mt5-xl: ~8 per micro step, each with a device synchronisation when
    `overlap_comm` is on). The bucket already holds the gradients; DeepSpeed then copies them into the partition as
    after any reduction. Only where that is all the reduction does: one rank, gradients kept contiguous, no
    overlap stream (`build_ds_config` turns `overlap_comm` off on one rank: there is nothing to overlap, and
    the copy into the partition must then follow the bucket's on one stream), no offload, and no fp32 gradient
    accumulation buffer (which the reduction fills). Returns whether it was left out."""
    zero = _zero_optimizer(optimizer)
    if zero is None or not all(hasattr(zero, name) for name in ("average_tensor", "ipg_buckets", "bit16_groups")):
        return False
    if torch.distributed.get_world_size(group=zero.dp_process_group) != 1:
        return False
    if zero.overlap_comm or zero.cpu_offload or not zero.contiguous_gradients or not zero.reduce_scatter:
        return False
    if any(zero._use_compact_grad_partition_buffer(i) for i in range(len(zero.bit16_groups))):
        return False
    if getattr(zero, "sequence_parallel_size", 1) != 1 or getattr(zero, "has_moe_layers", False):
        return False

    def average_over_one_rank(tensor, communication_data_type):
        return None     # the mean over one rank is the bucket itself

    zero.average_tensor = average_over_one_rank
    return True
