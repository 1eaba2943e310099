"""pretrain.trainer.fuse_overflow_check: DeepSpeed's bf16 overflow checks, one sync and few kernels, same answers.

ZeRO 0 and ZeRO 1-2 each have their own; a real bf16 ZeRO 2 run on CPU installs it
(config.json["engine"]["overflow_check_fused"]); the GPU figures are in
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


@pytest.mark.parametrize("case", CASES)
def test_the_fused_zero2_check_answers_as_deepspeeds(case):
    """ZeRO 1-2 (DeepSpeedZeroOptimizer): its per-tensor test summed on the device against one multi-tensor max-abs."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    grads = CASES[case]
    zero = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)     # only the two fields the check reads
    zero.bit16_groups, zero.averaged_gradients = [[None] * len(grads)], {0: list(grads)}
    serial = bool(DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(zero))
    assert fuse_overflow_check(zero) is True
    fused = zero.has_overflow_partitioned_grads_serial()
    assert fused.shape == (1,) and bool(fused) == serial == (case in ("inf", "-inf", "nan"))


@pytest.mark.parametrize("step", ["fused", pytest.param("triton", marks=pytest.mark.slow)])   # slow: -m slow
def test_a_real_bf16_zero2_run_installs_the_fused_check_and_still_skips_a_nan(tiny_shards, tmp_path, step):
    """pretrain at ZeRO 2 in bf16 on CPU (one gloo rank), with the fused optimizer step (the default on a CPU) and with the one-pass
    one (in Triton's interpreter): the engine notes the replaced check, a NaN forced on batch 2 (its gradients NaN
    too) is skipped, and training goes on with finite losses."""
    import json

    from pretrain.metrics import read_metrics
    from launching import COMMON, ok, pretrain

    out = tmp_path / "z2-bf16"
    ok(pretrain(*COMMON, "--data", str(tiny_shards), "--out", str(out), "--zero", "2", "--nproc", "1",
                "--precision", "bf16", "--debug-nan-batches", "2", "--rollback-after", "0", "--optimizer-step", step))
    engine = json.loads((out / "config.json").read_text())["engine"]
    assert engine == {"optimizer": "DeepSpeedZeroOptimizer", "overflow_check_fused": True, "grad_norm_fused": True,
                      "optimizer_step": step}
    records = read_metrics(out / "metrics.jsonl")
    assert records[1]["skipped"] == "nonfinite_loss"
    assert all(r["skipped"] is None and r["loss"] is not None for r in records[2:])
