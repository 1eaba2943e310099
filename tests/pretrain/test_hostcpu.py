"""Host accounting (pretrain.hostcpu): the roles sum to what psutil sees for the process tree; core binding.

    .venv/bin/python -m pytest tests/pretrain/test_hostcpu.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from pipeline.common import UserError
from pipeline.synthetic_shards import write_shard_set
from pretrain.data.dataset import ShardDataset
from pretrain.data.loader import make_loader
from pretrain.hostcpu import HostMeter, split_cores


def tree_cpu(process: psutil.Process, pids: list[int]) -> float:
    total = sum(process.cpu_times()[:2])
    return total + sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def test_roles_sum_to_the_process_tree_that_psutil_sees(tmp_path):
    write_shard_set(tmp_path / "set", shard_rows=[600] * 4, input_length=2048, target_length=16)
    dataset = ShardDataset(tmp_path / "set")
    me = psutil.Process()
    with make_loader(dataset, micro_batch_size=64, global_batch_size=128, seed=0, num_workers=2,
                     prefetch_factor=1) as loader:
        batches = iter(loader)
        next(batches)                                   # workers started
        meter = HostMeter(loader, num_workers=2)
        pids = loader.worker_pids()
        assert len(pids) == 2 and all(psutil.Process(p).ppid() == os.getpid() for p in pids)
        before = tree_cpu(me, pids)
        records = []
        matrix = torch.randn(256, 256)
        for _ in range(6):
            meter.start_step()
            started = time.perf_counter()
            for _ in range(2):
                with meter.loading():
                    next(batches)
                for _ in range(20):                     # "forward/backward"
                    matrix = torch.tanh(matrix @ matrix)
                with meter.optimizer():                 # "optimizer": work on the rank's threads
                    np.sort(np.random.default_rng(0).random(300_000))
            records.append(meter.end_step(time.perf_counter() - started))
        after = tree_cpu(me, pids)
    roles = sum(r["cpu_loader_workers_s"] + r["cpu_loader_inline_s"] + r["cpu_optimizer_s"] + r["cpu_train_s"]
                for r in records)
    assert roles == pytest.approx(after - before, rel=0.1, abs=0.05)
    assert all(r["cpu_optimizer_s"] > 0 and r["cpu_train_s"] > 0 for r in records)
    assert loader.fetch_group < 12                      # the workers produced groups during the steps
    assert all(r["loader_rss_gib"] > 0 and 0 <= r["loader_busy_share"] <= r["loader_cores"] for r in records)
    assert all(r["cpu_rank_s"] == pytest.approx(r["cpu_loader_inline_s"] + r["cpu_optimizer_s"] + r["cpu_train_s"])
               for r in records)


def test_split_cores_gives_workers_one_core_each_and_ranks_the_rest():
    rank_cores, worker_cores = split_cores(list(range(16)), local_rank=1, local_world_size=2, workers=3)
    assert rank_cores == [5, 6, 7, 8, 9] and worker_cores == [[13], [14], [15]]
    assert split_cores([0, 1], local_rank=0, local_world_size=1, workers=0) == ([0, 1], [])
    with pytest.raises(UserError, match="--cpu-affinity split needs 2 x 1"):
        split_cores([0, 1], local_rank=0, local_world_size=2, workers=1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_bind_rank_pins_every_thread_and_the_workers(tmp_path):
    code = ("import os; from pretrain.hostcpu import bind_rank\n"
            "note, workers = bind_rank('split', local_rank=0, local_world_size=1, workers=1)\n"
            "tasks = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')]\n"
            "print(note['rank_cores'], workers, all(t == note['rank_cores'] for t in tasks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    cores = sorted(os.sched_getaffinity(0))
    assert out[-1] == "True" and out[-2] == f"[[{cores[-1]}]]"
