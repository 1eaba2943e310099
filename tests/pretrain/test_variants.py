"""The benchmarks' variant names (pretrain/model/variants.py): each part of a name is what the built model has, and
every variant starts from the same weights (the same loss on the same batch). Real models: t5-tiny on the CPU."""

import pytest
import torch

from pretrain.model.t5 import T5Model, build
from pretrain.model.variants import attention_of, build_variant


@pytest.fixture(scope="module")
def ours_cpu():
    torch.manual_seed(0)
    return build("t5-tiny", vocab_size=128)


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, 128, (2, 16), generator=generator), torch.randint(3, 128, (2, 5), generator=generator)


def loss_of(variant, model):
    input_ids, labels = batch()
    with torch.no_grad():
        if variant.startswith("hf"):
            return float(model(input_ids=input_ids, labels=labels).loss)
        return float(model(input_ids, labels=labels))


@pytest.mark.parametrize("variant, attention", [("ours", "sdpa"), ("ours-compile", "sdpa"),
                                                ("ours-compile-flex", "flex"), ("ours-compile-triton", "triton"),
                                                ("ours-compile-triton-fp8", "triton"), ("hf-compile", "sdpa")])
def test_the_attention_kernel_is_the_part_of_the_name_that_names_one(variant, attention):
    assert attention_of(variant) == attention


def test_each_part_of_a_name_is_what_the_model_has(ours_cpu):
    plain = build_variant("ours", ours_cpu, "cpu", torch.float32)
    assert isinstance(plain, T5Model) and plain.training and plain.config.attention == "sdpa"
    assert plain.config.gated_gelu == ours_cpu.config.gated_gelu
    assert plain.encoder.relative_attention_bias.saturate == ours_cpu.encoder.relative_attention_bias.saturate
    gated = build_variant("ours-compile-triton-torchgate", ours_cpu, "cpu", torch.bfloat16)
    assert gated.config.attention == "triton" and gated.config.gated_gelu == "torch"
    assert next(gated.parameters()).dtype == torch.bfloat16
    assert all(hasattr(block.forward, "_torchdynamo_orig_callable") for block in gated.encoder.blocks)
    assert not hasattr(plain.encoder.blocks[0].forward, "_torchdynamo_orig_callable")
    diagonal = build_variant("ours-compile-triton-perdiagonal", ours_cpu, "cpu", torch.float32)
    assert [s.relative_attention_bias.saturate for s in (diagonal.encoder, diagonal.decoder)] == [0, 0]
    kinds = {type(m).__name__ for m in build_variant("ours-fp8", ours_cpu, "cpu", torch.float32).modules()}
    assert {"Fp8Linear", "Fp8GatedGeluFFN"} <= kinds and "GatedGeluFFN" not in kinds
    hf = build_variant("hf", ours_cpu, "cpu", torch.float32)
    assert type(hf).__name__ == "T5ForConditionalGeneration" and hf.training


def test_every_variant_starts_from_the_same_weights(ours_cpu):
    """fp32, eager: the names that change only how the same function is computed give the same loss."""
    reference = loss_of("ours", build_variant("ours", ours_cpu, "cpu", torch.float32))
    for variant in ("hf", "ours-torchgate"):
        assert loss_of(variant, build_variant(variant, ours_cpu, "cpu", torch.float32)) == \
            pytest.approx(reference, rel=1e-5), variant
