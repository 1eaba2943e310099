"""Launch shapes and run configuration: flags over YAML, the DeepSpeed config, the LR schedule, rank environments,
and a two-node torchrun rendezvous simulated on one machine (real DeepSpeed, gloo, 1 process per "node").

    .venv/bin/python -m pytest tests/pretrain/test_launch.py -q
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.common import REPO_ROOT, UserError
from pretrain.cli import resolve_config
from pretrain.ds_config import build_ds_config
from pretrain.launch import last_error_line
from pretrain.ranks import free_port, rank_env, slurm_rank_environ
from pretrain.metrics import read_metrics
from pretrain.trainer import LRSchedule

BASE = ["--data", "shards/x", "--out", "runs/x"]


def test_flags_override_yaml_and_yaml_overrides_defaults(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("zero: 3\nmicro-batch: 2\nglobal_batch: 16\nlr: 0.01\nschedule: linear\n"
                           "deepspeed:\n  zero_optimization:\n    stage3_max_live_parameters: 123\n")
    config = resolve_config(BASE + ["--config", str(config_file), "--lr", "0.5", "--fp32"])
    assert (config.zero, config.micro_batch, config.global_batch, config.schedule) == (3, 2, 16, "linear")
    assert config.lr == 0.5 and config.precision == "fp32" and config.offload == "none"
    ds = build_ds_config(config, world_size=2, grad_accum=config.grad_accum(2), accelerator="cpu")
    assert ds["zero_optimization"]["stage3_max_live_parameters"] == 123     # the YAML deepspeed: block, merged last
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000   # from configs/deepspeed/zero3.yaml


@pytest.mark.parametrize("argv, message", [
    (["--zero", "0", "--offload", "cpu"], "needs ZeRO stage 1"),
    (["--zero", "2", "--offload", "nvme", "--nvme-path", "/nvme"], "needs --zero 3"),
    (["--zero", "3", "--offload", "nvme"], "--nvme-path"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--adam-beta1", "1.5"], "--adam-beta1 and --adam-beta2 must be in"),
    (["--adam-beta2", "-0.1"], "--adam-beta1 and --adam-beta2 must be in"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0"),
    (["--zero", "3", "--stage3-prefetch-bucket-size", "-1"], "--stage3-prefetch-bucket-size must be >= 0"),
    (["--input-length", "-1"], "--input-length must be > 0"),
    (["--precision", "bf16", "--fp32"], "--fp32 and --precision bf16 say different things"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--seed", str(2**64)], "--seed must be >= 0 and < 2"),
    (["--cache-dir", "cache"], "--cache-dir holds the local copy of a shard set read from a URL"),
    (["--cudagraphs"], "--cudagraphs replays the compiled blocks: add --compile"),
    (["--compile", "--cudagraphs", "--zero", "3"], "ZeRO 3 gathers each block's weights to new addresses"),
    (["--compile", "--cudagraphs", "--activation-checkpointing"], "--cudagraphs with --activation-checkpointing"),
])
def test_bad_settings_are_refused_with_one_clear_line(argv, message):
    with pytest.raises(UserError, match=message):
        resolve_config(BASE + argv)


@pytest.mark.parametrize("argv, cuda, on", [
    (["--compile"], True, True),                                   # auto: a compiled ZeRO 0-2 run on CUDA
    (["--compile", "--zero", "0"], True, True),
    (["--compile"], False, False),                                 # the CPU runs the same code without graphs
    ([], True, False),                                             # nothing compiled to replay
    (["--compile", "--zero", "3"], True, False),                   # gathers to new addresses every step
    (["--compile", "--activation-checkpointing"], True, False),    # the recomputed forward runs outside them
    (["--compile", "--offload", "cpu"], True, False),              # the step waits on CPU-Adam; not measured
    (["--compile", "--no-cudagraphs"], True, False),
    (["--compile", "--cudagraphs", "--offload", "cpu"], True, True),   # asked for: as given
    (["--compile", "--cudagraphs"], False, True),
])
def test_cudagraphs_auto_is_on_where_the_blocks_can_be_graphs(argv, cuda, on):
    assert resolve_config(BASE + argv).graphs_on(cuda=cuda) is on


def test_cudagraphs_auto_leaves_graphs_off_where_the_estimate_nearly_fills_the_gpu():
    """Their private pools come on top of the estimate: auto takes them up to AUTO_GRAPHS_MEMORY_SHARE of a GPU;
    asked for, they are on at any share; an unknown share (no estimate) does not hold auto back."""
    from pretrain.config import AUTO_GRAPHS_MEMORY_SHARE
    auto, asked = resolve_config(BASE + ["--compile"]), resolve_config(BASE + ["--compile", "--cudagraphs"])
    assert auto.graphs_on(cuda=True, memory_share=0.38) and auto.graphs_on(cuda=True, memory_share=None)
    assert auto.graphs_on(cuda=True, memory_share=AUTO_GRAPHS_MEMORY_SHARE)
    assert not auto.graphs_on(cuda=True, memory_share=0.865)         # mt5-xl ZeRO 2, micro 32, on an H200
    assert asked.graphs_on(cuda=True, memory_share=0.865)


def test_an_nvme_path_that_is_a_file_is_refused(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(UserError, match="is a file; it must be a directory"):
        resolve_config(BASE + ["--zero", "3", "--offload", "nvme", "--nvme-path", str(a_file)])


def test_yaml_with_unknown_keys_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero: 2\nmicro_bacth: 4\n")
    with pytest.raises(UserError, match=r"unknown keys \['micro_bacth'\]"):
        resolve_config(BASE + ["--config", str(bad)])


def test_deepspeed_config_follows_the_flags():
    config = resolve_config(BASE + ["--zero", "3", "--offload", "nvme", "--nvme-path", "/local_nvme", "--micro-batch",
                                    "4", "--global-batch", "64", "--grad-clip", "0.5",
                                    "--stage3-prefetch-bucket-size", "1000", "--stage3-param-persistence-threshold",
                                    "10"])
    assert config.grad_accum(2) == 8
    gpu = build_ds_config(config, world_size=2, grad_accum=8, accelerator="gpu")
    assert gpu["train_batch_size"] == 64 and gpu["train_micro_batch_size_per_gpu"] == 4
    assert gpu["gradient_accumulation_steps"] == 8 and gpu["gradient_clipping"] == 0.5
    assert gpu["bf16"] == {"enabled": True} and "torch_adam" not in gpu["optimizer"]["params"]  # FusedAdam / CPUAdam
    zero = gpu["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/local_nvme"}
    assert zero["offload_param"]["device"] == "nvme"
    assert zero["stage3_prefetch_bucket_size"] == 1000 and zero["stage3_param_persistence_threshold"] == 10
    cpu = build_ds_config(resolve_config(BASE + ["--zero", "1"]), world_size=2, grad_accum=1, accelerator="cpu")
    assert cpu["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                             "weight_decay": 0.0, "torch_adam": True}}
    assert cpu["bf16"] == {"enabled": False} and cpu["zero_optimization"]["stage"] == 1
    with pytest.raises(UserError, match="not a multiple"):
        resolve_config(BASE + ["--micro-batch", "3", "--global-batch", "16"]).grad_accum(2)
    with pytest.raises(UserError, match="--zero 3 only"):
        resolve_config(BASE + ["--zero", "2", "--stage3-max-live-parameters", "5"])   # before any rank is spawned


def test_zero3_on_one_rank_keeps_every_weight_resident():
    """A world of one has nothing to partition: unless told otherwise, ZeRO 3 keeps the weights gathered."""
    def threshold(argv, world_size):
        config = resolve_config(BASE + ["--zero", "3", *argv])
        ds = build_ds_config(config, world_size=world_size, grad_accum=1, accelerator="gpu")
        return ds["zero_optimization"]["stage3_param_persistence_threshold"]

    assert threshold([], 1) == 10 ** 12
    assert threshold([], 2) == 100_000                                        # configs/deepspeed/zero3.yaml
    assert threshold(["--offload", "cpu"], 1) == 100_000                      # the weights are to live on the host
    assert threshold(["--stage3-param-persistence-threshold", "10"], 1) == 10


def test_lr_schedules():
    warm = [LRSchedule("cosine", 4, 20, 0.1)(s) for s in range(20)]
    assert warm[:4] == [0.25, 0.5, 0.75, 1.0] and warm[-1] == pytest.approx(0.1) and warm[4] < 1.0
    assert all(a >= b for a, b in zip(warm[3:], warm[4:]))
    linear = [LRSchedule("linear", 0, 10, 0.0)(s) for s in range(10)]
    assert linear[-1] == pytest.approx(0.0) and linear[0] == pytest.approx(0.9)
    inverse = LRSchedule("inverse_sqrt", 100, 1000, 0.0)
    assert inverse(99) == 1.0 and inverse(399) == pytest.approx(0.5)
    assert LRSchedule("constant", 0, 5, 0.1)(4) == 1.0


def test_rank_environment_as_torchrun_sets_it():
    assert rank_env({}).launched is False and rank_env({}).world_size == 1
    env = rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launched) == (3, 1, 4, 2, True)
    assert not env.is_main
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))   # still free


def test_ranks_of_an_srun_step_come_from_the_slurm_variables():
    step = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_STEP_ID": "0", "MASTER_ADDR": "node1"}
    env = rank_env(step)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launched) == (3, 1, 4, 2, True)
    assert slurm_rank_environ(step)["MASTER_PORT"] == "29500"
    assert not rank_env({**step, "SLURM_STEP_ID": "batch"}).launched      # the batch script spawns with --nproc
    assert not rank_env({k: v for k, v in step.items() if k != "MASTER_ADDR"}).launched
    assert rank_env({**step, "RANK": "0", "WORLD_SIZE": "1"}).world_size == 1   # torchrun's variables win


def test_failure_reason_is_the_rank_logs_last_error(tmp_path):
    log = tmp_path / "rank-1.log"
    log.write_text("[WARNING] noise\ncli.py: error: out of memory on rank 1 (...); try ...\n")
    assert last_error_line(log).startswith("out of memory on rank 1")
    log.write_text("Traceback (most recent call last):\n  File x\nRuntimeError: gloo timeout\n")
    assert last_error_line(log) == "RuntimeError: gloo timeout"
    log.write_text("[rank0]: Traceback (most recent call last):\n[rank0]:   File x\n[rank0]: pydantic_core._pydantic_core."
                   "ValidationError: 1 validation error for DeepSpeedZeroConfig\n[rank0]: stage3_max_live_parameters\n"
                   "[rank0]:   Input should be greater than or equal to 0\n"
                   "[rank0]:     For further information visit https://errors.pydantic.dev/2.14/v/greater_than_equal\n")
    assert last_error_line(log) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                                    "DeepSpeedZeroConfig")


def test_two_node_rendezvous_with_torchrun_on_one_machine(tiny_shards, tmp_path):
    """Two torchrun agents (--nnodes 2, node ranks 0 and 1, one process each) meet at 127.0.0.1:PORT."""
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    out = tmp_path / "two_nodes"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(
        [str(torchrun), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr",
         "127.0.0.1", "--master-port", str(port), "-m", "pretrain.cli", "--zero", "1", "--model", "t5-tiny",
         "--data", str(tiny_shards), "--out", str(out), "--steps", "2", "--micro-batch", "4", "--global-batch", "16",
         "--seed", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT) for node in (0, 1)]
    try:
        results = [agent.communicate(timeout=240) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, (stdout, stderr) in zip(agents, results):
        assert agent.returncode == 0, f"{stdout[-2000:]}\n{stderr[-3000:]}"
    assert "[preflight]" in results[0][0] and "[done] ok" in results[0][0]
    assert "[done]" not in results[1][0]                    # only global rank 0 reports
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["world_size"] == 2 and r["grad_accum"] == 2 and r["zero_stage"] == 1 for r in records)
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["deepspeed"]["train_batch_size"] == 16


def test_the_closing_line_of_a_run_whose_last_loss_is_not_finite():
    from pretrain.trainer import final_summary_line

    summary = {"status": "ok", "steps": 2, "total_steps": 2, "steady_steps": 1, "final_loss": None,
               "median": {"mfu": None, "tokens_per_s": 10.0, "tflops_per_gpu": 0.1}, "data_wait_share": 0.0,
               "peak_mem_gib": 1.0, "memory_estimate": {"per_gpu_gib": 1.0}, "wall_s": 3.0}
    assert "final loss not finite;" in final_summary_line(summary)
    assert "final loss 2.5000;" in final_summary_line({**summary, "final_loss": 2.5})
