"""The DeepSpeed config of a run: configs/deepspeed/zero{N}.yaml plus what the flags say.

    ds_config = build_ds_config(train_config, world_size=2, grad_accum=4, accelerator="cpu")

Filled in from the flags: batch sizes (train_batch_size = micro x accumulation x world), the AdamW optimizer
(torch's AdamW on CPU via "torch_adam"; DeepSpeed's FusedAdam on GPU; DeepSpeedCPUAdam when the optimizer
is offloaded to the host, which DeepSpeed picks by itself), precision (bf16 on GPU, fp32 on CPU unless the
flags say otherwise), offload of the optimizer (stages 1-3) and parameters (stage 3) to cpu or nvme,
gradient clipping and the stage-3 prefetch / persistence tunables. A YAML `deepspeed:` mapping in --config is
merged last, key by key, for anything else.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from pipeline.common import CONFIGS_DIR, UserError
from pretrain.config import STAGE3_TUNABLES, TrainConfig, engine_precision

DEEPSPEED_CONFIGS = CONFIGS_DIR / "deepspeed"


def load_stage_template(zero: int) -> dict[str, Any]:
    path = DEEPSPEED_CONFIGS / f"zero{zero}.yaml"
    if not path.is_file():
        raise UserError(f"{path}: missing DeepSpeed template for ZeRO stage {zero}; restore configs/deepspeed/")
    return yaml.safe_load(path.read_text()) or {}


def resolve_precision(precision: str, accelerator: str) -> str:
    """'auto' -> bf16 on a GPU, fp32 on CPU; explicit choices are kept (fp8 too: the engine runs it as bf16,
    `engine_precision`, and the trainer converts the blocks' linears, `pretrain.model.fp8`)."""
    if precision == "auto":
        return "fp32" if accelerator == "cpu" else "bf16"
    return precision


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


WORLD_OF_ONE_PERSISTENCE = 10 ** 12   # above any weight's element count (mt5-xxl's embedding: 1.0e9)


def build_ds_config(config: TrainConfig, *, world_size: int, grad_accum: int, accelerator: str) -> dict[str, Any]:
    """The resolved DeepSpeed config dict for `config`  on `world_size` ranks."""
    ds = load_stage_template(config.zero)
    zero_section = ds.setdefault("zero_optimization", {})
    zero_section["stage"] = config.zero
    ds["train_micro_batch_size_per_gpu"] = config.micro_batch
    ds["gradient_accumulation_steps"] = grad_accum
    ds["train_batch_size"] = config.micro_batch * grad_accum * world_size
    ds["gradient_clipping"] = float(config.grad_clip)
    adam = {"lr": config.lr, "betas": [config.adam_beta1, config.adam_beta2], "eps": config.adam_eps,
            "weight_decay": config.weight_decay}
    if accelerator == "cpu":
        adam["torch_adam"] = True          # no fused CUDA kernels on CPU: torch.optim.AdamW
        if config.offload != "none":
            ds["zero_force_ds_cpu_optimizer"] = False
    ds["optimizer"] = {"type": "AdamW", "params": adam}
    precision = resolve_precision(config.precision, accelerator)
    ds["bf16"] = {"enabled": engine_precision(precision) == "bf16"}
    ds["fp16"] = {"enabled": False}
    if config.offload != "none":
        target = {"device": config.offload, "pin_memory": accelerator != "cpu"}
        if config.offload == "nvme":
            target["nvme_path"] = config.nvme_path
        zero_section["offload_optimizer"] = dict(target)
        if config.zero == 3:
            zero_section["offload_param"] = dict(target)
    for name in STAGE3_TUNABLES:         # TrainConfig allows them at stage 3 only
        value = getattr(config, name)
        if value is not None:
            zero_section[name] = int(value)
    if (config.zero == 3 and world_size == 1 and config.offload == "none"
            and config.stage3_param_persistence_threshold is None):
        # one rank: nothing to partition, yet ZeRO 3 would gather and release every block's weights in each forward
        # and backward. Every weight stays resident instead: mt5-xl on one H200 0.64x -> 0.73x ZeRO 2, the same peak
        # memory and losses (docs/pretrain.md). The flag, or a deepspeed: mapping, still sets it.
        zero_section["stage3_param_persistence_threshold"] = WORLD_OF_ONE_PERSISTENCE
    if config.deepspeed:
        ds = deep_merge(ds, config.deepspeed)
    return ds
