"""Exact matmul FLOPs of a T5 v1.1 / mT5 training step and exact parameter counts (no model is allocated, no torch).

    train_step_flops(load_config("mt5-large"), batch_size=64, input_length=512, target_length=114)

Counting rules: 2 FLOPs per multiply-accumulate; only matrix products (projections, QK^T, AV, LM head),
not norms, softmax, activations or the optimizer. Encoder self-attention runs over input_length,
decoder self-attention over target_length, cross-attention target_length x input_length (causal masking
is not subtracted: the kernels compute the full score matrix). A training step = forward + backward =
3 x forward (the backward computes two products per forward product).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # annotations only: counting needs no torch
    from pretrain.model.t5 import T5Config


def _linear(tokens: int, d_in: int, d_out: int) -> int:
    return 2 * tokens * d_in * d_out


def _attention_core(query_length: int, key_length: int, config: T5Config) -> int:
    """QK^T and AV for one example, all heads."""
    return 2 * (2 * config.num_heads * query_length * key_length * config.d_kv)


def _ffn(tokens: int, config: T5Config) -> int:
    return _linear(tokens, config.d_model, 2 * config.d_ff) + _linear(tokens, config.d_ff, config.d_model)


def forward_flops(config: T5Config, batch_size: int, input_length: int, target_length: int) -> int:
    """Matmul FLOPs of one forward pass with the LM head over all target positions."""
    d, inner = config.d_model, config.inner_dim
    encoder_layer = (_linear(input_length, d, 3 * inner) + _attention_core(input_length, input_length, config)
                     + _linear(input_length, inner, d) + _ffn(input_length, config))
    decoder_layer = (
        _linear(target_length, d, 3 * inner) + _attention_core(target_length, target_length, config)
        + _linear(target_length, inner, d)                                               # self-attention
        + _linear(target_length, d, inner) + _linear(input_length, d, 2 * inner)          # cross q, k|v
        + _attention_core(target_length, input_length, config) + _linear(target_length, inner, d)
        + _ffn(target_length, config))
    lm_head = _linear(target_length, d, config.vocab_size)
    per_example = config.num_layers * encoder_layer + config.num_decoder_layers * decoder_layer + lm_head
    return batch_size * per_example


def train_step_flops(config: T5Config, batch_size: int, input_length: int, target_length: int) -> int:
    """Forward + backward matmul FLOPs of one step over `batch_size` examples (3 x forward). Activation
    checkpointing's recomputation is not counted: this is the model's work, the basis of MFU."""
    return 3 * forward_flops(config, batch_size, input_length, target_length)


def count_parameters(config: T5Config) -> int:
    """Number of parameters of `build(config)` (and of HF's T5ForConditionalGeneration with that config)."""
    d, inner, ff = config.d_model, config.inner_dim, config.d_ff
    attention = 4 * d * inner
    ffn = 3 * d * ff
    encoder = config.num_layers * (attention + ffn + 2 * d)
    decoder = config.num_decoder_layers * (2 * attention + ffn + 3 * d)
    position_bias = 2 * config.relative_attention_num_buckets * config.num_heads
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return embeddings + encoder + decoder + position_bias + 2 * d   # + the two final norms
