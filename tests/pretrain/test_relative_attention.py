"""`attention="triton"`: the self-attentions run our Triton kernels (pretrain/model/relative_attention.py), the
position bias read per key - query offset and its gradient summed along the diagonals of each score tile.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets):
the same kernel code, each program executed in numpy, so what is checked is their indexing, masking, online softmax,
the diagonal sums and their fold, against float64 references. Where CUDA exists, the compiled kernels are checked
against SDPA in fp32 and bf16 at the pretraining lengths (512 / 114).

    pytest tests/pretrain/test_relative_attention.py     # ~30 s on 2 CPU cores
"""

import pytest
import torch

from tests.pretrain.triton_kernels import DEVICE, relative_error, require_kernels

require_kernels()

import pretrain.model.t5 as model_module  # noqa: E402
from pipeline.common import UserError  # noqa: E402
from pretrain.model.relative_attention import relative_attention  # noqa: E402
from pretrain.model.t5 import build, load_config  # noqa: E402
from tests.pretrain.test_flex_attention import assert_same_outputs, forward_backward, no_tf32  # noqa: E402,F401


def reference(qkv, bias_by_offset, num_heads, causal, key_bias=None):
    """The same attention written out densely (any dtype; the tests run it in float64)."""
    batch, length, width = qkv.shape
    q, k, v = qkv.view(batch, length, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)
    i = torch.arange(length, device=qkv.device)[:, None]
    j = torch.arange(length, device=qkv.device)[None, :]
    scores = q @ k.transpose(-1, -2) + bias_by_offset[:, j - i + length - 1]
    if key_bias is not None:
        scores = scores + key_bias[:, None, None, :]
    if causal:
        scores = scores.masked_fill(j > i, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)


def run_both(batch, length, heads, head_dim, causal, with_key_bias, seed, dtype=torch.float32):
    """(ours, reference) as (out, d qkv, d bias) for random inputs: the reference in float64 on the same values."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3 * heads * head_dim, generator=generator, dtype=torch.float64)
    bias = torch.randn(heads, 2 * length - 1, generator=generator, dtype=torch.float64)
    key_bias = torch.randn(batch, length, generator=generator, dtype=torch.float64) * 3 if with_key_bias else None
    grad_out = torch.randn(batch, length, heads * head_dim, generator=generator, dtype=torch.float64)
    ours_qkv = qkv.to(DEVICE, dtype).requires_grad_()
    ours_bias = bias.to(DEVICE, torch.float32).requires_grad_()
    out = relative_attention(ours_qkv, ours_bias, heads, causal,
                             None if key_bias is None else key_bias.to(DEVICE, torch.float32))
    out.backward(grad_out.to(DEVICE, dtype))
    want_qkv, want_bias = qkv.to(DEVICE).requires_grad_(), bias.to(DEVICE).requires_grad_()
    want = reference(want_qkv, want_bias, heads, causal, None if key_bias is None else key_bias.to(DEVICE))
    want.backward(grad_out.to(DEVICE))
    results = [(out.detach(), ours_qkv.grad, ours_bias.grad), (want.detach(), want_qkv.grad, want_bias.grad)]
    return results


@pytest.mark.parametrize("batch, length, heads, head_dim, causal, with_key_bias", [
    (2, 20, 3, 16, False, False),     # one block, mostly masked
    (2, 9, 2, 16, True, False),       # the decoder: causal
    (1, 130, 2, 16, False, True),     # three key blocks, a partial one; a padding bias
    (2, 70, 2, 32, True, True),       # causal across blocks
    (2, 128, 2, 16, False, True),     # a whole number of every kernel's blocks: no masks (EVEN)
    (1, 128, 2, 16, True, False),     # the same, causal
])
def test_forward_and_every_gradient_equal_a_float64_reference(batch, length, heads, head_dim, causal, with_key_bias):
    (out, dqkv, dbias), (want_out, want_dqkv, want_dbias) = run_both(batch, length, heads, head_dim, causal,
                                                                     with_key_bias, seed=length)
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all() and torch.isfinite(dbias).all()
    assert relative_error(out, want_out) < 1e-5
    assert relative_error(dqkv, want_dqkv) < 1e-5
    assert relative_error(dbias, want_dbias) < 1e-5


@pytest.mark.parametrize("batch, length, causal, saturate", [
    (1, 300, False, 70),     # 5 key blocks, a partial one: tiles 3+ blocks off the diagonal lie in a saturated range
    (2, 256, False, 6),      # whole blocks (EVEN); 2+ blocks off
    (1, 200, True, 12),      # causal: only the range below
])
def test_saturated_ranges_of_the_bias_gradient_are_exact_as_sums(batch, length, causal, saturate):
    """With `saturate`, tiles far off the diagonal are summed whole: the bias gradient equals the float64 reference
    at every offset inside (-saturate, saturate) and as a sum over each saturated range, which is what the bucket
    table receives (the range is one bucket); the outputs and q|k|v gradients are unchanged."""
    generator = torch.Generator().manual_seed(length)
    heads, head_dim = 2, 16
    qkv = torch.randn(batch, length, 3 * heads * head_dim, generator=generator, dtype=torch.float64)
    offsets = torch.arange(1 - length, length)
    bias = torch.randn(heads, 2 * length - 1, generator=generator, dtype=torch.float64)
    bias[:, offsets >= saturate] = bias[:, [length - 1 + saturate]]       # one value per saturated range
    bias[:, offsets <= -saturate] = bias[:, [length - 1 - saturate]]
    grad_out = torch.randn(batch, length, heads * head_dim, generator=generator, dtype=torch.float64)
    ours_qkv, ours_bias = qkv.float().to(DEVICE).requires_grad_(), bias.float().to(DEVICE).requires_grad_()
    relative_attention(ours_qkv, ours_bias, heads, causal, saturate=saturate).backward(grad_out.float().to(DEVICE))
    want_qkv, want_bias = qkv.to(DEVICE).requires_grad_(), bias.to(DEVICE).requires_grad_()
    reference(want_qkv, want_bias, heads, causal).backward(grad_out.to(DEVICE))
    got, want = ours_bias.grad.double().cpu(), want_bias.grad.cpu()
    assert relative_error(ours_qkv.grad, want_qkv.grad) < 1e-5
    inside = offsets.abs() < saturate
    scale = want.abs().max()
    assert (got[:, inside] - want[:, inside]).abs().max() < 1e-5 * scale
    for side in (offsets >= saturate, offsets <= -saturate):
        assert (got[:, side].sum(1) - want[:, side].sum(1)).abs().max() < 1e-5 * scale
    # the far tiles were summed whole: per offset, the saturated ranges are not the reference's
    assert not torch.allclose(got[:, offsets <= -saturate], want[:, offsets <= -saturate], atol=1e-3 * scale)


@pytest.mark.parametrize("batch, length, causal, saturate", [
    (1, 300, False, 70),     # a partial block; far tiles on both sides in both passes' blocks
    (2, 256, False, 6),      # whole blocks (EVEN)
    (1, 300, True, 12),      # causal: only the range below
])
@pytest.mark.parametrize("bias_grad", [True, False])
def test_the_backward_gives_far_tiles_their_ranges_one_bias_value(batch, length, causal, saturate, bias_grad):
    """With `saturate`, both backward passes give a tile whose every offset lies in a saturated range that range's
    bias at its first offset (one value, no per-score load). Handed a bias whose ranges hold one value but for the
    offsets so far out that only such tiles hold them, the backward gives the q|k|v gradient of the bias without
    those values, as the per-score path (saturate=0) does for that bias, and not what the per-score path gives for
    the bias handed: the far path ran in the key-block pass (with and without the bias gradient) and the query-block
    pass."""
    from pretrain.model import relative_attention as kernels
    span = max(kernels.BACKWARD_Q["BLOCK_M"] + kernels.BACKWARD_Q["BLOCK_N"], 2 * kernels.BACKWARD_KV["BLOCK"])
    generator = torch.Generator().manual_seed(length + saturate)
    heads, head_dim = 2, 16
    qkv = torch.randn(batch, length, 3 * heads * head_dim, generator=generator).to(DEVICE)
    offsets = torch.arange(1 - length, length)
    flat = torch.randn(heads, 2 * length - 1, generator=generator)
    flat[:, offsets >= saturate] = flat[:, [length - 1 + saturate]]       # one value per saturated range
    flat[:, offsets <= -saturate] = flat[:, [length - 1 - saturate]]
    outermost = offsets.abs() >= saturate + span
    assert outermost[offsets < 0].any() and (causal or outermost[offsets > 0].any())
    bias = flat.clone()
    bias[:, outermost] += 4.0 * torch.randn(heads, int(outermost.sum()), generator=generator)
    flat, bias = flat.to(DEVICE), bias.to(DEVICE)
    dout = torch.randn(batch, length, heads * head_dim, generator=generator).to(DEVICE)
    out, lse = torch.ops.t5zero.relative_attention_forward(qkv, flat, None, heads, causal, 0)

    def dqkv(given, far):
        return torch.ops.t5zero.relative_attention_backward(dout, qkv, out, lse, given, None, heads, causal,
                                                            bias_grad, saturate if far else 0)[0]

    want = dqkv(flat, far=False)
    assert relative_error(dqkv(bias, far=True), want) < 1e-6
    assert relative_error(dqkv(bias, far=False), want) > 1e-3


def test_the_saturating_offset_is_where_t5s_buckets_stop_changing():
    """mT5's buckets (32, max distance 128): the encoder's last bucket per side from offset 91 on, the decoder's
    from 113; the bias of the stacks carries it to the kernels."""
    assert model_module.saturating_offset(True, 32, 128) == 91
    assert model_module.saturating_offset(False, 32, 128) == 113
    offsets = torch.arange(-300, 301)
    for bidirectional, saturate in ((True, 91), (False, 113)):
        buckets = model_module.relative_position_bucket(offsets, bidirectional, 32, 128)
        assert len(set(buckets[offsets >= saturate].tolist())) == 1
        assert len(set(buckets[offsets <= -saturate].tolist())) == 1
        assert len(set(buckets[offsets <= 1 - saturate].tolist())) == 2          # one offset earlier, two buckets
    model = build("t5-tiny", seed=0, attention="triton")
    assert model.encoder.relative_attention_bias.saturate == 91


def test_the_bias_gradient_is_the_same_bit_for_bit_from_run_to_run():
    """Plain stores of per-tile diagonal sums and one fixed-order reduction, no atomics: a second backward gives the
    same bits."""
    grads = [run_both(2, 130, 2, 16, False, False, seed=7)[0] for _ in range(2)]
    for first, second in zip(grads[0], grads[1]):
        assert torch.equal(first, second)


@pytest.mark.parametrize("causal", [False, True])
def test_the_custom_ops_fake_kernels_and_autograd_agree_with_the_real_ones(causal):
    """torch.library.opcheck: shapes, strides and dtypes of the fake (compile-time) outputs are the real ones', and
    the autograd registration holds; a wrong stride fails here instead of inside Inductor's compiled graph."""
    generator = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 70, 3 * 2 * 16, generator=generator).to(DEVICE).requires_grad_()
    bias = torch.randn(2, 139, generator=generator).to(DEVICE).requires_grad_()
    forward = torch.ops.t5zero.relative_attention_forward.default
    torch.library.opcheck(forward, (qkv, bias, None, 2, causal, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    out, lse = forward(qkv.detach(), bias.detach(), None, 2, causal, 0)
    torch.library.opcheck(torch.ops.t5zero.relative_attention_backward.default,
                          (torch.randn_like(out), qkv.detach(), out, lse, bias.detach(), None, 2, causal, True, 30),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("mode, padded", [("eager", True), ("compile-regions", False), ("checkpointed", True)])
def test_model_with_triton_attention_equals_sdpa(monkeypatch, no_tf32, mode, padded):
    """t5-tiny in fp32: loss, logits and every parameter's gradient as the SDPA model's, 1e-5 of each tensor's
    scale. compile-regions: the blocks compiled (aot_eager on CPU), the kernels' custom ops inside the graphs."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(3, 1000, (3, 20), generator=generator).to(DEVICE)
    labels = torch.randint(3, 1000, (3, 9), generator=generator).to(DEVICE)
    labels[1, -2:] = 0
    attention_mask = None
    if padded:
        attention_mask = torch.ones_like(inputs)
        attention_mask[0, -6:] = 0
        attention_mask[2, -1:] = 0
    checkpointed = mode == "checkpointed"
    sdpa = build("t5-tiny", seed=1, attention="sdpa", activation_checkpointing=checkpointed).to(DEVICE).train()
    ours = build("t5-tiny", seed=1, attention="triton", activation_checkpointing=checkpointed).to(DEVICE).train()
    calls = []
    real = model_module.Stack.offset_self_attention_bias
    monkeypatch.setattr(model_module.Stack, "offset_self_attention_bias",
                        lambda *args: calls.append(1) or real(*args))
    if mode == "compile-regions":
        ours.compile_regions(backend="aot_eager" if DEVICE == "cpu" else "inductor")
    want = forward_backward(sdpa, inputs, labels, attention_mask)
    got = forward_backward(ours, inputs, labels, attention_mask)
    assert len(calls) == 4                       # encoder and decoder, loss and logits forwards: never SDPA
    assert_same_outputs(got, want, 1e-5 if DEVICE == "cpu" else 1e-4, loss_rtol=1e-5)


def test_model_with_saturated_bias_tiles_equals_sdpa(no_tf32):
    """t5-tiny with 8 buckets up to distance 16 (saturated from offset 6 in the encoder, 12 in the decoder) at lengths
    of 200 and 150: tiles two blocks off the diagonal are summed whole, and every gradient (the bucket tables'
    too) is still the SDPA model's."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(3, 1000, (2, 200), generator=generator).to(DEVICE)
    labels = torch.randint(3, 1000, (2, 150), generator=generator).to(DEVICE)
    buckets = dict(relative_attention_num_buckets=8, relative_attention_max_distance=16)
    sdpa = build("t5-tiny", seed=1, attention="sdpa", **buckets).to(DEVICE).train()
    ours = build("t5-tiny", seed=1, attention="triton", **buckets).to(DEVICE).train()
    assert (ours.encoder.relative_attention_bias.saturate, ours.decoder.relative_attention_bias.saturate) == (6, 12)
    want = forward_backward(sdpa, inputs, labels, None)
    got = forward_backward(ours, inputs, labels, None)
    assert_same_outputs(got, want, 1e-5 if DEVICE == "cpu" else 1e-4, loss_rtol=1e-5)


def test_triton_attention_config_errors_are_one_clear_line():
    with pytest.raises(UserError, match="no dropout of attention probabilities"):
        load_config("t5-tiny", attention="triton", dropout_rate=0.1)
    assert load_config("t5-tiny", attention="triton").self_attention_kind("cpu") == "triton"


def test_triton_attention_off_cuda_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = build("t5-tiny", seed=0, attention="triton")
    if DEVICE == "cuda":
        pytest.skip("the refusal is for tensors off CUDA")
    with pytest.raises(UserError, match="runs on CUDA devices"):
        model(torch.randint(3, 100, (1, 8)), labels=torch.randint(3, 100, (1, 4)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels)")
@pytest.mark.parametrize("causal, length", [(False, 512), (True, 114)])
def test_compiled_kernels_in_bf16_at_the_pretraining_lengths(causal, length):
    """bf16 inputs, the bias in fp32: within bf16's error of the float64 reference (FlashAttention's own error is
    of this size, METHOD.md: 1e-3 to 1e-2)."""
    (out, dqkv, dbias), (want_out, want_dqkv, want_dbias) = run_both(4, length, 8, 64, causal, False, seed=3,
                                                                     dtype=torch.bfloat16)
    assert relative_error(out, want_out) < 1e-2
    assert relative_error(dqkv, want_dqkv) < 2e-2
    assert relative_error(dbias, want_dbias) < 2e-2
