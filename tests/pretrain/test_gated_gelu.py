"""`gated_gelu="triton"`: the feed-forward's gate in two Triton kernels (pretrain/model/gated_gelu.py), the backward's
two gradients from one tanh written into their halves of the fused projection's gradient.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets), checked
against float64 references and against the model's torch gate; where CUDA exists, the compiled kernels in bf16.

    pytest tests/pretrain/test_gated_gelu.py     # ~10 s on 2 CPU cores
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.pretrain.triton_kernels import DEVICE, relative_error, require_kernels

require_kernels()

from pipeline.common import UserError  # noqa: E402
from pretrain.model.gated_gelu import gated_gelu, launch_backward, launch_forward  # noqa: E402
from pretrain.model.t5 import build, load_config  # noqa: E402
from tests.pretrain.test_flex_attention import assert_same_outputs, forward_backward, no_tf32  # noqa: E402,F401


def reference(u):
    gate, linear = u.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * linear


def both(shape, dtype, seed=0):
    """(ours, reference in float64 on the same values) as (out, du) for random u of `shape` in `dtype` and a random
    output gradient."""
    generator = torch.Generator().manual_seed(seed)
    u = (torch.randn(shape, generator=generator) * 2).to(dtype).double()
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=generator).to(dtype).double()
    ours = u.to(DEVICE, dtype).requires_grad_()
    out = gated_gelu(ours)
    out.backward(grad.to(DEVICE, dtype))
    want_u = u.clone().requires_grad_()
    want = reference(want_u)
    want.backward(grad)
    return (out, ours.grad), (want, want_u.grad)


@pytest.mark.parametrize("shape", [(3, 5, 2 * 40), (37, 2 * 300), (1, 2 * 7)])   # ragged rows and columns
def test_forward_and_gradient_equal_a_float64_reference(shape):
    (out, du), (want, want_du) = both(shape, torch.float32)
    assert out.shape == want.shape and du.shape == want_du.shape and out.dtype == du.dtype == torch.float32
    assert relative_error(out, want) < 1e-6
    assert relative_error(du, want_du) < 1e-6


def test_bf16_is_one_rounding_from_the_float64_reference():
    """fp32 inside, one conversion at the end: each value within one bf16 step (2^-7 of it, which a truncating
    conversion, as in Triton's interpreter, also keeps) of the float64 result on the same inputs."""
    (out, du), (want, want_du) = both((4, 6, 2 * 64), torch.bfloat16, seed=1)
    assert out.dtype == du.dtype == torch.bfloat16
    for got, expected in ((out, want), (du, want_du)):
        error = (got.detach().double().cpu() - expected).abs()
        assert bool((error <= 2 ** -7 * expected.abs() + 1e-12).all())   # (tanh reaches -1 in float64 first)
        assert relative_error(got, expected) < 2 ** -8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(37, 300), (64, 256), (1, 7)])    # ragged tiles, whole ones, one row
def test_the_kernels_hand_over_max_abs_of_what_they_write(dtype, rows, width):
    """With an amax buffer each kernel writes the same output as without, and max |output| into the buffer: equal to
    torch's amax of the stored output (what fp8.py's cast would otherwise compute)."""
    generator = torch.Generator().manual_seed(3)
    u = (torch.randn(rows, 2 * width, generator=generator) * 2).to(DEVICE, dtype)
    dout = torch.randn(rows, width, generator=generator).to(DEVICE, dtype)
    for launch, args, shape in ((launch_forward, (u,), (rows, width)), (launch_backward, (u, dout), (rows, 2 * width))):
        plain, handed = torch.empty(shape, dtype=dtype, device=DEVICE), torch.empty(shape, dtype=dtype, device=DEVICE)
        amax = torch.zeros(1, dtype=torch.float32, device=DEVICE)
        launch(*args, plain)
        launch(*args, handed, amax)
        assert torch.equal(plain, handed), launch.__name__
        assert amax.item() == handed.float().abs().max().item() > 0, launch.__name__


def test_the_custom_ops_fake_kernels_and_autograd_agree_with_the_real_ones():
    u = torch.randn(2, 9, 2 * 24).to(DEVICE).requires_grad_()
    torch.library.opcheck(torch.ops.t5zero.gated_gelu.default, (u,),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.t5zero.gated_gelu_backward.default, (torch.randn(2, 9, 24).to(DEVICE), u.detach()),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("mode", ["eager", "compile-regions"])
def test_model_with_the_triton_gate_equals_the_torch_gate(monkeypatch, no_tf32, mode):
    """t5-tiny in fp32: loss, logits and every parameter's gradient as with the torch gate (compile-regions: the
    blocks compiled, aot_eager on CPU, the gate's custom ops inside the graphs)."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(3, 1000, (3, 20), generator=generator).to(DEVICE)
    labels = torch.randint(3, 1000, (3, 9), generator=generator).to(DEVICE)
    torch_gate = build("t5-tiny", seed=1, gated_gelu="torch").to(DEVICE).train()
    ours = build("t5-tiny", seed=1, gated_gelu="triton").to(DEVICE).train()
    calls = []
    real = gated_gelu.__globals__["_forward"]
    monkeypatch.setitem(gated_gelu.__globals__, "_forward", lambda u: calls.append(1) or real(u))
    if mode == "compile-regions":
        ours.compile_regions(backend="aot_eager" if DEVICE == "cpu" else "inductor")
        monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())   # Dynamo warns once a process
    want = forward_backward(torch_gate, inputs, labels, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = forward_backward(ours, inputs, labels, None)
    assert calls                                  # the model went through the Triton gate
    assert_same_outputs(got, want, 1e-5 if DEVICE == "cpu" else 1e-4, loss_rtol=1e-5)
    # no warning at compile time from what the blocks call (a call to an lru_cache'd function was one)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


def test_gated_gelu_config_errors_are_one_clear_line(monkeypatch):
    with pytest.raises(UserError, match="gated_gelu must be one of"):
        load_config("t5-tiny", gated_gelu="fast")
    assert load_config("t5-tiny").gated_gelu_kind("cpu") == "torch"
    assert load_config("t5-tiny", gated_gelu="triton").gated_gelu_kind("cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = build("t5-tiny", seed=0, gated_gelu="triton")
    if DEVICE == "cuda":
        return
    with pytest.raises(UserError, match="runs on CUDA devices"):
        model(torch.randint(3, 100, (1, 8)), labels=torch.randint(3, 100, (1, 4)))
