"""Exact FLOP and parameter counts: a hand count for t5-tiny, torch's FlopCounterMode on the real model, and
the published sizes of the T5 v1.1 / mT5 presets (nothing big is allocated)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pretrain.model.flops import count_parameters, forward_flops, train_step_flops
from pretrain.model.t5 import T5Config, build, load_config


def test_train_step_flops_match_a_hand_count_for_t5_tiny():
    # t5-tiny: d_model 64, 4 heads x d_kv 16 (inner 64), d_ff 128, vocab 1024, 2 + 2 layers.
    # batch 2, inputs 16, targets 8; 2 FLOPs per multiply-accumulate.
    encoder_layer = (
        2 * 16 * 64 * 192      # q|k|v projection       393,216
        + 2 * 4 * 16 * 16 * 16  # Q K^T                  32,768
        + 2 * 4 * 16 * 16 * 16  # A V                    32,768
        + 2 * 16 * 64 * 64      # o                     131,072
        + 2 * 16 * 64 * 256     # wi_0 | wi_1           524,288
        + 2 * 16 * 128 * 64     # wo                    262,144
    )
    decoder_layer = (
        2 * 8 * 64 * 192        # self q|k|v            196,608
        + 2 * 4 * 8 * 8 * 16    # self Q K^T              8,192
        + 2 * 4 * 8 * 8 * 16    # self A V                8,192
        + 2 * 8 * 64 * 64       # self o                 65,536
        + 2 * 8 * 64 * 64       # cross q                65,536
        + 2 * 16 * 64 * 128     # cross k|v over inputs 262,144
        + 2 * 4 * 8 * 16 * 16   # cross Q K^T            16,384
        + 2 * 4 * 8 * 16 * 16   # cross A V              16,384
        + 2 * 8 * 64 * 64       # cross o                65,536
        + 2 * 8 * 64 * 256      # wi_0 | wi_1           262,144
        + 2 * 8 * 128 * 64      # wo                    131,072
    )
    lm_head = 2 * 8 * 64 * 1024  # 1,048,576
    assert encoder_layer == 1_376_256 and decoder_layer == 1_097_728
    forward = 2 * (2 * encoder_layer + 2 * decoder_layer + lm_head)
    assert forward == 11_993_088
    config = load_config("t5-tiny")
    assert forward_flops(config, 2, 16, 8) == forward
    assert train_step_flops(config, 2, 16, 8) == 3 * forward == 35_979_264


def test_flop_count_equals_torch_flop_counter_on_the_real_model():
    """FlopCounterMode counts every mm/bmm the model really runs (math attention so that it sees QK^T, AV),
    forward alone and forward + backward of the loss (which includes the chunked LM-head backward)."""
    config = load_config("t5-tiny", d_kv=24, num_layers=3, loss_chunk_tokens=7)  # inner 96 != d_model
    model = build(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    batch, input_length, target_length = 3, 20, 11
    input_ids = torch.randint(3, 900, (batch, input_length), generator=generator)
    labels = torch.randint(3, 900, (batch, target_length), generator=generator)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids, decoder_input_ids=model.shift_right(labels))
    assert counter.get_total_flops() == forward_flops(config, batch, input_length, target_length)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids, labels=labels).backward()
    assert counter.get_total_flops() == train_step_flops(config, batch, input_length, target_length)


@pytest.mark.parametrize("overrides", [{}, {"d_kv": 8, "num_heads": 3, "num_decoder_layers": 3},
                                       {"tie_word_embeddings": True}])
def test_count_parameters_equals_the_built_model(overrides):
    model = build("t5-tiny", **overrides)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert count_parameters(model.config) == sum(unique.values())


@pytest.mark.parametrize("preset, published", [
    ("mt5-small", 300e6), ("mt5-base", 580e6), ("mt5-large", 1.2e9), ("mt5-xl", 3.7e9), ("mt5-xxl", 13e9),
    ("t5-v1_1-small", 77e6), ("t5-v1_1-base", 248e6), ("t5-v1_1-large", 783e6), ("t5-v1_1-xl", 2.85e9),
    ("t5-v1_1-xxl", 11.1e9),
])
def test_preset_parameter_counts_match_the_published_sizes(preset, published):
    """mT5 paper: 300M / 580M / 1.2B / 3.7B / 13B; HF model cards for T5 v1.1. Within 3%."""
    assert count_parameters(load_config(preset)) == pytest.approx(published, rel=0.03)


def test_flops_grow_with_each_length_separately():
    config = T5Config(vocab_size=100, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2)
    base = train_step_flops(config, 1, 10, 5)
    assert train_step_flops(config, 2, 10, 5) == 2 * base
    assert train_step_flops(config, 1, 11, 5) > base and train_step_flops(config, 1, 10, 6) > base
