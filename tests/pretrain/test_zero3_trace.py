"""ZeRO 3 in steady state: DeepSpeed keeps its module trace and gathers each weight at most once per use.

    .venv/bin/python -m pytest tests/pretrain/test_zero3_trace.py -q

Each test is one real 2-rank gloo run of scripts/zero3_trace.py (t5-tiny, 3 training steps, the model built
partitioned as pretrain builds it, every weight partitioned: t5-tiny's are all below the default persistence
threshold). ~10 s each on 2 CPU cores.
"""

from __future__ import annotations

import re

import pytest

from pretrain.model import build

ALL_PARTITIONED = {"stage3_param_persistence_threshold": 0}
# mt5-large's limits relative to its size (1.2B parameters against stage3_max_live_parameters and
# stage3_max_reuse_distance of 1e9, prefetch buckets of 5e7), scaled to t5-tiny's 329k: weights are released
# between forward and backward and gathered again, as on the GPUs
TIGHT = {**ALL_PARTITIONED, "stage3_max_live_parameters": 260_000, "stage3_max_reuse_distance": 260_000,
         "stage3_prefetch_bucket_size": 13_000}

@pytest.fixture(scope="module")
def zero3_trace(load_script):
    return load_script("zero3_trace")


def outside_blocks(preset: str) -> int:
    """Modules of `preset` that are not inside a Block (the Blocks themselves included)."""
    return sum(1 for name, _ in build(preset).named_modules() if not re.search(r"\.blocks\.\d+\.", name))


def test_steady_state_keeps_the_trace_and_gathers_each_weight_once_for_forward(zero3_trace, tmp_path):
    result = zero3_trace.run_trace("t5-tiny", steps=3, stage3=ALL_PARTITIONED, workdir=tmp_path, timeout=180)
    assert zero3_trace.steady_state_problems(result) == []
    assert zero3_trace.demand_gathers(result) == 0           # the trace holds: everything prefetched
    for step in result["steps"][1:]:
        assert step["trace_mode"] == "complete" and step["invalidations"] == []
        assert step["ideal"]["persistent_params"] == 0
        assert step["gathered_for"]["forward"] == {key: step["ideal"][key] for key in ("params", "bytes")}
        assert step["gathered_for"]["backward"]["bytes"] <= step["ideal"]["bytes"]
        assert step["phases"]["step"]["params"] == 0          # the optimizer step gathers nothing
    largest = {p["name"]: p for p in result["steps"][-1]["largest"]}
    assert largest["shared.weight"]["forward"] == 1 and largest["lm_head.weight"]["forward"] == 1
    # each Block is gathered as one unit (a ZeRO-3 leaf module): DeepSpeed hooks no module inside a Block
    assert result["run"]["hooked_modules"] == outside_blocks("t5-tiny")
    visits = result["steps"][-1]["hooks"]["pre_sub_module_forward_function"]["calls"]
    assert visits <= result["run"]["hooked_modules"]


def test_weights_released_between_forward_and_backward_are_gathered_once_for_each(zero3_trace, tmp_path):
    result = zero3_trace.run_trace("t5-tiny", steps=3, stage3=TIGHT, workdir=tmp_path, timeout=180)
    assert zero3_trace.steady_state_problems(result) == []
    for step in result["steps"][1:]:
        assert step["invalidations"] == [] and step["trace_mode"] == "complete"
        assert step["gathered_for"]["forward"]["params"] == step["ideal"]["params"]
        assert 0 < step["gathered_for"]["backward"]["params"] <= step["ideal"]["params"]   # released, gathered again
        assert step["over_ideal"] == []
