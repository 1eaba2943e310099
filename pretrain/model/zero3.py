"""The model under ZeRO 3: built partitioned over the ranks, and gathered a block (or a stack) at a time.

    model = build_partitioned("mt5-large", ds_config, seed=0)   # every rank, torch.distributed initialised

Kept out of `t5.py` so that the model file knows no engine; `deepspeed` is imported on first use. The invariants
it keeps: docs/model.md ("Under ZeRO 3"); why a block is the unit of gathering: docs/pretrain.md.
"""

from __future__ import annotations

import torch

from pipeline.common import UserError
from pretrain.model.t5 import Block, Stack, T5Config, T5Model, resolve_config, seeded_normal

GATHER_UNITS = {"block": Block, "stack": Stack}   # ZeRO 3's unit of gathering, by pretrain --stage3-gather-unit


def build_partitioned(preset_or_config: str | T5Config, ds_config: dict, seed: int = 0, gather_unit: str = "block",
                      **overrides) -> T5Model:
    """`build` for ZeRO 3 without a full copy per rank: the model is constructed under
    `deepspeed.zero.Init(config_dict_or_path=ds_config)`, so every parameter is partitioned over the ranks (or
    offloaded, as ds_config says) as soon as its module exists. The weights are then the ones `build` gives
    for the same seed, bit for bit: module by module in `init_plan` order, rank 0 gathers the module's
    parameters, draws them from the seeded generator exactly as `build` does, and DeepSpeed broadcasts and
    re-partitions them (GatheredParameters with modifier_rank=0). At most one module is whole at a time (the
    largest: the embedding or the LM head). Needs torch.distributed initialised (every rank calls this).

    Every `Block` is then marked a ZeRO-3 leaf module (`deepspeed.utils.set_z3_leaf_modules`): the engine hooks,
    traces and gathers a block as one unit instead of each of its 8 (encoder) or 13 (decoder) submodules, whose
    Python fetch/release hooks otherwise cost host time per module (hooked modules: those outside the blocks,
    the blocks included). Weights, math and partitioning are unchanged; a block (at most 1/50 of a model) is only
    the unit of gathering. `gather_unit="stack"` makes each whole encoder or decoder stack the unit instead
    (fewer hooks still, but half of the blocks' weights whole at once: 0.8 GB bf16 for mt5-large, 11 GB for
    mt5-xxl); a trial setting (measured in docs/pretrain.md)."""
    if gather_unit not in GATHER_UNITS:
        raise UserError(f"ZeRO-3 gather unit must be one of {tuple(GATHER_UNITS)}, got {gather_unit!r}")
    import deepspeed
    import torch.distributed as dist

    config = resolve_config(preset_or_config, **overrides)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = T5Model(config)
    writer = dist.get_rank() == 0
    normal = seeded_normal(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for module, fill in model.init_plan():
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                if writer:
                    fill(module, normal)
    deepspeed.utils.set_z3_leaf_modules(model, [GATHER_UNITS[gather_unit]])
    return model


def drop_idle_module_hooks(optimizer) -> bool:
    """Leave out ZeRO 3's per-module hooks and its release and gather of every weight where they have nothing to
    do; returns whether they were left out.

    On one rank, with every weight resident (`ds_persist`, what `build_ds_config` sets there) and no parameter
    offload, DeepSpeed's pre/post forward and backward hooks around each hooked module (the blocks, the stacks,
    the embedding, the head) fetch and release nothing, yet cost host time the GPU waits for: about 18% of a
    host-bound ZeRO 3 step sampled on CPU (docs/pretrain.md). They are removed, and one forward pre-hook on the
    root points any weight found unavailable back at its partition (a safety net for anything that releases them
    between steps, below). The gradient hooks, which move gradients into the fp32 partitions, stay.

    DeepSpeed's step also releases every weight when it starts (`_partition_all_parameters`: a `record_stream` and
    an empty tensor per weight) and "gathers" each again after it ends, which on one rank points the weight back
    at its own bf16 partition (`ds_tensor`, the whole weight there) and waits for the GPU to finish the step (a
    stream synchronisation). That host work runs while the GPU idles: on this machine's CPU, 19.5-21.4 against
    6.5-7.1 ms of host time per optimizer step for mt5-xl's 390 weights at a tiny width (docs/pretrain.md). So the
    release becomes a check that points any weight found unavailable, or not on its partition, at its partition;
    the gather after the step then finds every weight available and does nothing. The weights stay views of their
    partitions, which the step's copy of the updated fp32 partition into the bf16 one updates in place, as before.
    Anything else: the hooks stay, and nothing changes."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    offload = getattr(optimizer, "parameter_offload", None)
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or offload is None:
        return False
    if dist.get_world_size(group=optimizer.dp_process_group) != 1:
        return False
    module = offload.module
    params = list(module.parameters())
    if offload.offload_device not in (None, "none") or not all(getattr(p, "ds_persist", False) for p in params):
        return False
    if not all(hasattr(offload, name) for name in ("forward_hooks", "backward_hooks", "fwd_pre_hook")):
        return False    # another DeepSpeed's layout: keep its hooks
    if not hasattr(optimizer, "_partition_all_parameters") or not all(_partition_is_whole(p) for p in params):
        return False
    offload._remove_module_hooks()

    @torch.no_grad()
    def onto_partitions():
        """Every weight a view of its partition, available: what DeepSpeed's gather does for an unavailable weight
        on one rank (without its stream synchronisation), and what replaces the step's release of every weight."""
        for p in params:
            partition = p.ds_tensor
            if p.ds_status != ZeroParamStatus.AVAILABLE or p.data.data_ptr() != partition.data_ptr():
                p.data = partition.data.view(p.ds_shape)
                p.ds_status = ZeroParamStatus.AVAILABLE

    def unavailable_onto_partitions(_module, _inputs):
        """Before each forward, a safety net: the status alone is checked (a fifth of the full check's host time)."""
        if any(p.ds_status != ZeroParamStatus.AVAILABLE for p in params):
            onto_partitions()

    onto_partitions()
    optimizer._partition_all_parameters = onto_partitions
    # kept on the offload object, whose destroy() removes fwd_pre_hook with the rest
    offload.fwd_pre_hook = module.register_forward_pre_hook(torch.compiler.disable(unavailable_onto_partitions))
    offload.forward_hooks, offload.backward_hooks = [], []
    return True


def _partition_is_whole(param) -> bool:
    """Whether the weight's partition holds it whole, in its own dtype and on its device (one rank, no padding)."""
    partition = getattr(param, "ds_tensor", None)
    return (partition is not None and partition.numel() == param.ds_numel and partition.dtype == param.dtype
            and partition.device == param.device and partition.is_contiguous())
