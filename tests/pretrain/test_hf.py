"""Parity with HF transformers' T5ForConditionalGeneration on the same weights (fp32, random tiny config
built locally, no hub download), in both directions, and export_hf -> from_pretrained."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipeline.common import UserError  # noqa: E402
from pretrain.model.hf import config_from_hf, export_hf, from_hf, hf_config, to_hf, to_hf_names  # noqa: E402
from pretrain.model.t5 import build, load_config  # noqa: E402


def perturbed_hf_model(seed=0):
    """A random HF T5 v1.1 model (d_kv*heads != d_model) whose every weight, norms included, is distinct."""
    config = hf_config(load_config("t5-tiny", d_kv=24, num_decoder_layers=3))
    hf_model = transformers.T5ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed)
    # transformers >= 5 ties lm_head to shared at construction; give the head its own weights, as mT5 has.
    # (drawn, not torch.empty: uninitialised memory left by earlier tests once held NaN here)
    hf_model.lm_head.weight = torch.nn.Parameter(torch.randn(hf_model.shared.weight.shape, generator=generator))
    getattr(hf_model, "all_tied_weights_keys", {}).pop("lm_head.weight", None)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return hf_model.eval()


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 1000, (3, 19), generator=generator)
    labels = torch.randint(3, 1000, (3, 7), generator=generator)
    labels[2, -2:] = -100
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -5:] = 0
    return input_ids, labels, attention_mask


def test_from_hf_gives_hf_logits_loss_and_gradients():
    """fp32, equal to 1e-5 of the largest magnitude (float rounding: the fused matmuls sum in another order;
    HF also rounds its softmax and norm statistics to fp32); any mapping or formula slip is O(1)."""
    tolerance = 1e-5
    hf_model = perturbed_hf_model()
    ours = from_hf(hf_model)
    assert ours.config.d_kv == 24 and ours.config.num_decoder_layers == 3 and not ours.config.tie_word_embeddings
    input_ids, labels, attention_mask = batch()
    hf_out = hf_model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    logits = ours(input_ids, decoder_input_ids=ours.shift_right(labels), attention_mask=attention_mask)
    scale = hf_out.logits.abs().max().item()
    torch.testing.assert_close(logits, hf_out.logits, rtol=0, atol=tolerance * scale)
    loss = ours(input_ids, labels=labels, attention_mask=attention_mask)
    torch.testing.assert_close(loss, hf_out.loss, rtol=tolerance, atol=0)
    hf_out.loss.backward()
    loss.backward()
    hf_grads = {name: p.grad for name, p in hf_model.named_parameters()}
    ours_grads = to_hf_names({name: p.grad for name, p in ours.named_parameters()}, ours.config)
    for name, grad in ours_grads.items():
        if name.endswith("embed_tokens.weight"):
            continue
        scale = hf_grads[name].abs().max().item()
        torch.testing.assert_close(grad, hf_grads[name], rtol=0, atol=10 * tolerance * scale, msg=name)


def test_to_hf_gives_our_logits():
    ours = build("t5-tiny", seed=7).eval()
    hf_model = to_hf(ours)
    input_ids, labels, attention_mask = batch(1)
    with torch.no_grad():
        expected = ours(input_ids, decoder_input_ids=ours.shift_right(labels), attention_mask=attention_mask)
        got = hf_model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_export_dir_loads_with_from_pretrained_and_round_trips(tmp_path):
    ours = build("t5-tiny", seed=11).eval()
    out = export_hf(ours, tmp_path / "hf")
    assert (out / "config.json").is_file() and not list(tmp_path.glob(".hf.*"))
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    input_ids, labels, _ = batch(2)
    with torch.no_grad():
        expected = ours(input_ids, decoder_input_ids=ours.shift_right(labels))
        got = loaded(input_ids=input_ids, labels=labels).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    back = from_hf(loaded)
    assert back.config.tie_word_embeddings is False
    for (name, p), q in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(p, q), name
    export_hf(ours, out)   # replacing an existing export works
    assert (out / "config.json").is_file()


def test_an_export_replaces_only_an_empty_directory_or_an_earlier_export(tmp_path):
    ours = build("t5-tiny", seed=11)
    (tmp_path / "empty").mkdir()
    assert (export_hf(ours, tmp_path / "empty") / "model.safetensors").is_file()
    foreign = tmp_path / "mywork"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious\n")
    (foreign / "config.json").write_text("{}\n")
    with pytest.raises(UserError, match="not an earlier HF export"):
        export_hf(ours, foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["config.json", "notes.txt"]
    assert (foreign / "notes.txt").read_text() == "precious\n" and not list(tmp_path.glob(".mywork.*"))


def test_preset_configs_map_to_hf_shapes():
    for preset in ("mt5-base", "mt5-large", "t5-v1_1-small"):
        config = load_config(preset)
        hf_cfg = hf_config(config)
        assert hf_cfg.is_gated_act and hf_cfg.dense_act_fn == "gelu_new"
        round_trip = config_from_hf(hf_cfg, name=preset)
        assert round_trip == config


def test_non_gated_hf_model_is_refused():
    from pipeline.common import UserError
    with pytest.raises(UserError, match="gated-gelu"):
        config_from_hf(transformers.T5Config(feed_forward_proj="relu"))
