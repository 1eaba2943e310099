"""The preflight's memory estimate of a training run: model states per stage and offload, plus activations.

    estimate = estimate_memory(load_config("mt5-large"), zero=2, offload="none", precision="bf16", world_size=2,
                               local_world_size=2, micro_batch=16, input_length=512, target_length=114,
                               activation_checkpointing=False, fused_attention=True)

Model states: DeepSpeed's own estimators at stages 2 and 3 (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`, imported on use); stages 0 and 1 by the same byte counting, written
out below. Activations: a rough count of what the eager model keeps for backward.

Memory formula (bytes per parameter P, N data-parallel ranks, mixed precision bf16 as DeepSpeed assumes):
stage 0: 2 (bf16 params) + 2 (bf16 grads) + 4 (fp32 grads) + 4 (fp32 master) + 8 (Adam m, v) = 20 P per GPU;
stage 1: 4 P + 16 P / N (the fp32 part partitioned); stages 2 and 3: DeepSpeed's estimators (which assume
16-bit weights, also for fp32 runs). fp8 counts as bf16 (its weights and gradients are bf16; the FP8 copies of
a block's activations it keeps for the weight gradients are smaller than the bf16 ones). fp32 runs at stages 0-1
(CPU) count 4 (params) + 4 (grads) + 8 (Adam) = 16 P, of which stage 1 partitions the 8. Host memory includes
the fp32 model each rank builds.
Activations per micro-batch (elements, summed over layers): encoder layer L_in*(10 d + 4 inner + 3 d_ff),
decoder layer L_t*(14 d + 6 inner + 3 d_ff) + 2 inner*L_in, plus the chunked loss's logits; with activation
checkpointing, one d-vector per token per layer plus one layer. Attention probabilities are counted only where
attention runs unfused (CPU: math attention with a bias keeps heads*L_q*L_k of them per layer); on GPUs every
attention of the model runs a fused kernel (memory-efficient with the position bias, cuDNN/flash for
cross-attention), which keeps one log-sum-exp per row instead. This is the eager model's count; `--compile`
measured 0.55 GiB per mt5-large example at 512/114 on H200s against 0.72 counted here (its graphs recompute
pointwise results instead of keeping them), so the estimate errs high for compiled runs.
"""

from __future__ import annotations

from typing import Any

from pretrain.config import engine_precision
from pretrain.model.flops import count_parameters

GIB = float(1 << 30)


def estimate_memory(model_config, *, zero: int, offload: str, precision: str, world_size: int,
                    local_world_size: int, micro_batch: int, input_length: int, target_length: int,
                    activation_checkpointing: bool, fused_attention: bool = False) -> dict[str, Any]:
    """Per-device and per-node host memory (GiB) for the model states at this stage/offload, plus activations
    (`fused_attention`: attention keeps no probabilities, as on GPUs; see the module docstring)."""
    params = count_parameters(model_config)
    largest_layer = model_config.vocab_size * model_config.d_model
    nodes = max(1, world_size // max(1, local_world_size))
    per_node = max(1, local_world_size)
    cpu_offload = offload != "none"
    if zero == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        cpu_bytes, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(
            params, largest_layer, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=cpu_offload,
            cpu_offload_params=cpu_offload, zero_init=True)
        method = "deepspeed estimate_zero3_model_states_mem_needs(zero_init=True)"
        method += " (assumes 16-bit weights)" if precision == "fp32" else ""
    elif zero == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        cpu_bytes, gpu_bytes = estimate_zero2_model_states_mem_needs(
            params, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=cpu_offload)
        method = "deepspeed estimate_zero2_model_states_mem_needs"
        method += " (assumes 16-bit weights)" if precision == "fp32" else ""
    elif precision == "fp32":   # stages 0 and 1 in fp32: params + grads (4 + 4), Adam m, v (8)
        optimizer_shards = world_size if zero == 1 else 1
        optimizer_bytes = 8 * params / optimizer_shards
        gpu_bytes = 8 * params + (0 if cpu_offload else optimizer_bytes)
        cpu_bytes = 4 * params * per_node * 1.5 + (optimizer_bytes * per_node * 1.5 if cpu_offload else 0)
        method = f"byte count of pretrain/model/memory.py (stage {zero}, fp32)"
    else:   # stages 0 and 1: bf16 params + grads (2 + 2), fp32 grads + master + Adam (4 + 4 + 8)
        shards = world_size if zero == 1 else 1
        if cpu_offload:
            gpu_bytes = 4 * params
            cpu_bytes = 16 * params * per_node / shards * 1.5
        else:
            gpu_bytes = 4 * params + 16 * params / shards
            cpu_bytes = 4 * params * per_node * 1.5      # each rank builds the fp32 model on the host first
        method = f"byte count of pretrain/model/memory.py (stage {zero}, bf16)"
    element_bytes = 2 if engine_precision(precision) == "bf16" else 4
    act_bytes = activation_bytes(model_config, micro_batch, input_length, target_length, element_bytes,
                                 activation_checkpointing, fused_attention)
    per_gpu = (gpu_bytes + act_bytes) / GIB
    return {"per_gpu_gib": round(per_gpu, 3), "per_cpu_gib": round(cpu_bytes / GIB, 3),
            "model_states_gib": round(gpu_bytes / GIB, 3), "activations_gib": round(act_bytes / GIB, 3),
            "parameters": params, "method": method + " + activations (pretrain/model/memory.py)"}


def activation_bytes(c, micro_batch: int, input_length: int, target_length: int, bytes_per_element: int,
                     checkpointing: bool, fused_attention: bool = False) -> int:
    """Rough stored-activation size of one micro-batch (formula in the module docstring)."""
    d, inner, ff, heads = c.d_model, c.inner_dim, c.d_ff, c.num_heads
    encoder_layer = input_length * (10 * d + 4 * inner + 3 * ff)
    decoder_layer = target_length * (14 * d + 6 * inner + 3 * ff) + 2 * inner * input_length
    if not fused_attention:     # math attention keeps its probabilities: self (encoder, decoder) and cross
        encoder_layer += heads * input_length ** 2
        decoder_layer += heads * (target_length ** 2 + target_length * input_length)
    logits = min(c.loss_chunk_tokens, micro_batch * target_length) * c.vocab_size * 2 * 4 // bytes_per_element
    if checkpointing:
        layers = (c.num_layers * input_length + c.num_decoder_layers * target_length) * d
        stored = layers + max(encoder_layer, decoder_layer)
    else:
        stored = c.num_layers * encoder_layer + c.num_decoder_layers * decoder_layer
    return int((micro_batch * stored + logits) * bytes_per_element)
