"""The model under ZeRO 3: its invariants, each checked in a real 2-rank gloo DeepSpeed run of t5-tiny on CPU.

    .venv/bin/python -m pytest tests/pretrain/test_zero3.py -q      # ~15 s per test on 2 CPU cores

- Each Block is gathered as one unit (a ZeRO-3 leaf module): DeepSpeed hooks exactly the modules outside the
  blocks (the blocks included), and its recorded module trace holds in every step, also when tight limits make it
  release weights between forward and backward.
- pretrain.grad_norm's fused gradient norm over the two ranks' partitions equals DeepSpeed's own (fp64) at every
  step, to 1e-12.
- `compile_regions` under ZeRO 3 keeps 3 graphs (encoder block, decoder block, loss chunk) with no graph break,
  and torch's own F.linear in them: configs/deepspeed/zero3.yaml's `memory_efficient_linear: false` keeps
  DeepSpeed's `zero3_linear_wrap` out.

The ranks run this file as a script (`python tests/pretrain/test_zero3.py REPORT [--compile]`) and are built as
`pretrain` builds them: `init_rank`, `build_ds_config` of a `TrainConfig`, `build_partitioned`,
`deepspeed.initialize`. What the investigation behind these found: docs/model.md ("Under ZeRO 3").
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# mt5-large's limits relative to its size (1.2B parameters against stage3_max_live_parameters and
# stage3_max_reuse_distance of 1e9, prefetch buckets of 5e7), scaled to t5-tiny's 329k, every weight partitioned:
# weights are released between forward and backward and gathered again, as on the GPUs
TIGHT = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 260_000,
         "stage3_max_reuse_distance": 260_000, "stage3_prefetch_bucket_size": 13_000}
MICRO_BATCH, INPUT_LENGTH, TARGET_LENGTH = 2, 32, 8


def rank_main(report: Path, compile_regions: bool) -> None:
    """One rank: t5-tiny built partitioned at ZeRO 3 (TIGHT eager, the defaults compiled; on a world of one, the
    defaults with `drop_idle_module_hooks` as pretrain installs it), a few training steps on seeded random tokens;
    rank 0 writes what the tests read to `report`."""
    import deepspeed
    from torch._dynamo.utils import counters

    from pretrain.config import TrainConfig
    from pretrain.ds_config import build_ds_config
    from pretrain.model.zero3 import build_partitioned, drop_idle_module_hooks
    from pretrain.ranks import rank_env
    from pretrain.trainer import init_rank

    env = rank_env()
    init_rank(env.local_rank, env.local_world_size)
    one_rank = env.world_size == 1
    config = TrainConfig(model="t5-tiny", data="-", out="-", zero=3, micro_batch=MICRO_BATCH,
                         **({} if compile_regions or one_rank else TIGHT))
    ds_config = build_ds_config(config, world_size=env.world_size, grad_accum=1, accelerator="cpu")
    model = build_partitioned(config.model, ds_config, seed=0)
    if compile_regions:
        model.compile_regions()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    norms = compare_grad_norms(engine.optimizer)
    dropped = one_rank and drop_idle_module_hooks(engine.optimizer)
    on_partitions, releases = [], count_releases()
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    generator = torch.Generator().manual_seed(1000 + env.rank)
    low, vocab = max(model.config.pad_token_id, model.config.eos_token_id) + 1, model.config.vocab_size
    losses, trace_complete = [], []
    for _ in range(2 if compile_regions else 3):
        input_ids = torch.randint(low, vocab, (MICRO_BATCH, INPUT_LENGTH), generator=generator)
        labels = torch.randint(low, vocab, (MICRO_BATCH, TARGET_LENGTH), generator=generator)
        loss = engine(input_ids, labels=labels)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        trace_complete.append(coordinator.is_complete_trace())
        if one_rank:
            on_partitions.append(dict(weights_on_partitions(engine.optimizer, model), releases=releases[0]))
            releases[0] = 0
    after_release = None
    if one_rank:     # a weight released between steps: the forward pre-hook points it back at its partition
        weight = next(model.parameters())
        weight.partition()
        released = weight.data.numel() == 0
        with torch.no_grad():
            engine(input_ids, labels=labels)
        after_release = {"released": released, "on_partition": weight.data.data_ptr() == weight.ds_tensor.data_ptr()}
    if env.rank == 0:
        linear = torch.nn.functional.linear
        result = {"hooked_modules": sum(1 for module in model.modules() if hasattr(module, "ds_id")),
                  "losses": losses, "trace_complete": trace_complete,
                  "linear": f"{linear.__module__}.{linear.__name__}", "grad_norms": norms,
                  "dropped": dropped, "on_partitions": on_partitions, "after_release": after_release,
                  "dynamo_counters": {name: dict(counter) for name, counter in counters.items() if counter}}
        staging = report.with_suffix(".tmp")
        staging.write_text(json.dumps(result))
        staging.rename(report)
    del engine, model
    gc.collect()        # ZeRO-3 parameters alive when the process group is gone abort the process at exit
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def count_releases() -> list[int]:
    """Count DeepSpeed's releases of a weight (`free_param`, which its partitioning calls) from now on: [count]."""
    from deepspeed.runtime.zero import partition_parameters

    count, release = [0], partition_parameters.free_param

    def counted(param):
        count[0] += 1
        release(param)

    partition_parameters.free_param = counted
    return count


def weights_on_partitions(optimizer, model) -> dict:
    """After a step on one rank: how many weights are views of their partitions (the storage the step updates), and
    the largest difference between any weight and its fp32 master copy cast to the weight's dtype."""
    on, gap = 0, 0.0
    for param in model.parameters():
        on += param.data.data_ptr() == param.ds_tensor.data_ptr()
    for group, masters in zip(optimizer.fp16_groups, optimizer.fp32_partitioned_groups_flat):
        for param, master in zip(group, optimizer.unflatten(masters, group)):
            gap = max(gap, float((param.data - master.to(param.dtype).view(param.shape)).abs().max()))
    return {"weights": sum(1 for _ in model.parameters()), "on_partitions": on, "max_gap_to_masters": gap}


def compare_grad_norms(optimizer) -> list:
    """Install pretrain.grad_norm's fused norm, and have each call of it also take DeepSpeed's own on the same
    partitions (every rank, the same collectives in the same order); the (fused, DeepSpeed's) pairs, appended."""
    from pretrain.grad_norm import fuse_grad_norm

    deepspeeds = type(optimizer).get_grad_norm_direct.__get__(optimizer)
    if not fuse_grad_norm(optimizer):
        return ["not installed"]
    fused, pairs = optimizer.get_grad_norm_direct, []

    def both(gradients, params, norm_type=2):
        expected = deepspeeds(gradients, params, norm_type)
        got = fused(gradients, params, norm_type)
        pairs.append((float(got), float(expected)))
        return got

    optimizer.get_grad_norm_direct = both
    return pairs


def run_ranks(tmp_path: Path, compile_regions: bool = False, nproc: int = 2, timeout: float = 180) -> dict:
    """Run `rank_main` as `nproc` gloo ranks on this machine (pretrain's rank environment); rank 0's report."""
    from pretrain.ranks import free_port, local_rank_environ

    report, port = tmp_path / "report.json", free_port()
    argv = [sys.executable, __file__, str(report)] + (["--compile"] if compile_regions else [])
    logs = [tmp_path / f"rank-{rank}.log" for rank in range(nproc)]
    ranks = []
    for rank, log in enumerate(logs):
        with log.open("w") as output:
            ranks.append(subprocess.Popen(argv, env=local_rank_environ(rank, nproc, port, OMP_NUM_THREADS="1"),
                                          stdout=output, stderr=subprocess.STDOUT))
    try:
        for process in ranks:
            process.wait(timeout=timeout)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, log in zip(ranks, logs):
        assert process.returncode == 0, f"{log}:\n{log.read_text()[-4000:]}"
    return json.loads(report.read_text())


def test_zero3_on_one_rank_updates_its_weights_in_place_on_their_partitions(tmp_path):
    """One rank, every weight resident (`build_ds_config`'s default there): after `drop_idle_module_hooks` no step
    releases a weight (DeepSpeed's would release all of them and gather them again), every weight is a view of
    its partition after every step and equals the optimizer's fp32 master weights: the step's copy into the
    partitions updated them in place. A weight released between steps is back on its partition after a forward."""
    result = run_ranks(tmp_path, nproc=1)
    assert result["dropped"] is True
    assert len(result["on_partitions"]) == 3
    for step in result["on_partitions"]:
        assert step["releases"] == 0, step
        assert step["on_partitions"] == step["weights"] > 0, step
        assert step["max_gap_to_masters"] == 0.0, step
    assert all(loss == loss and 0 < loss < 20 for loss in result["losses"])
    assert result["losses"][-1] != result["losses"][0]      # the weights did change
    assert result["after_release"] == {"released": True, "on_partition": True}


def outside_blocks(preset: str) -> int:
    """Modules of `preset` that are not inside a Block (the Blocks themselves included)."""
    from pretrain.model.t5 import build

    return sum(1 for name, _ in build(preset).named_modules() if not re.search(r"\.blocks\.\d+\.", name))


def test_zero3_hooks_each_block_as_one_unit_and_keeps_its_trace(tmp_path):
    result = run_ranks(tmp_path)
    assert result["hooked_modules"] == outside_blocks("t5-tiny")      # 15 of t5-tiny's 57 modules
    # step 1 follows deepspeed.initialize's invalidation, step 2 records the trace, step 3 replays it unbroken
    assert result["trace_complete"][1:] == [True, True]
    assert all(loss == loss and 0 < loss < 20 for loss in result["losses"])
    # the fused gradient norm over 2 ranks' partitions, against DeepSpeed's own at every step
    norms = result["grad_norms"]
    assert len(norms) >= 3 and all(fused > 0 for fused, _ in norms), norms
    assert all(fused == pytest.approx(expected, rel=1e-12) for fused, expected in norms), norms


@pytest.mark.slow   # ./scripts/test.sh -m slow (the default suite stays under CI's 20 minutes)
def test_compiled_blocks_stay_one_graph_each_under_zero3(tmp_path):
    result = run_ranks(tmp_path, compile_regions=True)
    assert "zero3_linear_wrap" not in result["linear"], result["linear"]  # torch's F.linear is in the graphs
    counters = result["dynamo_counters"]
    assert "graph_break" not in counters, counters.get("graph_break")
    assert counters["stats"]["unique_graphs"] == 3, counters     # encoder block, decoder block, loss chunk
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 3
    assert result["hooked_modules"] == outside_blocks("t5-tiny")
    losses = result["losses"]
    assert len(losses) == 2 and all(loss == loss and 0 < loss < 20 for loss in losses)


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), compile_regions="--compile" in sys.argv[2:])


def test_the_gather_units_the_settings_offer_are_the_ones_the_build_knows():
    from pretrain.config import GATHER_UNITS
    from pretrain.model.zero3 import GATHER_UNITS as BUILD_UNITS

    assert tuple(BUILD_UNITS) == GATHER_UNITS
