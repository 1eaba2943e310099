"""Import from / export to HF transformers' `T5ForConditionalGeneration` (needs the `export` extra).

    model = from_hf(T5ForConditionalGeneration.from_pretrained("google/mt5-base")); export_hf(model, "out/hf")

Our model stores q|k|v, cross-attention k|v and wi_0|wi_1 fused and the position bias once per stack;
`to_hf_state_dict` / `from_hf_state_dict` are the whole mapping (split / concatenate, rename).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from pipeline.common import UserError
from pretrain.model.t5 import T5Config, T5Model
from pretrain.runlock import export_may_replace

_CONFIG_FIELDS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
                  "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate",
                  "layer_norm_epsilon", "pad_token_id", "eos_token_id", "decoder_start_token_id",
                  "tie_word_embeddings")


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise UserError("HF import/export needs transformers: pip install 't5zero[export]'") from err
    return transformers


def hf_config(config: T5Config):
    """The `transformers.T5Config` of a T5 v1.1 / mT5 model with our shape."""
    values = {field: getattr(config, field) for field in _CONFIG_FIELDS}
    return _transformers().T5Config(feed_forward_proj="gated-gelu", is_encoder_decoder=True, **values)


def config_from_hf(hf_cfg, **overrides) -> T5Config:
    """Our T5Config from a `transformers.T5Config`; refuses the non-gated (T5 v1.0) feed-forward."""
    if not getattr(hf_cfg, "is_gated_act", False) or getattr(hf_cfg, "dense_act_fn", "") != "gelu_new":
        raise UserError(f"only T5 v1.1 / mT5 (feed_forward_proj='gated-gelu') is supported, got "
                        f"feed_forward_proj={getattr(hf_cfg, 'feed_forward_proj', None)!r}")
    values = {field: getattr(hf_cfg, field) for field in _CONFIG_FIELDS}
    # transformers >= 5 forces tie_word_embeddings=True and keeps the checkpoint's setting as
    # scale_decoder_outputs (T5 v1.1 / mT5: False = untied head, no rescale).
    values["tie_word_embeddings"] = getattr(hf_cfg, "scale_decoder_outputs", hf_cfg.tie_word_embeddings)
    values["name"] = getattr(hf_cfg, "_name_or_path", "") or ""
    values.update(overrides)
    return T5Config(**values)


def _block_names(stack: str, i: int, decoder: bool) -> dict[str, str]:
    """Our parameter name -> HF's, for the parts that are not fused."""
    ours, hf = f"{stack}.blocks.{i}", f"{stack}.block.{i}.layer"
    ffn_layer = 2 if decoder else 1
    names = {f"{ours}.self_attn_norm.weight": f"{hf}.0.layer_norm.weight",
             f"{ours}.self_attn.o.weight": f"{hf}.0.SelfAttention.o.weight",
             f"{ours}.ffn_norm.weight": f"{hf}.{ffn_layer}.layer_norm.weight",
             f"{ours}.ffn.wo.weight": f"{hf}.{ffn_layer}.DenseReluDense.wo.weight"}
    if decoder:
        names |= {f"{ours}.cross_attn_norm.weight": f"{hf}.1.layer_norm.weight",
                  f"{ours}.cross_attn.q.weight": f"{hf}.1.EncDecAttention.q.weight",
                  f"{ours}.cross_attn.o.weight": f"{hf}.1.EncDecAttention.o.weight"}
    return names


def _fused(stack: str, i: int, decoder: bool) -> dict[str, list[str]]:
    """Our fused parameter -> the HF parameters concatenated along dim 0, in order."""
    ours, hf = f"{stack}.blocks.{i}", f"{stack}.block.{i}.layer"
    ffn_layer = 2 if decoder else 1
    fused = {f"{ours}.self_attn.qkv.weight": [f"{hf}.0.SelfAttention.{p}.weight" for p in "qkv"],
             f"{ours}.ffn.wi.weight": [f"{hf}.{ffn_layer}.DenseReluDense.wi_{j}.weight" for j in (0, 1)]}
    if decoder:
        fused[f"{ours}.cross_attn.kv.weight"] = [f"{hf}.1.EncDecAttention.{p}.weight" for p in "kv"]
    return fused


def _mapping(config: T5Config) -> tuple[dict[str, str], dict[str, list[str]]]:
    renamed = {"shared.weight": "shared.weight",
               "encoder.final_norm.weight": "encoder.final_layer_norm.weight",
               "decoder.final_norm.weight": "decoder.final_layer_norm.weight",
               "encoder.relative_attention_bias.weight":
                   "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
               "decoder.relative_attention_bias.weight":
                   "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"}
    if not config.tie_word_embeddings:
        renamed["lm_head.weight"] = "lm_head.weight"
    fused: dict[str, list[str]] = {}
    for stack, layers, decoder in (("encoder", config.num_layers, False),
                                   ("decoder", config.num_decoder_layers, True)):
        for i in range(layers):
            renamed |= _block_names(stack, i, decoder)
            fused |= _fused(stack, i, decoder)
    return renamed, fused


def to_hf_state_dict(model: T5Model) -> dict[str, torch.Tensor]:
    """Our state dict under HF `T5ForConditionalGeneration` names (fused weights split)."""
    return to_hf_names(model.state_dict(), model.config)


def to_hf_names(ours: dict[str, torch.Tensor], config: T5Config) -> dict[str, torch.Tensor]:
    """Tensors keyed by our parameter names (weights, or their gradients) re-keyed by HF's names."""
    renamed, fused = _mapping(config)
    state = {hf_name: ours[name] for name, hf_name in renamed.items()}
    for name, hf_names in fused.items():
        state |= dict(zip(hf_names, ours[name].chunk(len(hf_names), dim=0)))
    state["encoder.embed_tokens.weight"] = state["decoder.embed_tokens.weight"] = ours["shared.weight"]
    return {name: tensor.contiguous() for name, tensor in state.items()}


def from_hf_state_dict(state: dict[str, torch.Tensor], config: T5Config) -> dict[str, torch.Tensor]:
    """An HF T5 v1.1 state dict under our names (weights fused); refuses missing keys with their names."""
    renamed, fused = _mapping(config)
    missing = [n for n in [*renamed.values(), *(n for names in fused.values() for n in names)] if n not in state]
    if missing:
        raise UserError(f"HF state dict lacks {len(missing)} T5 v1.1 weight(s), e.g. {missing[:3]}")
    ours = {name: state[hf_name] for name, hf_name in renamed.items()}
    ours |= {name: torch.cat([state[n] for n in hf_names], dim=0) for name, hf_names in fused.items()}
    return ours


def from_hf(hf_model) -> T5Model:
    """Our model holding the weights of a `transformers.T5ForConditionalGeneration` (T5 v1.1 / mT5)."""
    config = config_from_hf(hf_model.config)
    head_is_shared = hf_model.lm_head.weight.data_ptr() == hf_model.shared.weight.data_ptr()
    if config.tie_word_embeddings and not head_is_shared:  # (a shared head without rescale loads as a copy)
        raise UserError("HF model's config says tie_word_embeddings (rescaled, tied head) but its lm_head has its "
                        "own weights; fix the config")
    model = T5Model(config)
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict(), config), strict=True)
    return model.to(next(hf_model.parameters()).dtype)


def to_hf(model: T5Model):
    """A `transformers.T5ForConditionalGeneration` holding a copy of our model's weights (same dtype)."""
    transformers = _transformers()
    hf_model = transformers.T5ForConditionalGeneration(hf_config(model.config))
    if not model.config.tie_word_embeddings:
        # transformers >= 5 always ties lm_head to shared at construction (and unties on load when the
        # checkpoint holds both); give the head its own parameter, as google/mt5-* checkpoints have.
        hf_model.lm_head.weight = torch.nn.Parameter(torch.empty_like(hf_model.shared.weight))
        getattr(hf_model, "all_tied_weights_keys", {}).pop("lm_head.weight", None)
    hf_model.load_state_dict(to_hf_state_dict(model), strict=True)
    return hf_model.to(next(model.parameters()).dtype).eval()


def export_hf(model: T5Model, out_dir: str | os.PathLike) -> Path:
    """Write a directory that `T5ForConditionalGeneration.from_pretrained(out_dir)` loads; built under a temp
    name beside `out_dir` and renamed into place (an existing directory is replaced only at the end, and only an
    empty one or an earlier export: `pretrain.runlock.export_may_replace`)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        to_hf(model).save_pretrained(staging)
        # transformers >= 5 writes tie_word_embeddings=true for every T5 and reads it back as "scale the
        # decoder output by d_model^-0.5"; T5 v1.1 / mT5 configs say false (untied head, no rescale).
        config_path = staging / "config.json"
        hf_json = json.loads(config_path.read_text())
        hf_json["tie_word_embeddings"] = model.config.tie_word_embeddings
        config_path.write_text(json.dumps(hf_json, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            if not out_dir.is_dir() or not export_may_replace(out_dir):
                raise UserError(f"{out_dir}: exists and is not an earlier HF export, which alone an export "
                                f"replaces; pick an empty or new directory (nothing there was changed)")
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
