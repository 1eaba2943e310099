"""`study tune`'s model arithmetic, in a child process: parameters, FLOPs per step and the preflight's memory
estimate of every candidate. The tune itself stays free of torch and DeepSpeed (it never touches a device and
starts fast, like the rest of the study); this module imports both, through the model and its estimate.

    echo '{"model": "t5-tiny", "candidates": [...], ...}' | python -m pretrain.study.tune_estimate   # JSON out
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from pipeline.common import run_cli
from pretrain.model.flops import count_parameters, train_step_flops
from pretrain.model.memory import estimate_memory
from pretrain.model.t5 import load_config
from pretrain.preflight import FIT_FRACTION, resolve_vocab_size


def estimates(request: dict[str, Any]) -> dict[str, Any]:
    """{parameters, fit_fraction (the preflight's), flops_per_rank_step, estimates: [estimate_memory(...) per
    candidate]} for a request naming the model (preset, overrides, pinned vocab, tokenizer vocab), the lengths, the
    ranks, the precision and the candidates."""
    preset = load_config(request["model"], **request.get("model_overrides", {}))
    vocab, _ = resolve_vocab_size(preset.vocab_size, request["tokenizer_vocab"], request.get("vocab_size"))
    model = dataclasses.replace(preset, vocab_size=vocab)
    lengths = dict(input_length=request["input_length"], target_length=request["target_length"])
    nproc = request["nproc"]
    return {"parameters": count_parameters(model), "fit_fraction": FIT_FRACTION,
            "flops_per_rank_step": float(train_step_flops(model, request["per_rank_examples"], **lengths)),
            "estimates": [estimate_memory(model, zero=c["zero"], offload=c["offload"], precision=request["precision"],
                                          world_size=nproc, local_world_size=nproc, micro_batch=c["micro_batch"],
                                          activation_checkpointing=c["activation_checkpointing"],
                                          fused_attention=request["fused_attention"], **lengths)
                          for c in request["candidates"]]}


def main() -> int:
    print(json.dumps(estimates(json.loads(sys.stdin.read()))))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, "tune_estimate"))
