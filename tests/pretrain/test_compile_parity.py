"""The compiled model (`T5Model.compile_regions`, real Inductor on CPU) trains like the eager one (issue 15).

Same weights, same batches, torch AdamW: the per-step losses of the compiled copy must follow the eager copy's in
fp32, under bf16 autocast with fp32 parameters (the parity benchmark's setting) and with bf16 parameters (what
the model sees under DeepSpeed bf16). A precision regression of the compiled path (an fp32 upcast fused away, a
gradient computed in bf16, a loss scaled differently) moves the compiled losses off the eager ones in one direction.

Tolerances, from this very setting (t5-tiny, one batch memorised over 6 AdamW steps at lr 1e-2, torch 2.13 CPU):
fp32 compiled vs eager differ by < 1e-6 per step. In bf16 the two paths round differently (Inductor fuses casts
the eager path rounds), and HF's T5ForConditionalGeneration compiled vs eager on the same weights and batches
(the noise reference) differs per step by up to 0.010 (bf16 autocast) and 0.016 (bf16 parameters), mean signed
difference over the steps 0.000 and -0.005; ours compiled vs eager gave 0.006 / 0.013, mean -0.005 / -0.005.
Asserted: fp32 max |diff| <= 1e-4; bf16 max |diff| <= 0.03 and |mean signed diff| <= 0.015 (about 2x and 3x HF's).
What it catches: fp32 is the sharp check of the compiled math (checked: compiled blocks that drop the position
bias's gradient miss by 8e-4 and fail); the bf16 cases catch a drift beyond HF's own compiled-vs-eager spread (the
same injection hides in bf16 noise, and a dropped fp32 upcast inside a compiled region cannot show at all: Inductor
computes bf16 pointwise chains in fp32 whatever the code says). fp32 runs by default (~15 s on 2 cores with
Inductor's cache warm, ~45 s cold, most of it compiling); bf16-params and bf16-autocast are marked slow (~30 s cold
each; `./scripts/test.sh -m slow`), to keep the default suite under 20 minutes on CI's 2 cores.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pretrain.model.t5 import build

STEPS = 6
BATCH, INPUT_LENGTH, TARGET_LENGTH = 4, 32, 8


def train_losses(model, batches, precision: str) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for input_ids, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
            loss = model(input_ids, labels=labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-params", marks=pytest.mark.slow),
                                       pytest.param("bf16-autocast", marks=pytest.mark.slow)])
def test_compiled_losses_follow_eager(precision):
    torch.manual_seed(0)
    eager = build("t5-tiny", seed=0).train()
    if precision == "bf16-params":
        eager = eager.to(torch.bfloat16)
    compiled = copy.deepcopy(eager).compile_regions()
    generator = torch.Generator().manual_seed(1)
    vocab = eager.config.vocab_size
    batch = (torch.randint(3, vocab - 100, (BATCH, INPUT_LENGTH), generator=generator),
             torch.randint(3, vocab - 100, (BATCH, TARGET_LENGTH), generator=generator))
    batches = [batch] * STEPS      # one batch, memorised: the loss falls every step, a clean trajectory to follow
    eager_losses = train_losses(eager, batches, precision)
    compiled_losses = train_losses(compiled, batches, precision)
    diffs = [c - e for c, e in zip(compiled_losses, eager_losses)]
    assert eager_losses[-1] < eager_losses[0] - 0.01, f"the setting must train: {eager_losses}"
    if precision == "fp32":
        assert max(map(abs, diffs)) <= 1e-4, f"fp32 compiled vs eager: {diffs}"
    else:
        assert max(map(abs, diffs)) <= 0.03, f"{precision} compiled vs eager per step: {diffs}"
        assert abs(sum(diffs) / len(diffs)) <= 0.015, f"{precision} compiled drifts from eager: {diffs}"
