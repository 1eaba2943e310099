"""FP8 GEMMs for the blocks' linears (pretrain/model/fp8.py): our cast kernels, the op's forward and backward, and the
model converted.

Without a GPU the cast kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; torch rounds
their output to FP8 there, since the interpreter's conversion is wrong) and torch._scaled_mm on the CPU. Where CUDA
exists, the compiled kernels, whose own rounding must then equal torch's.

    pytest tests/pretrain/test_fp8.py
"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.pretrain.triton_kernels import DEVICE, relative_error, require_kernels

require_kernels()

from launching import pretrain  # noqa: E402
from pipeline.common import REPO_ROOT, UserError  # noqa: E402
from pretrain.model import fp8  # noqa: E402
from pretrain.model.gated_gelu import gated_gelu  # noqa: E402
from pretrain.model.t5 import GatedGeluFFN, build, fp8_bf16_parts, load_config  # noqa: E402

SMALLEST_NORMAL = {fp8.FORWARD_DTYPE: 2.0 ** -6, fp8.GRAD_DTYPE: 2.0 ** -14}


def torch_cast(x, dtype):
    """The tensorwise cast by torch's own conversion: (x * max / amax saturated, as dtype; amax / max)."""
    top = fp8.FP8_MAX[dtype]
    amax = x.detach().abs().max().float().clamp(min=1e-12)
    scale = top / amax
    return (x.float() * scale).clamp(-top, top).to(dtype), 1.0 / scale


@pytest.mark.parametrize("dtype", [fp8.FORWARD_DTYPE, fp8.GRAD_DTYPE])
@pytest.mark.parametrize("shape", [(96, 80), (37, 144), (5000, 16), (48, 64)])   # ragged tiles, many blocks
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])   # fp32: weights under autocast
def test_the_cast_is_torchs_conversion_both_ways_round(dtype, shape, source):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) * 3).to(source).to(DEVICE)
    x[1, 2] = -50.0                                                   # the amax, negative
    x[0, :4] = torch.tensor([1e-3, -5e-4, 3e-8, -1e-8])              # subnormal once scaled (e4m3, e5m2)
    x8, x8_t, inverse = fp8._cast(x, fp8.amax(x), dtype)
    want, want_inverse = torch_cast(x, dtype)
    assert x8.dtype == x8_t.dtype == dtype and x8.shape == shape and x8_t.shape == shape[::-1]
    assert inverse.shape == (1,)          # not 0-d: Inductor makes a kernel of a 0-d empty (fp8._cast)
    assert torch.equal(x8_t.t().float(), x8.float())
    assert torch.allclose(inverse.cpu(), want_inverse.cpu(), rtol=1e-6)
    got, want = x8.float().cpu(), want.float().cpu()
    assert torch.equal(got, want)
    assert ((want.abs() < SMALLEST_NORMAL[dtype]) & (want != 0)).any()       # subnormals among them
    assert got.abs().max() == fp8.FP8_MAX[dtype]                     # the amax maps onto the format's largest value


def test_an_all_zero_tensor_casts_to_zeros():
    zeros = torch.zeros(32, 32, device=DEVICE)
    x8, _, inverse = fp8._cast(zeros, fp8.amax(zeros), fp8.FORWARD_DTYPE)
    assert not x8.float().any() and torch.isfinite(inverse).all()


def emulated(x, weight, dy):
    """y, dx, dw by the same casts done with torch, and float32 products of the dequantised values."""
    x8, sx = torch_cast(x, fp8.FORWARD_DTYPE)
    w8, sw = torch_cast(weight, fp8.FORWARD_DTYPE)
    d8, sd = torch_cast(dy, fp8.GRAD_DTYPE)
    xq, wq, dq = x8.float() * sx, w8.float() * sw, d8.float() * sd
    return xq @ wq.t(), dq @ wq, dq.t() @ xq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_linear_and_its_gradients_are_the_fp8_products(dtype):
    """Forward, input gradient and weight gradient each equal the product of the FP8-rounded operands (to the
    output's rounding), and stay within FP8's error of the exact product."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 24, 64, generator=generator).to(dtype).to(DEVICE).requires_grad_()
    weight = (torch.randn(48, 64, generator=generator) * 0.1).to(dtype).to(DEVICE).requires_grad_()
    dy = torch.randn(4, 24, 48, generator=generator).to(dtype).to(DEVICE)
    y = fp8.fp8_linear(x, weight)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == weight.grad.dtype == dtype
    assert y.shape == (4, 24, 48) and x.grad.shape == x.shape and weight.grad.shape == weight.shape
    want_y, want_dx, want_dw = emulated(x.detach().reshape(-1, 64), weight.detach(), dy.reshape(-1, 48))
    # fp32 outputs: the CPU's products are exact to fp32; FP8 tensor cores accumulate in their own order and width
    rounding = 1e-2 if dtype == torch.bfloat16 else 1e-6 if DEVICE == "cpu" else 1e-3
    assert relative_error(y.reshape(-1, 48), want_y) < rounding
    assert relative_error(x.grad.reshape(-1, 64), want_dx) < rounding
    assert relative_error(weight.grad, want_dw) < rounding
    exact = x.detach().double().reshape(-1, 64)
    assert relative_error(y.reshape(-1, 48), exact @ weight.detach().double().t()) < 0.05
    assert relative_error(weight.grad, dy.double().reshape(-1, 48).t() @ exact) < 0.1


def test_the_linear_accumulates_fast_in_the_forward_only(monkeypatch):
    """cuBLAS's fast accumulation (no fp32 promotion of partial sums) in the forward; the promoted one in both
    gradients (fast in the input gradient was measured and did not pay, docs/model.md; the weight gradient sums over
    every token). The gradients stay the FP8 products."""
    calls, scaled_mm = [], torch._scaled_mm

    def recording(a, b, scale_a, scale_b, **kwargs):
        calls.append(kwargs.get("use_fast_accum", False))
        return scaled_mm(a, b, scale_a, scale_b, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", recording)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=generator).to(DEVICE).requires_grad_()
    weight = torch.randn(48, 64, generator=generator).to(DEVICE).requires_grad_()
    dy = torch.randn(32, 48, generator=generator).to(DEVICE)
    fp8.fp8_linear(x, weight).backward(dy)
    assert calls == [True, False, False]          # forward, input gradient, weight gradient
    _, want_dx, want_dw = emulated(x.detach(), weight.detach(), dy)
    assert relative_error(x.grad, want_dx) < 1e-3 and relative_error(weight.grad, want_dw) < 1e-3


def test_shapes_fp8_cannot_take_fall_back_to_the_plain_linear():
    x = torch.randn(3, 7, 64, device=DEVICE)                         # 21 rows: the weight gradient's inner dimension
    weight = torch.randn(32, 64, device=DEVICE)
    assert not fp8.fp8_shapes_fit(x, weight)
    assert torch.equal(fp8.fp8_linear(x, weight), F.linear(x, weight))


def test_convert_swaps_the_block_linears_and_keeps_the_state_dict():
    model = build(load_config("t5-tiny"), seed=0).to(DEVICE)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    names = fp8.convert_to_fp8(model)
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    assert names and set(names) == {name for name in linears if name.startswith(("encoder.blocks.", "decoder.blocks."))}
    assert all(type(model.get_submodule(name)) is fp8.Fp8Linear for name in names)
    assert type(model.lm_head) is not fp8.Fp8Linear
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)


def test_a_converted_model_trains_and_compiles_to_the_same_loss():
    """t5-tiny (widths of 16 and more) converted: its loss falls over a few steps on one batch, and compile_regions
    (aot_eager on the CPU, Inductor on a GPU, which traces into the ops there) gives the eager model's loss and
    gradients."""
    config = load_config("t5-tiny")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size - 100, (4, 32), generator=generator).to(DEVICE)
    labels = torch.randint(3, config.vocab_size - 100, (4, 16), generator=generator).to(DEVICE)
    models = []
    for compiled in (False, True):
        model = build(config, seed=0).to(DEVICE)
        fp8.convert_to_fp8(model)
        if compiled:
            model.compile_regions(backend="aot_eager" if DEVICE == "cpu" else "inductor")
        models.append(model)
    losses = []
    for model in models:
        model(input_ids, labels=labels).backward()
    eager, compiled = models
    if DEVICE == "cpu":            # aot_eager runs the same ops: the same bits
        assert torch.equal(eager(input_ids, labels=labels), compiled(input_ids, labels=labels))
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
            assert torch.equal(a.grad, b.grad), name
    else:                          # Inductor's fused norms round differently, and an FP8 rounding may flip with them
        assert relative_error(compiled(input_ids, labels=labels), eager(input_ids, labels=labels)) < 1e-3
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
            assert relative_error(b.grad, a.grad) < 5e-2, name
    optimizer = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    for _ in range(8):
        optimizer.zero_grad()
        loss = eager(input_ids, labels=labels)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5, losses


def ffn(gated_gelu="triton", dropout_rate=0.0, d_ff=80):
    config = load_config("t5-tiny", gated_gelu=gated_gelu, dropout_rate=dropout_rate, d_ff=d_ff)
    module = GatedGeluFFN(config)
    with torch.no_grad():
        for linear in (module.wi, module.wo):
            linear.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(linear.weight.shape[0]))
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_feed_forward_is_the_linears_and_gate_to_the_bit(dtype):
    """`fp8_gated_ffn` (the gate kernel hands max |x| of its output and of its gradient to the casts) against
    fp8_linear, the gate, fp8_linear: the same output and gradients, bit for bit, since a maximum is exact."""
    module = ffn().to(DEVICE, dtype)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 24, module.config.d_model, generator=generator).to(DEVICE, dtype)
    dy = torch.randn(2, 24, module.config.d_model, generator=generator).to(DEVICE, dtype)
    results = []
    for fused in (False, True):
        inputs = [t.detach().clone().requires_grad_() for t in (x, module.wi.weight, module.wo.weight)]
        if fused:
            y = fp8.fp8_gated_ffn(*inputs)
        else:
            y = fp8.fp8_linear(gated_gelu(fp8.fp8_linear(inputs[0], inputs[1])), inputs[2])
        y.backward(dy)
        results.append([y, *(t.grad for t in inputs)])
    for name, plain, fused in zip(("y", "dx", "dwi", "dwo"), *results):
        assert fused.dtype == plain.dtype == dtype and torch.equal(fused, plain), name


def test_the_fused_feed_forward_ops_fake_kernels_agree_with_the_real_ones():
    module = ffn().to(DEVICE)
    x = torch.randn(2, 8, module.config.d_model, device=DEVICE)
    args = (x, module.wi.weight.detach(), module.wo.weight.detach(), fp8.amax(x), fp8.amax(module.wi.weight),
            fp8.amax(module.wo.weight))
    torch.library.opcheck(torch.ops.t5zero.fp8_gated_ffn.default, args, test_utils=("test_faketensor",))
    saved = torch.ops.t5zero.fp8_gated_ffn.default(*args)[1:]
    dy = torch.randn_like(x)
    torch.library.opcheck(torch.ops.t5zero.fp8_gated_ffn_backward.default,
                          (dy, fp8.amax(dy), *saved, torch.float32), test_utils=("test_faketensor",))


def test_convert_fuses_the_feed_forwards_and_they_fall_back_where_the_op_does_not_apply(monkeypatch):
    """convert_to_fp8 makes each feed-forward an Fp8GatedGeluFFN (state dict kept) that calls fp8_gated_ffn with the
    gate by our kernel, without dropout and where FP8 takes the shapes; otherwise the module runs as before."""
    model = build(load_config("t5-tiny", gated_gelu="triton"), seed=0).to(DEVICE)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    fp8.convert_to_fp8(model)
    ffns = [m for m in model.modules() if isinstance(m, GatedGeluFFN)]
    assert ffns and all(type(m) is fp8.Fp8GatedGeluFFN for m in ffns)
    assert model.state_dict().keys() == before.keys()
    assert all(type(m) is GatedGeluFFN for m in build("t5-tiny").modules() if isinstance(m, GatedGeluFFN))
    calls = []
    monkeypatch.setattr(fp8, "fp8_gated_ffn", lambda *args: calls.append(1) or torch.zeros(()))
    x = torch.randn(2, 8, 64, device=DEVICE)
    cases = {"fused": ({}, True, True), "torch gate": (dict(gated_gelu="torch"), True, False),
             "dropout, training": (dict(dropout_rate=0.1, attention="sdpa"), True, False),
             "dropout, eval": (dict(dropout_rate=0.1, attention="sdpa"), False, True),
             "a width FP8 cannot take": (dict(d_ff=72), True, False)}
    for case, (settings, training, expected) in cases.items():
        model = build(load_config("t5-tiny", **{"gated_gelu": "triton", **settings}), seed=0).to(DEVICE)
        fp8.convert_to_fp8(model)
        module = model.encoder.blocks[0].ffn.train(training)
        calls.clear()
        module(x)
        assert bool(calls) == expected, case


def test_a_model_with_fused_feed_forwards_trains_and_compiles_to_the_unfused_bits(monkeypatch):
    """t5-tiny converted, with its feed-forwards as one op and (reverted) as separate linears and gate, eager and
    compile_regions (aot_eager on the CPU): the same loss and every parameter's gradient (bit for bit on the CPU,
    where aot_eager runs the same ops)."""
    calls, real = [], fp8.fp8_gated_ffn
    monkeypatch.setattr(fp8, "fp8_gated_ffn", lambda *args: calls.append(1) or real(*args))
    config = load_config("t5-tiny", gated_gelu="triton")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size - 100, (4, 32), generator=generator).to(DEVICE)
    labels = torch.randint(3, config.vocab_size - 100, (4, 16), generator=generator).to(DEVICE)
    runs = {}
    for fused, compiled in ((False, False), (True, False), (True, True)):
        model = build(config, seed=0).to(DEVICE)
        fp8.convert_to_fp8(model)
        if not fused:
            for module in model.modules():
                if type(module) is fp8.Fp8GatedGeluFFN:
                    module.__class__ = GatedGeluFFN
        if compiled:
            model.compile_regions(backend="aot_eager" if DEVICE == "cpu" else "inductor")
        calls.clear()
        loss = model(input_ids, labels=labels)
        loss.backward()
        assert len(calls) == (2 + 2 if fused else 0), (fused, compiled)       # t5-tiny: 2 blocks a stack
        runs[fused, compiled] = loss.detach(), {name: p.grad for name, p in model.named_parameters()}
    plain_loss, plain_grads = runs[False, False]
    for key in ((True, False), (True, True)):
        loss, grads = runs[key]
        if DEVICE == "cpu" or not key[1]:
            assert torch.equal(loss, plain_loss), key
            assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads), key
        else:              # Inductor's fused norms round differently, and an FP8 rounding may flip with them
            assert relative_error(loss, plain_loss) < 1e-3, key


def test_a_device_without_fp8_is_a_user_error():
    model = build(load_config("t5-tiny"), seed=0)
    with pytest.raises(UserError, match="--precision bf16"):
        fp8.convert_to_fp8(model, device="meta")


def test_under_autocast_the_output_is_autocasts_dtype_and_the_gradients_the_parameters():
    x = torch.randn(2, 16, 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(48, 32, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = fp8.fp8_linear(x, weight)
        want = F.linear(x, weight)
    assert y.dtype == want.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == weight.grad.dtype == torch.float32
    assert relative_error(y, want) < 0.05


def test_settings_treat_fp8_as_bf16_for_the_engine_mfu_and_memory():
    from pretrain.cli import build_parser, resolve_config
    from pretrain.ds_config import build_ds_config
    from pretrain.metrics import peak_tflops_for
    from pretrain.model.memory import estimate_memory

    assert "fp8" in build_parser().format_help()
    config = resolve_config(["--data", "shards/x", "--out", "runs/x", "--precision", "fp8"])
    for accelerator in ("cpu", "gpu"):
        assert build_ds_config(config, world_size=1, grad_accum=1, accelerator=accelerator)["bf16"] == {"enabled": True}
    assert peak_tflops_for("NVIDIA H200", "fp8", None) == peak_tflops_for("NVIDIA H200", "bf16", None) == 989.4
    settings = dict(zero=2, offload="none", world_size=1, local_world_size=1, micro_batch=8, input_length=512,
                    target_length=114, activation_checkpointing=False)
    model_config = load_config("mt5-base")
    assert (estimate_memory(model_config, precision="fp8", **settings)
            == estimate_memory(model_config, precision="bf16", **settings))


@pytest.mark.parametrize("micro_batch", [1, 2, 4, 6, 8, 16])
def test_preflight_names_the_parts_fp8_leaves_in_bf16_as_the_linear_does(micro_batch):
    """mt5-large at 512/114: the encoder's token count is always a multiple of 16, the decoder's only at micro batches
    that are multiples of 8; fp8_bf16_parts says so exactly where fp8_linear falls back to F.linear."""
    config = load_config("mt5-large")
    parts = fp8_bf16_parts(config, micro_batch, 512, 114)
    weight = torch.empty(config.d_ff, config.d_model, device="meta")
    for name, length in (("encoder", 512), ("decoder", 114)):
        fits = fp8.fp8_shapes_fit(torch.empty(micro_batch, length, config.d_model, device="meta"), weight)
        assert fits == (not any(part.startswith(f"the {name}'s") for part in parts)), (micro_batch, parts)
    assert parts == ([] if micro_batch % 8 == 0 else [
        f"the decoder's other linears: {micro_batch} x 114 tokens a micro batch is not a multiple of 16; a micro "
        f"batch that is a multiple of 8 runs them in FP8"])


def test_preflight_names_widths_fp8_cannot_take():
    config = dataclasses.replace(load_config("t5-tiny"), d_ff=120)
    assert fp8_bf16_parts(config, 8, 512, 114) == [
        "every block linear: d_model / d_ff / heads x d_kv = 64 / 120 / 64 are not all multiples of 16"]


TINY_BLOCK_LINEARS = 2 * 4 + 2 * 7     # t5-tiny: per encoder block qkv, o, wi, wo; per decoder block 7


@pytest.mark.parametrize("zero, ranks", [(2, 1), (3, 2)])
def test_pretrain_fp8_end_to_end_on_cpu(tiny_shards, tmp_path, zero, ranks):
    """DeepSpeed's bf16 engine (it runs bf16 on the CPU too) with t5-tiny's 22 block linears as FP8 GEMMs, the
    feed-forwards as one op each: ZeRO 2 on one gloo rank, and ZeRO 3 on two (the linears converted on the
    partitioned build, their weights gathered by the block's hooks when they cast them): the loss falls, the run
    records fp8 and how many linears it converted."""
    out = tmp_path / "fp8"
    gate = tmp_path / "gate.yaml"          # our gate kernels (interpreted here), so that the FFNs run as one FP8 op
    gate.write_text("model_overrides: {gated_gelu: triton}\n")
    result = pretrain("--config", str(gate), "--model", "t5-tiny", "--steps", "4", "--micro-batch", "4",
                      "--global-batch", "8", "--lr", "3e-3", "--warmup-steps", "1", "--zero", str(zero), "--nproc",
                      str(ranks), "--precision", "fp8",
                      "--no-save-final", "--steady-skip", "1", "--data", str(tiny_shards), "--out", str(out),
                      timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"ZeRO {zero}, offload none, fp8" in result.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(map(math.isfinite, losses))
    assert losses[-1] < losses[0] - 0.3, losses
    config = json.loads((out / "config.json").read_text())
    assert config["precision"] == "fp8" and config["train"]["precision"] == "fp8"
    assert config["deepspeed"]["bf16"] == {"enabled": True}
    assert config["model_init"]["fp8_linears"] == TINY_BLOCK_LINEARS


def test_pretrain_fp8_on_a_node_without_fp8_is_one_line_before_anything_starts(tiny_shards, tmp_path):
    """Without a GPU (and outside Triton's interpreter, which only the tests switch on) preflight refuses."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "pretrain.cli", "--model", "t5-tiny", "--steps", "2",
                             "--precision", "fp8", "--data", str(tiny_shards), "--out", str(out)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--precision fp8 needs a GPU" in errors[0] and "--precision bf16" in errors[0], errors
    assert "Traceback" not in result.stderr and not (out / "metrics.jsonl").exists()


def test_pretrain_fp8_resumes_exactly(tiny_shards, tmp_path):
    """FP8 keeps no state of its own (each cast's scale is that tensor's max now): a run stopped at step 2 and resumed
    gives the losses of the run that went through, to the bit."""
    common = ["--model", "t5-tiny", "--steps", "4", "--micro-batch", "4", "--global-batch", "8", "--lr", "3e-3",
              "--warmup-steps", "1", "--zero", "2", "--nproc", "1", "--precision", "fp8", "--steady-skip", "1",
              "--data", str(tiny_shards)]
    for args in (["--out", str(tmp_path / "through"), "--no-save-final"],
                 ["--out", str(tmp_path / "stopped"), "--save-every", "2", "--stop-after", "2"],
                 ["--out", str(tmp_path / "stopped"), "--resume", "--no-save-final"]):
        result = pretrain(*common, *args, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[resume] step-00000002" in result.stdout

    def losses(run):
        return [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses("through")) == 4 and losses("stopped") == losses("through")
