"""The T5 v1.1 / mT5 model: `t5` (config, presets, the model), `zero3` (the ZeRO-3 partitioned build), `hf` (the
HF transformers bridge), `flops` (FLOPs and parameter counts), `memory` (the preflight's memory estimate).

    from pretrain.model.t5 import build; model = build("t5-tiny", seed=0)

No re-exports: import from the submodule, so that `flops` or `memory` never pull in torch.
"""
