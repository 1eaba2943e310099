"""The T5 v1.1 / mT5 model: config validation, init loss near ln(vocab) on real tokens, the chunked loss
against full-logits cross-entropy, padding, checkpointing, bf16, and that it learns."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pipeline.common import REPO_ROOT, UserError
from pretrain.model.flops import count_parameters
from pretrain.model.t5 import RelativePositionBias, T5Config, T5Model, build, list_presets, load_config


def random_batch(seed, batch=3, input_length=20, target_length=9, high=1000):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(3, high, (batch, input_length), generator=generator),
            torch.randint(3, high, (batch, target_length), generator=generator))


@pytest.fixture(scope="module")
def real_tokens():
    """Token ids of real English text (this repo's docs and code), from a BPE tokenizer trained here."""
    text = "\n".join(path.read_text() for path in sorted((REPO_ROOT / "pretrain").rglob("*.py")))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=900, special_tokens=["<pad>", "</s>", "<unk>"]))
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    assert ids.numel() > 2000 and int(ids.max()) < 1024
    return ids


def test_presets_are_all_there_and_validate():
    expected = {"t5-tiny"} | {f"t5-v1_1-{s}" for s in ("small", "base", "large", "xl", "xxl")} \
        | {f"mt5-{s}" for s in ("small", "base", "large", "xl", "xxl")}
    assert expected <= set(list_presets())
    config = load_config("mt5-base")
    assert (config.vocab_size, config.d_model, config.d_ff, config.d_kv, config.num_heads,
            config.num_layers, config.num_decoder_layers) == (250112, 768, 2048, 64, 12, 12, 12)
    assert load_config("mt5-xxl").d_model == 4096 and load_config("t5-v1_1-large").vocab_size == 32128
    assert load_config("t5-tiny", d_ff=256).d_ff == 256


@pytest.mark.parametrize("call, message", [
    (lambda: load_config("no-such-model"), "not found"),
    (lambda: load_config("t5-tiny", d_modle=3), r"model_overrides: unknown model field\(s\) \[.d_modle.\]"),
    (lambda: load_config("t5-tiny", num_heads=0), "num_heads must be a positive integer"),
    (lambda: load_config("t5-tiny", dropout_rate=1.5), "dropout_rate"),
    (lambda: load_config("t5-tiny", relative_attention_num_buckets=31), "even"),
    (lambda: load_config("t5-tiny", pad_token_id=5000), "outside the vocabulary"),
])
def test_bad_configs_raise_one_clear_user_error(call, message):
    with pytest.raises(UserError, match=message):
        call()


def test_init_is_seeded_and_fresh_loss_is_near_ln_vocab_on_real_tokens(real_tokens):
    model, same, other = build("t5-tiny", seed=3), build("t5-tiny", seed=3), build("t5-tiny", seed=4)
    for (name, p), q, r in zip(model.named_parameters(), same.parameters(), other.parameters()):
        assert torch.equal(p, q), name
        if "norm" not in name:
            assert not torch.equal(p, r), name
    inputs = real_tokens[: 8 * 48].view(8, 48)
    labels = real_tokens[8 * 48: 8 * 48 + 8 * 12].view(8, 12)
    with torch.no_grad():
        loss = model(inputs, labels=labels).item()
    # untied head N(0, d_model^-1/2) on unit-RMS hidden states: logits ~ N(0, 1), loss ~ ln V + 1/2
    assert abs(loss - math.log(1024)) < 1.0, loss


def test_chunked_loss_and_its_gradients_equal_full_logits_cross_entropy():
    inputs, labels = random_batch(0)
    labels[0, -3:] = 0          # padding is ignored
    labels[1, -2:] = -100       # and so is HF's ignore index
    chunked = build("t5-tiny", seed=1, loss_chunk_tokens=5)   # 27 target tokens: 6 chunks, the last ragged
    reference = build("t5-tiny", seed=1)
    loss = chunked(inputs, labels=labels)
    loss.backward()
    logits = reference(inputs, decoder_input_ids=reference.shift_right(labels))
    target = labels.masked_fill(labels == 0, -100)
    expected = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    for (name, p), q in zip(chunked.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(chunked(inputs, labels=labels), loss.detach())


def test_loss_gradients_scale_with_the_upstream_gradient_in_the_weights_dtype():
    """The head's backward scales its fp32 weight gradient by the upstream gradient and casts it once."""
    inputs, labels = random_batch(3)
    for dtype in (torch.float32, torch.bfloat16):
        once, twice = (build("t5-tiny", seed=1, loss_chunk_tokens=7).to(dtype) for _ in range(2))
        once(inputs, labels=labels).backward()
        (2.5 * twice(inputs, labels=labels)).backward()
        for (name, p), q in zip(once.named_parameters(), twice.parameters()):
            assert q.grad.dtype == dtype, name
            if name == "lm_head.weight":       # scaled before its one rounding: exact in fp32, near in bf16
                torch.testing.assert_close(q.grad.float(), 2.5 * p.grad.float(), rtol=1e-2 if dtype != torch.float32
                                           else 1e-6, atol=1e-6, msg=name)


def test_padding_mask_makes_padded_inputs_equal_to_unpadded():
    model = build("t5-tiny", seed=2).eval()
    inputs, labels = random_batch(5, batch=1, input_length=10)
    padded = torch.cat([inputs, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    mask = (padded != 0).long()
    decoder_input_ids = model.shift_right(labels)
    with torch.no_grad():
        plain = model(inputs, decoder_input_ids=decoder_input_ids)
        masked = model(padded, decoder_input_ids=decoder_input_ids, attention_mask=mask)
        unmasked = model(padded, decoder_input_ids=decoder_input_ids)
    torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked, plain, atol=1e-3)


def test_shift_right_starts_with_pad_and_drops_ignore_index():
    model = build("t5-tiny")
    shifted = model.shift_right(torch.tensor([[5, 6, -100, 7]]))
    assert shifted.tolist() == [[0, 5, 6, 0]]


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    inputs, labels = random_batch(1)
    plain, checkpointed = build("t5-tiny", seed=0), build("t5-tiny", seed=0, activation_checkpointing=True)
    for model in (plain, checkpointed):
        model.train()
        model(inputs, labels=labels).backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_bf16_parameters_give_a_finite_fp32_loss_close_to_fp32():
    inputs, labels = random_batch(2)
    model = build("t5-tiny", seed=0)
    loss32 = model(inputs, labels=labels)
    model = model.to(torch.bfloat16)
    loss16 = model(inputs, labels=labels)
    loss16.backward()
    assert loss16.dtype == torch.float32 and torch.isfinite(loss16)
    assert abs(loss16.item() - loss32.item()) < 0.05
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_tied_embeddings_share_one_parameter_and_rescale():
    model = build("t5-tiny", tie_word_embeddings=True)
    assert model.lm_head.weight is model.shared.weight
    inputs, labels = random_batch(3)
    model(inputs, labels=labels).backward()
    assert model.shared.weight.grad is not None


@pytest.mark.parametrize("setting", ["attention", "gated_gelu"])
def test_our_triton_kernels_without_triton_are_one_clear_line(monkeypatch, setting):
    """An explicit `triton` on a machine whose Python cannot import the triton package (stood in for by its import
    check: the suite has triton): one line naming the setting and its fix, not an ImportError's traceback."""
    import pretrain.model.t5 as t5
    monkeypatch.setenv("TRITON_INTERPRET", "1")            # past the device check, on the CPU
    monkeypatch.setattr(t5, "triton_importable", lambda: False)
    model = build("t5-tiny", seed=0, **{setting: "triton"})
    with pytest.raises(UserError, match=f"{setting}='triton' needs the triton package"):
        model(torch.randint(3, 100, (1, 8)), labels=torch.randint(3, 100, (1, 4)))


def test_it_learns_a_fixed_batch(real_tokens):
    torch.manual_seed(0)  # AdamW has no randomness; this only pins any library default
    model = build("t5-tiny", seed=0)
    inputs = real_tokens[:4 * 32].view(4, 32)
    labels = real_tokens[4 * 32: 4 * 32 + 4 * 8].view(4, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = model(inputs, labels=labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses


def test_forward_needs_labels_or_decoder_inputs():
    with pytest.raises(ValueError, match="labels"):
        build("t5-tiny")(torch.ones(1, 4, dtype=torch.long))


def test_config_round_trips_through_a_dict():
    config = load_config("mt5-large")
    assert T5Config(**config.to_dict()) == config


def test_model_modules_do_not_import_transformers_and_the_model_file_no_deepspeed():
    code = ("import sys, pretrain.model.t5, pretrain.model.zero3, pretrain.model.flops, pretrain.model.memory; "
            "assert 'transformers' not in sys.modules, 'transformers imported'; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
    light = ("import sys, pretrain.model.flops, pretrain.model.memory; "
             "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", light], check=True, cwd=REPO_ROOT)


@pytest.mark.slow
def test_compile_regions_gives_the_eager_loss_and_gradients():
    """Regional torch.compile (blocks + loss chunk) is numerically the eager model (~40 s on 2 CPU cores)."""
    inputs, labels = random_batch(4)
    eager, compiled = build("t5-tiny", seed=0, loss_chunk_tokens=16), build("t5-tiny", seed=0, loss_chunk_tokens=16)
    compiled.compile_regions()
    for model in (eager, compiled):
        model(inputs, labels=labels).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_largest_preset_builds_on_the_meta_device_with_the_counted_parameters():
    """`with torch.device("meta")` builds mt5-xxl (13B) without memory, as users count or plan with it: every
    parameter where the counts of flops.py say, and the position bias's saturating offset that of a host build."""
    config = load_config("mt5-xxl")
    with torch.device("meta"):
        model = T5Model(config)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config)
    host = RelativePositionBias(config, bidirectional=True)
    assert model.encoder.relative_attention_bias.saturate == host.saturate > 0
