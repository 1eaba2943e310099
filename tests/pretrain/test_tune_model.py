"""`study tune`'s cost model: what a measured candidate tells the model about the candidates that differ from it
only in loading (their compute is its compute), and what it does not (another stage, another micro batch).

    .venv/bin/python -m pytest tests/pretrain/test_tune_model.py -q
"""

from __future__ import annotations

import pytest

from pretrain.config import TrainConfig
from pretrain.metrics import needed_peak
from pretrain.study.tune_model import Calibration, CostModel, Shape, compute_key, memory_setting

H200 = {"kind": "cuda", "name": "NVIDIA H200", "precision": "bf16"}
# mt5-large at global batch 64 on one rank (1.23B parameters, 512/114 tokens)
SHAPE = Shape(parameters=1_229_581_312, flops_per_rank_step=4.1e14, examples_per_rank_step=64,
              tokens_per_step=64 * 626, host_cores_per_rank=16)


def config(**settings) -> TrainConfig:
    base = dict(model="mt5-large", data="shards", out="runs/x", global_batch=64, micro_batch=32, zero=2,
                loader="shards", loader_workers=0, compile=True, precision="bf16")
    return TrainConfig(**{**base, **settings})


def measured(cfg: TrainConfig, step_s: float, wait_s: float = 0.0) -> tuple[TrainConfig, dict]:
    return cfg, {"step_time_s": step_s, "data_wait_s": wait_s, "cpu_loader_workers_s": None,
                 "cpu_loader_inline_s": None}


def test_the_compute_key_ignores_loading_and_launch_fields_only():
    a = config()
    assert compute_key(a) == compute_key(config(loader="online", loader_workers=4, out="elsewhere", steps=7))
    for other in (config(zero=3), config(micro_batch=16), config(offload="cpu"), config(omp_num_threads=12),
                  config(activation_checkpointing=True)):
        assert compute_key(other) != compute_key(a)


def test_a_measured_sibling_gives_its_compute_to_the_others_and_nothing_to_other_stages():
    model = CostModel.for_device(H200)
    before = {name: model.predict(cfg, SHAPE) for name, cfg in
              {"z0": config(zero=0, loader_workers=1), "z2w1": config(loader_workers=1)}.items()}
    assert all(p["siblings"] == 0 for p in before.values())

    default = config()
    model.refit([measured(default, 0.452, wait_s=0.001)], SHAPE)
    sibling = model.predict(config(loader_workers=1), SHAPE)
    online = model.predict(config(loader="online", loader_workers=4), SHAPE)
    assert sibling["siblings"] == online["siblings"] == 1
    assert sibling["compute_s"] == pytest.approx(0.451, rel=1e-9)     # the measured step less its data wait
    assert online["compute_s"] == pytest.approx(0.451, rel=1e-9)
    assert online["data_wait_s"] >= 0.0
    # a stage never measured keeps the model's own figure (refitted, not anchored)
    assert model.predict(config(zero=0, loader_workers=1), SHAPE)["siblings"] == 0
    # the measured candidate itself, unanchored, is what the model alone says (tune_predicted.png's check)
    assert model.predict(default, SHAPE, anchored=False)["siblings"] == 0


def test_under_offload_siblings_keep_the_cores_their_workers_take_from_cpu_adam():
    model = CostModel.for_device(H200)
    one = config(offload="cpu", loader_workers=1)
    four = config(offload="cpu", loader="online", loader_workers=4)
    unanchored = model.predict(four, SHAPE)["compute_s"] / model.predict(one, SHAPE)["compute_s"]
    assert unanchored > 1.0                          # four workers leave CPU-Adam fewer threads
    model.refit([measured(one, 1.95)], SHAPE)
    ratio = model.predict(four, SHAPE)["compute_s"] / model.predict(one, SHAPE)["compute_s"]
    assert model.predict(four, SHAPE)["siblings"] == 1
    assert ratio == pytest.approx(model.predict(four, SHAPE, anchored=False)["compute_s"]
                                  / model.predict(one, SHAPE, anchored=False)["compute_s"], rel=1e-9)
    assert model.predict(one, SHAPE)["compute_s"] == pytest.approx(1.95, rel=1e-9)


def test_several_measured_siblings_anchor_by_their_median():
    model = CostModel.for_device(H200)
    runs = [measured(config(loader_workers=w), s) for w, s in ((0, 0.40), (1, 0.44), (2, 0.60))]
    model.refit(runs, SHAPE)
    assert model.predict(config(loader_workers=4), SHAPE)["compute_s"] == pytest.approx(0.44, rel=1e-9)
    assert model.explain()["anchors"] == 1


def test_cuda_graphs_are_their_own_compute_and_their_own_memory():
    """--cudagraphs changes the step (its own compute key, a term of its own that the first graphed launch refits)
    and the memory (its own calibration, from the reserved peak, which holds the graphs' pools)."""
    graphed, plain = config(cudagraphs=True), config(cudagraphs=False)
    assert compute_key(graphed) != compute_key(plain)
    gpu, cpu = CostModel.for_device(H200), CostModel.for_device({"kind": "cpu"})
    assert gpu.predict(graphed, SHAPE)["compute_s"] < gpu.predict(plain, SHAPE)["compute_s"]
    assert cpu.predict(graphed, SHAPE)["compute_s"] == cpu.predict(plain, SHAPE)["compute_s"]   # no graphs on CPU

    # one graphed launch alone says nothing of the others: they keep the model's figure
    small, small_graphed = config(micro_batch=16, cudagraphs=False), config(micro_batch=16, cudagraphs=True)
    gpu.refit([measured(graphed, 0.283)], SHAPE)
    assert gpu.predict(small_graphed, SHAPE)["graph_ratio"] is None and gpu.explain()["graph_ratio"] is None
    # a measured pair does (one H200, mt5-large ZeRO 2 at micro 32 x 2: 0.413 s a step without graphs, 0.283 s
    # with; docs/pretrain.md): each graphed candidate not measured is its graph-free twin times their ratio
    gpu.refit([measured(plain, 0.413), measured(graphed, 0.283), measured(plain, 0.421)], SHAPE)
    ratio = 0.283 / 0.417                                    # against the median of the graph-free pair's runs
    assert gpu.explain()["graph_ratio"] == pytest.approx(ratio, abs=1e-4)
    twin = gpu.predict(small, SHAPE)
    predicted = gpu.predict(small_graphed, SHAPE)
    assert predicted["graph_ratio"] == pytest.approx(ratio) and predicted["siblings"] == twin["siblings"] == 0
    assert predicted["compute_s"] == pytest.approx(twin["compute_s"] * ratio, rel=1e-9)
    # a graphed candidate measured itself, and its loading siblings, keep their own anchor
    assert gpu.predict(graphed, SHAPE)["compute_s"] == pytest.approx(0.283, rel=1e-9)
    assert gpu.predict(config(cudagraphs=True, loader_workers=2), SHAPE)["siblings"] == 1
    # a graph-free candidate keeps the model's figure: the ratio carries graphs' gain to graphed points only
    assert gpu.predict(small, SHAPE)["graph_ratio"] is None


def test_a_graphed_launch_calibrates_graphed_points_by_its_reserved_peak():
    calibration = Calibration(capacity_gib=141.0, margin=0.1)
    graphed, plain = memory_setting("none", True), memory_setting("none", False)
    assert (graphed, plain) == ("none+cudagraphs", "none")
    row = {"peak_mem_gib": 30.0, "peak_reserved_gib": 63.0}
    assert needed_peak(row, cudagraphs=True) == 63.0 and needed_peak(row, cudagraphs=False) == 30.0
    assert needed_peak({"peak_mem_gib": 30.0, "peak_reserved_gib": None}, cudagraphs=True) == 30.0
    calibration.observe(2, plain, 39.0, 40.0, "plain")
    calibration.observe(2, graphed, needed_peak(row, True), 40.0, "graphed")
    assert calibration.ratio(2, plain) == pytest.approx(39 / 40) and calibration.ratio(2, graphed) == 63 / 40
    calibration.observe_oom(2, graphed, 100.0, "graphed at a larger micro batch")
    assert calibration.verdict(2, graphed, 100.0)[0] == "pruned"
    assert calibration.verdict(2, plain, 100.0)[0] == "fits"          # its own stage and setting, not the graphs'
