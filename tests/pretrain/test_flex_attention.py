"""`attention="flex"`: the self-attentions run FlexAttention with the position bias added in the score_mod. It must
be the SDPA model exactly (fp32, 1e-5 of each tensor's scale): logits, loss and every parameter's gradient (encoder
bidirectional, decoder causal, with and without a padding mask, with activation checkpointing), eager and compiled.

PyTorch refuses FlexAttention's backward on CPU (a check in front of the op: Inductor's CPU kernel has no
backward). The eager op is PyTorch's dense reference, which has one, so the CPU gradient tests lift that check
(`cpu_flex_backward`) and run the compiled paths' autograd with the aot_eager backend (AOTAutograd without
Inductor). They test our score_mod, block mask and the gradient path to the bucket tables; Inductor's kernels
are tested forward-only on CPU and, where CUDA exists, in full by `test_compiled_flex_training_step_on_cuda`.

    pytest tests/pretrain/test_flex_attention.py   # ~12 s on 2 CPU cores; on a GPU machine also the CUDA test
"""

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

import pretrain.model.t5 as model_module
from pipeline.common import UserError
from pretrain.model.t5 import build, load_config

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def no_tf32():
    """CUDA matmuls in full fp32 for the test. (torch.backends.cuda.matmul's flags are no plain attributes: pytest's
    monkeypatch fails to undo them, found on an H200.)"""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def random_batch(seed, batch=3, input_length=20, target_length=9, high=1000):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(3, high, (batch, input_length), generator=generator),
            torch.randint(3, high, (batch, target_length), generator=generator))


def padding_mask(inputs):
    mask = torch.ones_like(inputs)
    mask[0, -6:] = 0     # rows padded by different amounts; one unpadded
    mask[2, -1:] = 0
    return mask


def assert_close_relative(got, want, tolerance, name=""):
    """max |got - want| <= tolerance * max |want| (a tolerance relative to the tensor's scale)."""
    error = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert error <= tolerance * scale, f"{name}: max error {error:.3g} against scale {scale:.3g}"


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """Let the eager (dense reference) FlexAttention run its backward on CPU; see the module docstring."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)


def counting(attend, calls):
    """`attend`, recording each call's block mask in `calls` (so that a parity test cannot pass by running SDPA)."""
    def counted(*args, **kwargs):
        calls.append(kwargs.get("block_mask"))
        return attend(*args, **kwargs)
    return counted


def forward_backward(model, inputs, labels, attention_mask):
    """(loss, logits, {name: grad}) of one loss forward + backward and one logits forward."""
    loss = model(inputs, labels=labels, attention_mask=attention_mask)
    loss.backward()
    with torch.no_grad():
        logits = model(inputs, decoder_input_ids=model.shift_right(labels), attention_mask=attention_mask)
    return loss.detach(), logits, {name: p.grad for name, p in model.named_parameters()}


def assert_same_outputs(got, want, tolerance, loss_rtol):
    """`forward_backward`'s (loss, logits, grads) of one model against another's: the loss to loss_rtol, the logits
    and every parameter's gradient to `tolerance` of the tensor's scale."""
    torch.testing.assert_close(got[0], want[0], rtol=loss_rtol, atol=0)
    assert_close_relative(got[1], want[1], tolerance, "logits")
    for name, grad in want[2].items():
        assert got[2][name] is not None, f"{name}: no gradient"
        assert_close_relative(got[2][name], grad, tolerance, name)


@pytest.mark.parametrize("capability, on_cuda", [((9, 0), "triton"), ((10, 0), "triton"), ((8, 0), "flex")])
def test_attention_by_default_is_triton_on_hopper_flex_on_older_gpus_and_sdpa_elsewhere(monkeypatch, capability,
                                                                                        on_cuda):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    model_module.triton_attention_measured.cache_clear()
    try:
        config = load_config("mt5-large")
        assert config.attention == "auto"
        assert (config.self_attention_kind("cuda"), config.self_attention_kind("cpu")) == (on_cuda, "sdpa")
        dropout = load_config("mt5-large", dropout_rate=0.1)     # neither kernel has dropout: sdpa even on CUDA
        assert dropout.self_attention_kind("cuda") == "sdpa"
    finally:
        model_module.triton_attention_measured.cache_clear()


def test_an_explicit_attention_holds_on_every_device():
    for kind in ("sdpa", "flex"):
        chosen = build("t5-tiny", attention=kind).config
        assert (chosen.self_attention_kind("cuda"), chosen.self_attention_kind("cpu")) == (kind, kind)


def test_auto_on_cpu_builds_the_sdpa_bias(monkeypatch):
    """The default model on the CPU trains through SDPA (no FlexAttention backward there): a flex bias is never
    made, and its loss and gradients are those of attention="sdpa"."""
    monkeypatch.setattr(model_module.Stack, "flex_self_attention_bias",
                        lambda *args: pytest.fail("flex bias built on the CPU under attention='auto'"))
    inputs, labels = random_batch(4, batch=2)
    auto, sdpa = build("t5-tiny", seed=3), build("t5-tiny", seed=3, attention="sdpa")
    got, want = forward_backward(auto, inputs, labels, None), forward_backward(sdpa, inputs, labels, None)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=0, atol=0)


@pytest.mark.parametrize("overrides, message", [
    ({"attention": "flash"}, "attention must be one of"),
    ({"attention": "flex", "dropout_rate": 0.1}, "no dropout of attention probabilities"),
])
def test_bad_attention_configs_raise_one_clear_user_error(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config("t5-tiny", **overrides)


def uncompiled_off_cpu(monkeypatch, calls):
    """An uncompiled model as it runs off the CPU: flex_attention through `compiled_flex_attention()`, here compiled
    with aot_eager (the same autograd graph as Inductor's, without its GPU-only backward kernel)."""
    counted = counting(torch.compile(flex_module.flex_attention, backend="aot_eager", dynamic=False), calls)
    monkeypatch.setattr(model_module, "EAGER_FLEX_DEVICES", set())
    monkeypatch.setattr(model_module, "compiled_flex_attention", lambda: counted)


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding-mask"])
@pytest.mark.parametrize("mode", ["eager", "compile-regions", "uncompiled-off-cpu"])
def test_flex_logits_loss_and_every_gradient_equal_sdpa(cpu_flex_backward, monkeypatch, mode, padded):
    """eager: PyTorch's dense reference; compile-regions: `compile_regions(backend="aot_eager")`, the compiled
    blocks' autograd; uncompiled-off-cpu: see `uncompiled_off_cpu`."""
    inputs, labels = random_batch(0)
    labels[1, -2:] = 0   # padded targets are ignored by the loss, as with SDPA
    attention_mask = padding_mask(inputs) if padded else None
    sdpa, flex = build("t5-tiny", seed=1), build("t5-tiny", seed=1, attention="flex")
    want = forward_backward(sdpa, inputs, labels, attention_mask)
    calls = []
    if mode == "eager":
        monkeypatch.setattr(model_module, "flex_attention", counting(flex_module.flex_attention, calls))
    elif mode == "uncompiled-off-cpu":
        uncompiled_off_cpu(monkeypatch, calls)
    else:
        flex.compile_regions(backend="aot_eager")
    got = forward_backward(flex, inputs, labels, attention_mask)
    if mode != "compile-regions":  # 2 encoder + 2 decoder self-attentions, twice; 20 and 9 are padded to 128, so
        assert len(calls) == 8 and all(mask is not None for mask in calls)   # every one masks the padded keys
    assert_same_outputs(got, want, 1e-5, loss_rtol=1e-6)


def test_flex_runs_at_lengths_padded_to_its_block():
    """The decoder's 114 targets run as 128 (PyTorch issue 153799: NaN in the bf16 backward at 114); 512 inputs stay
    512 with no block mask in the encoder; the padded keys are masked, the padded queries dropped."""
    model = build("t5-tiny", seed=0, attention="flex")
    decoder = model_module.Stack.flex_self_attention_bias(model.decoder, 114, None)
    assert decoder.position.shape[-2:] == (128, 128) and decoder.length == 114
    assert decoder.block_mask.shape[-2:] == (128, 128)
    dense = decoder.block_mask.to_dense()[0, 0]            # [q blocks, kv blocks]: one 128-block, partly valid
    assert dense.tolist() == [[1]]
    encoder = model_module.Stack.flex_self_attention_bias(model.encoder, 512, None)
    assert encoder.position.shape[-2:] == (512, 512) and encoder.block_mask is None
    q = k = v = torch.randn(2, model.config.num_heads, 114, model.config.d_kv)
    out = model_module.flex_self_attention(q, k, v, decoder)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("mode", ["compile-regions", "uncompiled-off-cpu"])
def test_flex_with_activation_checkpointing_gives_the_sdpa_gradients(cpu_flex_backward, monkeypatch, mode):
    """Checkpointed blocks recompute the flex forward in backward. Only compiled paths: PyTorch's eager reference
    gets the captured bias's gradient wrong under checkpointing, which is why off the CPU flex always runs compiled."""
    inputs, labels = random_batch(1)
    sdpa = build("t5-tiny", seed=0, activation_checkpointing=True)
    flex = build("t5-tiny", seed=0, attention="flex", activation_checkpointing=True)
    if mode == "compile-regions":
        flex.compile_regions(backend="aot_eager")
    else:
        uncompiled_off_cpu(monkeypatch, [])
    for model in (sdpa, flex):
        model.train()
        model(inputs, labels=labels).backward()
    for (name, p), q in zip(sdpa.named_parameters(), flex.parameters()):
        assert q.grad is not None, f"{name}: no gradient"
        assert_close_relative(q.grad, p.grad, 1e-5, name)


def test_compiled_flex_logits_equal_sdpa_and_do_not_recompile():
    """compile_regions() with flex on CPU: forward only (no compiled CPU backward exists); ~10 s on 2 cores."""
    inputs, labels = random_batch(2)
    sdpa = build("t5-tiny", seed=0)
    flex = build("t5-tiny", seed=0, attention="flex").compile_regions()
    decoder_input_ids = sdpa.shift_right(labels)
    with torch.no_grad():
        want = sdpa(inputs, decoder_input_ids=decoder_input_ids)
        assert_close_relative(flex(inputs, decoder_input_ids=decoder_input_ids), want, 1e-5, "logits")
        other_inputs, _ = random_batch(3)   # new data and new bias / block mask objects: the same graphs
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert_close_relative(flex(other_inputs, decoder_input_ids=decoder_input_ids),
                                  sdpa(other_inputs, decoder_input_ids=decoder_input_ids), 1e-5, "logits")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled Triton FlexAttention kernels)")
@pytest.mark.parametrize("mode", ["compile-regions", "uncompiled-checkpointed"])
def test_compiled_flex_training_step_on_cuda(no_tf32, mode):
    """The GPU path: Inductor's flex kernels (forward, and backward with the bias gradient by atomic adds) against
    SDPA, fp32 without TF32, t5-tiny at the benchmark's lengths (512 / 114: 114 is not a multiple of the block
    size). compile-regions: the blocks compiled; uncompiled-checkpointed: only flex_attention compiled
    (`compiled_flex_attention`), under activation checkpointing."""
    inputs, labels = (t.cuda() for t in random_batch(4, batch=4, input_length=512, target_length=114))
    checkpointed = mode == "uncompiled-checkpointed"
    sdpa = build("t5-tiny", seed=0, attention="sdpa", activation_checkpointing=checkpointed).cuda().train()
    flex = build("t5-tiny", seed=0, attention="flex", activation_checkpointing=checkpointed).cuda().train()
    if mode == "compile-regions":
        flex.compile_regions()
    assert_same_outputs(forward_backward(flex, inputs, labels, None), forward_backward(sdpa, inputs, labels, None),
                        1e-4, loss_rtol=1e-4)
