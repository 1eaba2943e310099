"""pretrain/one_pass_adamw.py: AdamW in one Triton kernel that reads the gradients where ZeRO keeps them equals
torch's AdamW on their concatenation, for gradients viewing one buffer in another order (ZeRO 2's) and for separate
tensors (ZeRO 1's, concatenated first), with and without the clipping factor and weight decay; ZeRO's alignment
padding past the gradients is left alone. On a GPU the kernel runs compiled on it; without one, in Triton's interpreter
on the CPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pretrain.one_pass_adamw import BLOCK, BLOCKS, adamw_one_pass

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [5, BLOCK * BLOCKS + 3, 700, 1, 2 * BLOCK]       # one gradient spans rows, others are shorter than a block


def gradients(shared: bool, dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    if not shared:
        return [torch.randn(n, generator=generator).to(dtype).to(device) for n in SIZES]
    buffer = torch.randn(sum(SIZES) + 11, generator=generator).to(dtype).to(device)
    views, end = [], buffer.numel() - 11          # reverse order in the buffer, as ZeRO 2's backward fills it
    for n in SIZES:
        views.append(buffer[end - n:end])
        end -= n
    return views


def reference(grads, param, exp_avg, exp_avg_sq, steps, scale, lr, betas, eps, weight_decay):
    """torch.optim.AdamW on the concatenated gradient divided by `scale`, `steps` times."""
    weight = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([weight], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    padding = weight.numel() - flat.numel()
    for _ in range(steps):
        weight.grad = torch.cat([flat / scale, torch.zeros(padding)])
        optimizer.step()
    state = optimizer.state[weight]
    return weight.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("shared, dtype, scale, weight_decay", [
    (True, torch.bfloat16, 2.5, 0.1), (True, torch.float32, None, 0.0), (False, torch.bfloat16, None, 0.01)])
def test_one_pass_equals_torch_adamw_on_the_concatenated_gradient(shared, dtype, scale, weight_decay):
    grads = gradients(shared, dtype)
    count = sum(SIZES)
    param = torch.randn(count + 16, generator=torch.Generator().manual_seed(1))   # 16 elements of alignment padding
    param[count:] = 0.0
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    expected = reference(grads, param, exp_avg, exp_avg_sq, 3, scale or 1.0, **hyper)     # on the CPU
    grads = gradients(shared, dtype, DEVICE)                                                # the same values
    param, exp_avg, exp_avg_sq = (t.to(DEVICE) for t in (param, exp_avg, exp_avg_sq))
    step = torch.zeros((), dtype=torch.float32, device=DEVICE)
    factor = None if scale is None else torch.tensor(scale, dtype=torch.float32, device=DEVICE)
    cache: dict = {}
    for number in range(3):
        step += 1
        read = adamw_one_pass(grads, param, exp_avg, exp_avg_sq, step, factor, cache=cache, **hyper)
        assert read == ("in place" if shared else "concatenated")
        if number == 0:
            rows = cache["rows"]
        assert cache["rows"] is rows                  # the same layout: the table is not built again
    for got, want in zip((param, exp_avg, exp_avg_sq), expected):
        torch.testing.assert_close(got.cpu(), want, rtol=2e-6, atol=1e-7)
    assert torch.all(param[count:] == 0) and torch.all(exp_avg_sq[count:] == 0)


def test_a_partition_smaller_than_its_gradients_is_refused():
    grads = gradients(True, torch.bfloat16)
    param = torch.zeros(sum(SIZES) - 1)
    with pytest.raises(ValueError, match="the partition"):
        adamw_one_pass(grads, param, torch.zeros_like(param), torch.zeros_like(param),
                       torch.ones(()), None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
