"""pretrain.trainer.fuse_overflow_check: DeepSpeed's ZeRO-0 overflow check with one host sync, the same answers.

A real bf16 ZeRO 0 run on CPU installs it (config.json["engine"]["overflow_check_fused"]); the GPU figures are in
docs/pretrain.md."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.utils import CheckOverflow

from pretrain.trainer import any_inf_or_nan, fuse_overflow_check


def params_with(*grads):
    params = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros(3 if grad is None else grad.shape[0], dtype=torch.bfloat16))
        p.grad = grad
        params.append(p)
    return params


CASES = {
    "finite": [torch.ones(3, dtype=torch.bfloat16), torch.full((3,), -2.0, dtype=torch.bfloat16)],
    "inf": [torch.ones(3, dtype=torch.bfloat16), torch.tensor([1.0, float("inf"), 0.0], dtype=torch.bfloat16)],
    "-inf": [torch.tensor([float("-inf"), 0.0, 0.0], dtype=torch.bfloat16)],
    "nan": [torch.tensor([0.0, 0.0, float("nan")], dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)],
    "no grads": [None, None],
    "empty": [torch.zeros(0, dtype=torch.bfloat16)],
}


@pytest.mark.parametrize("case", CASES)
def test_the_fused_check_answers_as_deepspeeds_serial_check(case):
    params = params_with(*CASES[case])
    serial = CheckOverflow(param_groups=[params])
    fused = CheckOverflow(param_groups=[params])

    class Wrapper:     # what DeepSpeed's FP16 optimizers hold
        overflow_checker = fused

    assert fuse_overflow_check(Wrapper()) is True
    expected = bool(serial.has_overflow(params))
    assert bool(fused.has_overflow(params)) == expected == any_inf_or_nan(params)
    assert expected == (case in ("inf", "-inf", "nan"))


def test_optimizers_without_such_a_check_are_left_alone():
    assert fuse_overflow_check(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])) is False
