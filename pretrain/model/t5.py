"""T5 v1.1 / mT5 encoder-decoder in plain PyTorch, readable top to bottom: config, presets, layers, loss, model.

    model = build("mt5-base", seed=0); loss = model(input_ids, labels=labels)

Architecture (T5 v1.1 / mT5, as in HF `T5ForConditionalGeneration` with `feed_forward_proj="gated-gelu"`):
RMSNorm without bias (statistics in fp32), gated-GELU feed-forward (tanh approximation), pre-norm residual
blocks, relative position buckets whose bias is computed once per stack and shared by its layers, no
scaling of attention scores (T5 folds 1/sqrt(d_kv) into the init), an untied LM head without rescaling,
and no dropout by default. On a GPU of compute capability >= 9.0 the self-attentions run our Triton kernels
(`pretrain/model/relative_attention.py`: the bias read per key - query offset, its gradient reduced in the kernel,
deterministic), on older GPUs FlexAttention, which adds the trainable position bias inside its kernel
(`flex_self_attention`); on the CPU (no FlexAttention backward there), with dropout, or with `attention="sdpa"`
they run `scaled_dot_product_attention` with the position bias as the additive mask (scale=1.0):
`attention="auto"`, the default, picks by the input's device (`T5Config.self_attention_kind`). The loss never
materialises the full fp32 logits: it walks the target tokens in chunks and computes logits, cross-entropy and
their gradients chunk by chunk.

Weights are stored fused where that saves kernel launches (q|k|v, k|v of cross-attention, wi_0|wi_1);
`pretrain/model/hf.py` maps them to and from HF's names. This module imports neither `transformers` nor
`deepspeed`: the ZeRO-3 partitioned build is `pretrain/model/zero3.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from pipeline.common import CONFIGS_DIR, UserError

MODELS_DIR = CONFIGS_DIR / "models"
ATTENTION_KINDS = ("auto", "sdpa", "flex", "triton")   # T5Config.attention: how the self-attentions add the bias
GATED_GELU_KINDS = ("auto", "torch", "triton")         # T5Config.gated_gelu: the feed-forward's gate


@dataclass
class T5Config:
    """Shape and conventions of a T5 v1.1 / mT5 model (field names as in HF's `T5Config`)."""

    vocab_size: int
    d_model: int
    d_kv: int                      # size of one attention head
    d_ff: int                      # inner size of the gated-GELU feed-forward
    num_layers: int                # encoder blocks
    num_decoder_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.0
    layer_norm_epsilon: float = 1e-6
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0
    tie_word_embeddings: bool = False
    activation_checkpointing: bool = False
    name: str = ""
    loss_chunk_tokens: int = 4096  # target tokens per chunk of the LM-head loss (bounds logits memory)
    attention: str = "auto"        # self-attention kernel: "sdpa" (bias as additive mask), "flex" (FlexAttention),
    # "triton" (pretrain/model/relative_attention.py) or "auto": see self_attention_kind
    gated_gelu: str = "auto"       # the feed-forward's gate: "torch" (F.gelu * linear, fused by torch.compile), "triton"
    # (pretrain/model/gated_gelu.py) or "auto": see gated_gelu_kind

    def __post_init__(self):
        positive = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
                    "relative_attention_num_buckets", "relative_attention_max_distance", "loss_chunk_tokens")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"model config {self.name or '?'}: {field} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise UserError(f"model config {self.name or '?'}: dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if self.relative_attention_num_buckets % 2:
            raise UserError(f"model config {self.name or '?'}: relative_attention_num_buckets must be even "
                            f"(half for each direction in the encoder), got {self.relative_attention_num_buckets}")
        for field in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
            if not 0 <= getattr(self, field) < self.vocab_size:
                raise UserError(f"model config {self.name or '?'}: {field}={getattr(self, field)} is outside "
                                f"the vocabulary [0, {self.vocab_size})")
        if self.attention not in ATTENTION_KINDS:
            raise UserError(f"model config {self.name or '?'}: attention must be one of {ATTENTION_KINDS}, "
                            f"got {self.attention!r}")
        if self.gated_gelu not in GATED_GELU_KINDS:
            raise UserError(f"model config {self.name or '?'}: gated_gelu must be one of {GATED_GELU_KINDS}, "
                            f"got {self.gated_gelu!r}")
        if self.attention in ("flex", "triton") and self.dropout_rate > 0:
            raise UserError(f"model config {self.name or '?'}: attention={self.attention!r} has no dropout of "
                            f"attention probabilities; use attention='sdpa' with dropout_rate={self.dropout_rate}")

    def self_attention_kind(self, device_type: str) -> str:
        """The kernel of the self-attentions for inputs on `device_type`: an explicit choice as it is, else (auto),
        without dropout of attention probabilities (neither kernel has it), on CUDA: triton (our kernels) on GPUs of
        compute capability >= 9.0 (Hopper and later; measured on an H200: mt5-large 1.026x flex's step, its 400-step
        loss as close to HF's as flex's over 4 seeds, docs/model.md), flex (1.12x the SDPA step) on older GPUs,
        where our kernels' tile settings are not measured; sdpa elsewhere (PyTorch has no FlexAttention backward on
        the CPU)."""
        if self.attention != "auto":
            return self.attention
        if device_type != "cuda" or self.dropout_rate > 0:
            return "sdpa"
        return "triton" if triton_attention_measured() else "flex"

    def gated_gelu_kind(self, device_type: str) -> str:
        """The feed-forward's gate for inputs on `device_type`: an explicit choice as it is, else (auto) triton (our
        two kernels: the backward's two gradients from one tanh, measured against Inductor's fused backward in
        docs/model.md) on CUDA with Triton importable, torch elsewhere."""
        if self.gated_gelu != "auto":
            return self.gated_gelu
        return "triton" if device_type == "cuda" and triton_importable() else "torch"

    @property
    def inner_dim(self) -> int:
        """Width of all heads together (num_heads * d_kv); need not equal d_model."""
        return self.num_heads * self.d_kv

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=None)
def triton_attention_measured() -> bool:
    """Whether `attention: auto` takes our Triton kernels on this machine's CUDA device: one of compute capability
    >= 9.0 (the tile settings in relative_attention.py were swept on an H200), with Triton importable."""
    return torch.cuda.get_device_capability() >= (9, 0) and triton_importable()


_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_importable() -> bool:
    """Whether the triton package is there (looked up once, at import: the compiled blocks call this, and Dynamo
    warns at every compile about a call to an `lru_cache`-wrapped function)."""
    return _TRITON_FOUND


def require_kernel_device(setting: str, device_type: str, instead: str) -> None:
    """`setting`='triton' (our Triton kernels) for tensors on `device_type`: one clear line off CUDA, except under
    Triton's interpreter (TRITON_INTERPRET=1), where the tests run the kernels on the CPU, or without the triton
    package."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(f"{setting}='triton' runs on CUDA devices (on the CPU only in Triton's interpreter, "
                        f"TRITON_INTERPRET=1, for tests); use {setting}='auto' or {instead!r} here")
    if not triton_importable():
        raise UserError(f"{setting}='triton' needs the triton package, which this Python cannot import (CUDA builds "
                        f"of torch bring it: pip install triton); use {setting}='auto' or {instead!r} here")


FP8_MIN_CAPABILITY = (8, 9)          # CUDA compute capability with FP8 tensor cores (Ada, Hopper, Blackwell)


def require_fp8(device_type: str, capability, where: str) -> None:
    """--precision fp8 (pretrain/model/fp8.py) on `where`, a device of `device_type` with CUDA compute `capability`
    (None off CUDA): one clear line unless it has FP8 tensor cores, or is the CPU under Triton's interpreter
    (TRITON_INTERPRET=1, the tests). Preflight asks before any rank starts, `convert_to_fp8` on each rank."""
    if device_type == "cuda" and tuple(capability) >= FP8_MIN_CAPABILITY:
        return
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise UserError(f"--precision fp8 needs a GPU of compute capability >= 8.9 (L4/L40, H100/H200, B200); {where} "
                    f"has none: use --precision bf16")


FP8_ALIGNMENT = 16                   # torch._scaled_mm: every dimension of both operands a multiple of this


def fp8_bf16_parts(config: T5Config, micro_batch: int, input_length: int, target_length: int) -> list[str]:
    """Which parts of `config`'s blocks --precision fp8 leaves in bf16 at this micro batch and these lengths, one
    phrase each with the fix (empty: every block linear runs in FP8). A linear falls back to bf16 where a weight
    dimension or its token count (micro batch x length) is not a multiple of 16 (`fp8.fp8_linear`)."""
    def multiple(length: int) -> int:     # the smallest micro batch whose token count is a multiple of 16
        return FP8_ALIGNMENT // math.gcd(length, FP8_ALIGNMENT)
    widths = (config.d_model, config.d_ff, config.num_heads * config.d_kv)
    if any(width % FP8_ALIGNMENT for width in widths):
        return [f"every block linear: d_model / d_ff / heads x d_kv = {' / '.join(map(str, widths))} are not all "
                f"multiples of {FP8_ALIGNMENT}"]
    parts = []
    for part, length in (("the encoder's linears and cross-attention's k|v", input_length),
                         ("the decoder's other linears", target_length)):
        if (micro_batch * length) % FP8_ALIGNMENT:
            parts.append(f"{part}: {micro_batch} x {length} tokens a micro batch is not a multiple of "
                         f"{FP8_ALIGNMENT}; a micro batch that is a multiple of {multiple(length)} runs them in FP8")
    return parts


def list_presets() -> list[str]:
    """Names of the presets in configs/models/ (e.g. 't5-tiny', 'mt5-base')."""
    return sorted(path.stem for path in MODELS_DIR.glob("*.yaml"))


def load_config(preset: str, **overrides) -> T5Config:
    """Read configs/models/<preset>.yaml (or a path to a YAML file) and apply `overrides`."""
    path = Path(preset)
    if path.suffix not in (".yaml", ".yml"):
        path = MODELS_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise UserError(f"model preset {preset!r} not found ({path}); pick one of: {', '.join(list_presets())}")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise UserError(f"{path}: expected a mapping of T5Config fields, got {type(values).__name__}")
    values.setdefault("name", path.stem)
    known = {f.name for f in dataclasses.fields(T5Config)}
    for where, given in ((str(path), values), ("model_overrides", overrides)):
        unknown = sorted(set(given) - known)
        if unknown:
            raise UserError(f"{where}: unknown model field(s) {unknown}; known fields: {sorted(known)}")
    return T5Config(**{**values, **overrides})


# ---------------------------------------------------------------------------------------------- layers

def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 (statistics and the loss); fp32/fp64 unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class RMSNorm(nn.Module):
    """T5's layer norm: scale only, no mean subtraction, no bias; statistics in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = at_least_fp32(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(self.weight.dtype)


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Map key-minus-query offsets to T5's buckets: exact for small offsets, log-spaced up to max_distance."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)   # the decoder only looks back
    max_exact = num_buckets // 2
    log_scaled = max_exact + (
        torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    log_scaled = log_scaled.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, log_scaled)


def saturating_offset(bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """The smallest d > 0 from which every key - query offset >= d has one bucket and every offset <= -d has one
    (T5's last buckets, from somewhat below max_distance on): what `relative_attention(saturate=)` needs to sum
    those ranges' bias gradient whole. 0 if the buckets never saturate."""
    far = 2 * max(max_distance, num_buckets) + 1
    distances = torch.arange(1, far + 1, device="cpu")   # a constant of the config: on the host, whatever the
    # default device (a model built under torch.device("meta") or "cuda": nonzero has no meta kernel, syncs on cuda)
    saturate = 1
    for side in (-1, 1):                          # from one past the farthest distance whose bucket is not the last
        buckets = relative_position_bucket(side * distances, bidirectional, num_buckets, max_distance)
        differs = (buckets != buckets[-1]).nonzero()
        if len(differs):
            saturate = max(saturate, int(differs[-1]) + 2)
    return saturate if saturate < far else 0


class RelativePositionBias(nn.Module):
    """One learned scalar per (bucket, head); computed once per stack and added to every layer's scores. Called
    with `by_offset=True` it returns the bias of each key - query offset instead, [heads, 2 * length - 1] fp32, the
    form the Triton kernels read (it goes through the module call, so that ZeRO 3 gathers the weight)."""

    def __init__(self, config: T5Config, bidirectional: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.relative_attention_num_buckets, config.num_heads))
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.saturate = saturating_offset(bidirectional, self.num_buckets, self.max_distance)

    def forward(self, query_length: int, key_length: int, by_offset: bool = False) -> torch.Tensor:
        """Bias of shape [1, heads, query_length, key_length] in the weight's dtype; by_offset: [heads,
        query_length + key_length - 1] fp32, index (key - query) + query_length - 1."""
        device = self.weight.device
        if by_offset:
            offsets = torch.arange(1 - query_length, key_length, device=device)
            buckets = relative_position_bucket(offsets, self.bidirectional, self.num_buckets, self.max_distance)
            return F.embedding(buckets, self.weight).t().float().contiguous()
        offsets = (torch.arange(key_length, device=device)[None, :]
                   - torch.arange(query_length, device=device)[:, None])
        buckets = relative_position_bucket(offsets, self.bidirectional, self.num_buckets, self.max_distance)
        # contiguous: the permuted view has a last-dim stride of `heads`, which CUDA's fused SDPA kernels refuse,
        # so the encoder (whose bias gets no masked_fill copy, unlike the decoder's) fell back to math attention
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0).contiguous()


FLEX_BLOCK = 128
"""FlexAttention runs at lengths padded up to a multiple of this (its block size): the bf16 backward with a
score_mod and a block mask gave NaN at the decoder's 114 (PyTorch issue 153799); the keys past the true length
are masked, the queries past it dropped."""


class FlexBias(NamedTuple):
    """What a self-attention adds to its scores under `attention="flex"`, in the form FlexAttention reads inside
    its kernel, so that no [batch, heads, L, L] bias (nor, in backward, its gradient) is ever materialised.
    Everything is at the padded length P (a multiple of FLEX_BLOCK); `length` is the true one."""

    position: torch.Tensor            # [heads, P, P] fp32 position bias (batch-independent; requires grad)
    padding: torch.Tensor | None      # [batch, P] additive key padding bias (0 or large negative); None: none
    block_mask: BlockMask | None      # keys past `length` masked, in the decoder causal; None: all keys
    length: int


def causal_mask_mod(batch, head, q_idx, kv_idx):
    """FlexAttention mask_mod of the decoder's self-attention: a query sees itself and the keys before it."""
    return q_idx >= kv_idx


def flex_mask_mod(length: int, causal: bool):
    """The mask_mod at a padded length: keys before `length` only, and causal in the decoder."""
    def valid_key(batch, head, q_idx, kv_idx):
        return kv_idx < length

    def valid_causal(batch, head, q_idx, kv_idx):
        return (kv_idx < length) & (q_idx >= kv_idx)
    return valid_causal if causal else valid_key


EAGER_FLEX_DEVICES = {"cpu"}   # device types where an uncompiled model calls flex_attention as is (flex_self_attention)


@functools.cache
def compiled_flex_attention():
    """torch.compile(flex_attention), made on first use (making it imports Dynamo, ~2 s)."""
    return torch.compile(flex_attention, dynamic=False)


def flex_self_attention(q, k, v, bias: FlexBias) -> torch.Tensor:
    """softmax(q k^T + position bias [+ padding bias], masked) v by FlexAttention, scale 1 as T5. The score_mod
    reads bias.position [h, q, kv] (and bias.padding [b, kv]); FlexAttention's backward accumulates the gradient of
    that captured fp32 tensor inside the kernel (atomic adds over the batch), and autograd carries it on to the
    bucket table.

    FlexAttention is fused only when compiled. Inside compile_regions' graphs it is; an uncompiled model calls it
    through `compiled_flex_attention` (off the CPU), so it still gets the fused kernels rather than PyTorch's dense
    reference, which materialises [batch, heads, L, L] scores and (a PyTorch bug, seen in 2.13) returns a wrong
    gradient for a captured bias under non-reentrant activation checkpointing. On CPU (EAGER_FLEX_DEVICES) the op
    runs as called: Inductor has no CPU backward for it (PyTorch refuses FlexAttention's backward on CPU).

    bias.position must not be a view: AOTAutograd (torch 2.13, any compiled path) silently drops the gradient of
    a view captured by a score_mod (`Stack.flex_self_attention_bias` makes a fresh tensor)."""
    position, padding, length = bias.position, bias.padding, bias.length

    def score_mod(score, batch, head, q_idx, kv_idx):
        score = score + position[head, q_idx, kv_idx]
        return score if padding is None else score + padding[batch, kv_idx]
    compile_here = not torch.compiler.is_compiling() and q.device.type not in EAGER_FLEX_DEVICES
    attend = compiled_flex_attention() if compile_here else flex_attention
    extra = position.shape[-1] - length
    if extra:      # [B, H, L, D] -> [B, H, P, D]: zeros past the true length (masked as keys, dropped as queries)
        q, k, v = (F.pad(t, (0, 0, 0, extra)) for t in (q, k, v))
    out = attend(q, k, v, score_mod=score_mod, block_mask=bias.block_mask, scale=1.0)
    return out[:, :, :length] if extra else out


class OffsetBias(NamedTuple):
    """What a self-attention adds to its scores under `attention="triton"`: the position bias per key - query offset
    and the padding bias per key, read inside the kernels of `pretrain/model/relative_attention.py`."""

    position: torch.Tensor            # [heads, 2L - 1] fp32 (RelativePositionBias(by_offset=True); requires grad)
    padding: torch.Tensor | None      # [batch, L] fp32 additive key bias (0 or large negative); None: none
    causal: bool                      # the decoder's: a query sees itself and the keys before it
    attend: object                    # relative_attention, imported on first use (it imports Triton)
    saturate: int                     # the offsets from which the bias is one value per side (saturating_offset)


class Attention(nn.Module):
    """Multi-head attention without score scaling; q|k|v fused for self-attention, k|v for cross-attention.
    `bias` is the additive mask of SDPA (a tensor or None), a `FlexBias` (FlexAttention runs instead) or an
    `OffsetBias` (the Triton kernels run on the fused q|k|v as it comes out of its matmul)."""

    def __init__(self, config: T5Config, cross: bool):
        super().__init__()
        inner = config.inner_dim
        self.num_heads, self.d_kv, self.cross = config.num_heads, config.d_kv, cross
        if cross:
            self.q = nn.Linear(config.d_model, inner, bias=False)
            self.kv = nn.Linear(config.d_model, 2 * inner, bias=False)
        else:
            self.qkv = nn.Linear(config.d_model, 3 * inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.dropout_rate = config.dropout_rate

    def _heads(self, x: torch.Tensor, parts: int) -> torch.Tensor:
        batch, length, _ = x.shape   # [B, L, parts*H*D] -> [parts, B, H, L, D]
        return x.view(batch, length, parts, self.num_heads, self.d_kv).permute(2, 0, 3, 1, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | FlexBias | OffsetBias | None,
                memory: torch.Tensor | None = None):
        if isinstance(bias, OffsetBias):   # T5Config rejects dropout with triton
            return self.o(bias.attend(self.qkv(x), bias.position, self.num_heads, bias.causal, bias.padding,
                                      bias.saturate))
        if self.cross:
            q = self._heads(self.q(x), 1)[0]
            k, v = self._heads(self.kv(memory), 2).unbind(0)
        else:
            q, k, v = self._heads(self.qkv(x), 3).unbind(0)
        if isinstance(bias, FlexBias):   # T5Config rejects dropout with flex
            out = flex_self_attention(q, k, v, bias)
        else:
            dropout = self.dropout_rate if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=1.0)
        batch, _, length, _ = out.shape
        return self.o(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.d_kv))


class GatedGeluFFN(nn.Module):
    """wo(gelu_tanh(wi_0 x) * wi_1 x), with wi_0|wi_1 fused into one matmul; the gate by `config.gated_gelu_kind`."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.wi(x)
        if self.config.gated_gelu_kind(x.device.type) == "triton":
            require_kernel_device("gated_gelu", x.device.type, instead="torch")
            from pretrain.model.gated_gelu import gated_gelu   # imports Triton: only when used
            hidden = gated_gelu(projected)
        else:
            gate, linear = projected.chunk(2, dim=-1)
            hidden = F.gelu(gate, approximate="tanh") * linear
        return self.wo(F.dropout(hidden, self.config.dropout_rate, self.training))


class Block(nn.Module):
    """Pre-norm residual block: self-attention, (decoder only) cross-attention, feed-forward."""

    def __init__(self, config: T5Config, is_decoder: bool):
        super().__init__()
        self.self_attn_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.self_attn = Attention(config, cross=False)
        if is_decoder:
            self.cross_attn_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
            self.cross_attn = Attention(config, cross=True)
        self.ffn_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.ffn = GatedGeluFFN(config)
        self.is_decoder = is_decoder
        self.dropout_rate = config.dropout_rate

    def forward(self, x, self_bias, memory=None, memory_bias=None):
        drop = lambda t: F.dropout(t, self.dropout_rate, self.training)  # noqa: E731 (identity at rate 0)
        x = x + drop(self.self_attn(self.self_attn_norm(x), self_bias))
        if self.is_decoder:
            x = x + drop(self.cross_attn(self.cross_attn_norm(x), memory_bias, memory))
        return x + drop(self.ffn(self.ffn_norm(x)))


class Stack(nn.Module):
    """Encoder (bidirectional buckets) or decoder (causal, with cross-attention): blocks + final norm.

    The self-attention bias is made once per forward and shared by the blocks (the kind by
    `T5Config.self_attention_kind` of the input's device): for SDPA a [1 or batch, heads, L, L] additive mask (the
    decoder's causal mask folded in as -inf, the padding bias added); for flex a `FlexBias`: the [heads, L, L] fp32
    position bias, the padding bias [batch, L] (added in the score_mod, the same large negative as with SDPA;
    pretraining passes none) and, in the decoder, a causal BlockMask. Cross-attention runs SDPA in both cases (no
    position bias; its mask is the padding bias)."""

    def __init__(self, config: T5Config, is_decoder: bool):
        super().__init__()
        layers = config.num_decoder_layers if is_decoder else config.num_layers
        self.relative_attention_bias = RelativePositionBias(config, bidirectional=not is_decoder)
        self.blocks = nn.ModuleList(Block(config, is_decoder) for _ in range(layers))
        self.final_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.is_decoder = is_decoder
        self.config = config

    def self_attention_bias(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, heads, length, length] bias of this stack's self-attention: the position bias, in the decoder with
        the causal mask folded in (-inf above the diagonal)."""
        bias = self.relative_attention_bias(length, length).to(dtype)
        if self.is_decoder:
            causal = torch.ones(length, length, dtype=torch.bool, device=bias.device).tril()
            bias = bias.masked_fill(~causal, float("-inf"))
        return bias

    def flex_self_attention_bias(self, length: int, padding_bias: torch.Tensor | None) -> FlexBias:
        """This stack's self-attention bias for `flex_self_attention` (see the class docstring)."""
        padded = -(-length // FLEX_BLOCK) * FLEX_BLOCK
        extra = padded - length
        position = self.relative_attention_bias(length, length)[0].to(torch.float32)
        position = F.pad(position, (0, extra, 0, extra)) if extra else position.clone()   # a fresh tensor, not a view
        padding = None if padding_bias is None else padding_bias[:, 0, 0, :]
        if padding is not None and extra:
            padding = F.pad(padding, (0, extra))
        mask_mod = flex_mask_mod(length, causal=self.is_decoder) if extra else (
            causal_mask_mod if self.is_decoder else None)
        block_mask = (create_block_mask(mask_mod, None, None, padded, padded, device=position.device)
                      if mask_mod is not None else None)
        return FlexBias(position, padding, block_mask, length)

    def offset_self_attention_bias(self, length: int, padding_bias: torch.Tensor | None) -> OffsetBias:
        """This stack's self-attention bias for the Triton kernels (see `OffsetBias`)."""
        require_kernel_device("attention", self.relative_attention_bias.weight.device.type, instead="sdpa")
        try:
            from pretrain.model.relative_attention import relative_attention   # imports Triton: only when used
        except ImportError as error:
            raise UserError(f"attention='triton' needs the triton package (PyTorch's CUDA builds bring it): {error}")
        padding = None
        if padding_bias is not None:     # clamped: scaled by log2(e) inside the kernel, finfo.min would be -inf
            padding = padding_bias[:, 0, 0, :].float().clamp(min=-1e30)
        return OffsetBias(self.relative_attention_bias(length, length, by_offset=True), padding, self.is_decoder,
                          relative_attention, self.relative_attention_bias.saturate)

    def forward(self, x, padding_bias=None, memory=None, memory_bias=None):
        kind = self.config.self_attention_kind(x.device.type)
        if kind == "flex":
            bias = self.flex_self_attention_bias(x.shape[1], padding_bias)
        elif kind == "triton":
            bias = self.offset_self_attention_bias(x.shape[1], padding_bias)
        else:
            bias = self.self_attention_bias(x.shape[1], x.dtype)
            if padding_bias is not None:
                bias = bias + padding_bias
        x = F.dropout(x, self.config.dropout_rate, self.training)
        for block in self.blocks:
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, bias, memory, memory_bias, use_reentrant=False)
            else:
                x = block(x, bias, memory, memory_bias)
        return F.dropout(self.final_norm(x), self.config.dropout_rate, self.training)


# ------------------------------------------------------------------------------------- memory-lean loss

def cross_entropy_chunk(h, weight, targets, token_weights, num_valid, with_grads: bool):
    """Cross-entropy sum of one chunk of rows h [n, d] against weight [V, d]; with_grads: also the gradient of the
    mean loss (sum / num_valid) w.r.t. the chunk's logits, [n, V] in h's dtype (its two matmuls follow in
    `_chunked_cross_entropy`). Logits exist only for this chunk."""
    logits = at_least_fp32(h @ weight.t())                     # [n, V] fp32: the only big buffer
    log_normaliser = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, targets[:, None]).squeeze(1)
    loss_sum = ((log_normaliser - target_logit) * token_weights).sum()
    if not with_grads:
        return loss_sum, None
    probs = logits.sub_(log_normaliser[:, None]).exp_()        # d(mean CE)/d logits = (softmax - onehot) * w / n
    if torch.compiler.is_compiling():
        # a comparison per element instead of a scatter: Inductor then fuses exp, the subtraction, the scaling and
        # the cast into one pass over the logits, with no fp32 probabilities written and read back (a scatter
        # must run on a materialised tensor); eager keeps the scatter, which needs no [n, V] mask
        probs = probs - (torch.arange(probs.shape[1], device=probs.device)[None, :] == targets[:, None]).to(probs.dtype)
    else:
        probs.scatter_add_(1, targets[:, None], -torch.ones_like(token_weights)[:, None])
    return loss_sum, probs.mul_((token_weights / num_valid)[:, None]).to(h.dtype)


def _fp32_product(grad_logits: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether grad_logits^T @ h can leave the GEMM in fp32 (cuBLAS's out_dtype: 16-bit inputs, fp32 sums kept)."""
    return (grad_logits.is_cuda and grad_logits.dtype == h.dtype and h.dtype in (torch.float16, torch.bfloat16)
            and hasattr(torch.ops.aten.addmm, "dtype"))


def add_weight_grad(total: torch.Tensor | None, grad_logits: torch.Tensor, h: torch.Tensor, dtype: torch.dtype):
    """total + grad_logits^T @ h in `dtype` (the LM head's weight gradient over chunks; total None: the first). On
    CUDA with 16-bit inputs and an fp32 total the GEMM adds its fp32 sums into the total itself (one pass, no
    16-bit product written, rounded and added after); elsewhere the product, in the inputs' dtype, is added."""
    if dtype == torch.float32 and _fp32_product(grad_logits, h):
        if total is None:
            return torch.mm(grad_logits.t(), h, out_dtype=torch.float32)
        return torch.addmm(total, grad_logits.t(), h, out_dtype=torch.float32)
    product = grad_logits.t() @ h
    return product.to(dtype) if total is None else total.add_(product)


def _own_gradient(grad: torch.Tensor) -> torch.Tensor:
    """A copy of a gradient that a CUDA graph's replay wrote (`T5Model.compile_regions`): .grad must not be the
    graph's memory."""
    return grad.clone()


def _chunked_cross_entropy(hidden, weight, targets, valid, chunk_tokens, with_grads, chunk_fn=cross_entropy_chunk):
    """Mean token cross-entropy over rows of hidden [N, d], walked in chunks of `chunk_tokens` rows; with_grads:
    also its gradients w.r.t. hidden and weight [V, d], the latter summed over chunks in fp32 (fp64 for fp64)."""
    loss_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 for fp64 models)
    num_valid = valid.sum().clamp(min=1).to(loss_dtype)         # a tensor: no host sync
    loss_sum = torch.zeros((), dtype=loss_dtype, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grads else None
    grad_weight = None
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, hidden.shape[0])
        chunk_loss, grad_logits = chunk_fn(hidden[start:stop], weight, targets[start:stop],
                                           valid[start:stop].to(loss_dtype), num_valid, with_grads)
        loss_sum = loss_sum + chunk_loss
        if with_grads:
            grad_hidden[start:stop] = grad_logits @ weight
            grad_weight = add_weight_grad(grad_weight, grad_logits, hidden[start:stop], loss_dtype)
    if with_grads and grad_weight is None:                      # no rows
        grad_weight = torch.zeros(weight.shape, dtype=loss_dtype, device=weight.device)
    return loss_sum / num_valid, grad_hidden, grad_weight


class _LMHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of hidden @ weight.T; the backward matmuls run chunk-wise inside forward, so only
    one chunk of logits exists at a time and no logits are kept for backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, valid, chunk_tokens, chunk_fn):
        loss, grad_hidden, grad_weight = _chunked_cross_entropy(hidden, weight, targets, valid, chunk_tokens, True,
                                                                chunk_fn)
        ctx.save_for_backward(grad_hidden, grad_weight)         # fp32: scaled, then cast once in backward
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        scaled_weight = torch.empty(grad_weight.shape, dtype=ctx.weight_dtype, device=grad_weight.device)
        torch.mul(grad_weight, grad_loss.to(grad_weight.dtype), out=scaled_weight)   # one pass: scale and cast
        return grad_hidden * grad_loss.to(grad_hidden.dtype), scaled_weight, None, None, None, None


class LMHead(nn.Module):
    """Untied (by default) vocabulary projection; `loss` is the chunked, memory-lean cross-entropy."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.chunk_tokens = config.loss_chunk_tokens
        self.pad_token_id = config.pad_token_id
        self.chunk_fn = cross_entropy_chunk   # T5Model.compile_regions() swaps in a compiled copy

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return hidden @ self.weight.t()
        hidden = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1)
        valid = (labels != self.pad_token_id) & (labels >= 0)  # pad (and HF's -100) positions are ignored
        targets = labels.masked_fill(~valid, 0)
        if torch.is_grad_enabled() and (hidden.requires_grad or self.weight.requires_grad):
            return _LMHeadLoss.apply(hidden, self.weight, targets, valid, self.chunk_tokens, self.chunk_fn)
        return _chunked_cross_entropy(hidden, self.weight, targets, valid, self.chunk_tokens, False,
                                      self.chunk_fn)[0]


# ----------------------------------------------------------------------------------------------- model

class T5Model(nn.Module):
    """Encoder-decoder: `model(input_ids, labels=...)` -> fp32 mean loss; `model(input_ids,
    decoder_input_ids=...)` -> logits [B, T, vocab]."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = Stack(config, is_decoder=False)
        self.decoder = Stack(config, is_decoder=True)
        self.lm_head = LMHead(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs: labels shifted right, starting with decoder_start_token_id (HF's -100 -> pad)."""
        shifted = labels.new_full(labels.shape, self.config.decoder_start_token_id)
        shifted[:, 1:] = labels[:, :-1]
        return shifted.masked_fill(shifted < 0, self.config.pad_token_id)

    def forward(self, input_ids, labels=None, decoder_input_ids=None, attention_mask=None):
        """`attention_mask` [B, L_in] (1 = real token) is optional: span-corruption inputs have no padding."""
        if labels is None and decoder_input_ids is None:
            raise ValueError("T5Model.forward needs labels (-> loss) or decoder_input_ids (-> logits)")
        if decoder_input_ids is None:
            decoder_input_ids = self.shift_right(labels)
        padding_bias = None
        if attention_mask is not None:  # large negative (not -inf) so that an all-pad row stays finite
            dtype = self.shared.weight.dtype
            padding_bias = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        memory = self.encoder(self.shared(input_ids), padding_bias)
        hidden = self.decoder(self.shared(decoder_input_ids), None, memory, padding_bias)
        if self.config.tie_word_embeddings:
            hidden = hidden * self.config.d_model ** -0.5
        return self.lm_head(hidden, labels)

    def compile_regions(self, backend: str = "inductor", mode: str | None = None) -> "T5Model":
        """torch.compile each block's forward (one static graph per stack kind, shared by its blocks) and the loss
        chunk; compiles in seconds where compiling the whole model takes minutes. Returns self. (`backend`: tests
        run the compiled graphs' autograd on CPU with "aot_eager", where Inductor has no FlexAttention backward.)

        The forward is compiled, not the module call: module hooks stay outside the graphs. ZeRO 3 gathers a block's
        parameters in such hooks (a block is its unit of gathering, see `zero3.build_partitioned`), so the compiled
        forward runs on whole weights and the same graphs serve every stage.

        `mode`: torch.compile's mode for the blocks ("reduce-overhead": Inductor replays each block's forward and
        backward as CUDA graphs, one launch where the host launched every kernel); the loss chunk keeps the default.
        A replayed backward writes the weights' gradients into the graphs' memory, which autograd would take as
        .grad itself, for the next replay to overwrite (pytorch/pytorch#169545: with gradient accumulation, or a
        .grad zeroed in place, the sum silently loses micro batches): each block weight's gradient is copied out
        as it arrives (one copy of the blocks' gradients a micro batch)."""
        for stack in (self.encoder, self.decoder):
            for block in stack.blocks:
                block.forward = torch.compile(block.forward, backend=backend, dynamic=False, mode=mode)
                if mode == "reduce-overhead":
                    for param in block.parameters():
                        if param.requires_grad:
                            param.register_hook(_own_gradient)
        self.lm_head.chunk_fn = torch.compile(cross_entropy_chunk, backend=backend, dynamic=False)
        return self

    def init_plan(self):
        """(module, fill) pairs in the fixed order of the initialisation draws; `fill(module, normal)` writes the
        module's own parameters, drawing through `normal(tensor, std)`. The one definition of the init, used by
        the plain build (`init_weights`) and the ZeRO-3 partitioned build (`zero3.build_partitioned`).

        Embeddings N(0, 1); q N(0, (d_model*d_kv)^-1/2); k, v N(0, d_model^-1/2); o N(0, (heads*d_kv)^-1/2);
        wi N(0, d_model^-1/2); wo N(0, d_ff^-1/2); position bias N(0, d_model^-1/2); norms 1. The untied LM
        head is N(0, d_model^-1/2) (Mesh-TF's fan-in init of the logits layer; HF uses N(0, 1), which makes
        the initial loss far above ln(vocab)), so a fresh model's loss starts near ln(vocab_size).
        """
        c = self.config

        def attention(module, normal):
            q = module.q.weight if module.cross else module.qkv.weight[: c.inner_dim]
            kv = module.kv.weight if module.cross else module.qkv.weight[c.inner_dim:]
            normal(q, (c.d_model * c.d_kv) ** -0.5)
            normal(kv, c.d_model ** -0.5)
            normal(module.o.weight, c.inner_dim ** -0.5)

        def feed_forward(module, normal):
            normal(module.wi.weight, c.d_model ** -0.5)
            normal(module.wo.weight, c.d_ff ** -0.5)

        yield self.shared, lambda module, normal: normal(module.weight, 1.0)
        if not c.tie_word_embeddings:
            yield self.lm_head, lambda module, normal: normal(module.weight, c.d_model ** -0.5)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                yield module, lambda module, normal: module.weight.fill_(1.0)
            elif isinstance(module, RelativePositionBias):
                yield module, lambda module, normal: normal(module.weight, c.d_model ** -0.5)
            elif isinstance(module, Attention):
                yield module, attention
            elif isinstance(module, GatedGeluFFN):
                yield module, feed_forward

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """T5 / Mesh-TF initialisation (see `init_plan`), every draw from `generator` in a fixed module order."""
        normal = seeded_normal(generator)
        for module, fill in self.init_plan():
            fill(module, normal)


def seeded_normal(generator: torch.Generator):
    """`normal(tensor, std)`: fill `tensor` with N(0, std) drawn in fp32 on the host from `generator` (in place
    for a contiguous fp32 host tensor, else into a temporary that is cast and copied in): the same numbers
    whatever the tensor's dtype or device."""
    def normal(tensor: torch.Tensor, std: float) -> None:
        if tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous():
            tensor.normal_(0.0, std, generator=generator)      # the same draws, without a temporary
        else:
            tensor.copy_(torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))
    return normal


def resolve_config(preset_or_config: str | T5Config, **overrides) -> T5Config:
    """The T5Config of a preset name (or YAML path) or of a given T5Config, with `overrides` applied."""
    if isinstance(preset_or_config, T5Config):
        return dataclasses.replace(preset_or_config, **overrides) if overrides else preset_or_config
    return load_config(preset_or_config, **overrides)


def build(preset_or_config: str | T5Config, seed: int = 0, **overrides) -> T5Model:
    """A freshly initialised model from a preset name (or YAML path) or a T5Config; init seeded by `seed`."""
    model = T5Model(resolve_config(preset_or_config, **overrides))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model
