"""Host-side accounting of one rank, per step, from its process tree; and core binding for `--cpu-affinity split`.

    meter = HostMeter(loader)              # loader: pretrain.data ShardLoader / OnlineLoader (its worker pids)
    meter.start_step(); with meter.loading(): batch = next(batches) ...; with meter.optimizer(): engine.step()
    record.update(meter.end_step(step_time_s))

Roles (CPU seconds, user + system, within the step), which sum to the CPU of the rank and its loader workers:
- `cpu_loader_workers_s`: the DataLoader worker processes (children of the rank; psutil, by pid).
- `cpu_loader_inline_s`: the rank's loop thread inside next(loader) (all the loading with 0 workers; the hand-over
  from the workers otherwise), `time.thread_time`.
- `cpu_optimizer_s`: the whole rank process (every thread) inside the optimizer step calls: DeepSpeed's CPU-Adam,
  whose OpenMP threads are threads of the rank, under `--offload cpu`. Linux does not tell which OpenMP thread
  works for which caller, so the attribution is by time window, not by thread: anything else the rank's threads
  do in that window (a communication thread, the pin-memory thread) is counted here too.
- `cpu_train_s`: the rest of the rank: forward and backward (loop thread and intra-op threads), communication.
`cpu_rank_s` is the rank's total; `cpu_helper_threads_s` the rank's total minus what the loop thread used.
`loader_cores` = loader CPU / step time (host cores loading keeps busy at this step's consumption rate);
`loader_busy_share` = loader CPU / (step time x workers): the share of their time the workers spent producing (for
single-threaded workers; 1 / share is the headroom before data wait appears); with 0 workers, the loop thread's
loading over the step. `loader_rss_gib`: resident memory of the workers, summed (shared pages count once per worker).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

from pipeline.common import UserError

HOST_KEYS = ("cpu_loader_workers_s", "cpu_loader_inline_s", "cpu_optimizer_s", "cpu_train_s", "cpu_rank_s",
             "cpu_helper_threads_s", "loader_cores", "loader_busy_share", "loader_rss_gib")


class HostMeter:
    """Per-step CPU seconds by role for this rank and its loader workers (module docstring)."""

    def __init__(self, loader, num_workers: int):
        self.loader = loader
        self.num_workers = num_workers
        self._processes: dict[int, Any] = {}
        self._workers_at_start: dict[int, float] = {}

    def _workers(self) -> tuple[dict[int, float], int]:
        """{pid: CPU seconds so far} and summed RSS of the loader's live worker processes."""
        import psutil

        cpu, rss = {}, 0
        for pid in self.loader.worker_pids():
            try:
                process = self._processes.get(pid) or self._processes.setdefault(pid, psutil.Process(pid))
                times = process.cpu_times()
                cpu[pid] = times.user + times.system
                rss += process.memory_info().rss
            except psutil.Error:           # a worker that just exited: its last seconds are lost
                continue
        return cpu, rss

    def start_step(self) -> None:
        self._workers_at_start = self._workers()[0]
        self._rank_at_start = time.process_time()
        self._thread_at_start = time.thread_time()
        self._inline = 0.0
        self._optimizer = 0.0

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        start = time.thread_time()
        try:
            yield
        finally:
            self._inline += time.thread_time() - start

    @contextlib.contextmanager
    def optimizer(self) -> Iterator[None]:
        start = time.process_time()
        try:
            yield
        finally:
            self._optimizer += time.process_time() - start

    def end_step(self, step_time_s: float) -> dict[str, float]:
        rank = time.process_time() - self._rank_at_start
        thread = time.thread_time() - self._thread_at_start
        now, rss = self._workers()
        workers = sum(cpu - self._workers_at_start.get(pid, 0.0) for pid, cpu in now.items())
        loading = workers + (self._inline if self.num_workers == 0 else 0.0)
        wall = max(step_time_s, 1e-9)
        return {"cpu_loader_workers_s": workers, "cpu_loader_inline_s": self._inline,
                "cpu_optimizer_s": self._optimizer,
                "cpu_train_s": max(0.0, rank - self._inline - self._optimizer), "cpu_rank_s": rank,
                "cpu_helper_threads_s": max(0.0, rank - thread),
                "loader_cores": loading / wall, "loader_busy_share": loading / (wall * max(1, self.num_workers)),
                "loader_rss_gib": rss / (1 << 30)}


# -- core binding (--cpu-affinity split) ---------------------------------------------------------------------------

def split_cores(allowed: list[int], *, local_rank: int, local_world_size: int, workers: int
                ) -> tuple[list[int], list[list[int]]]:
    """(this rank's cores, one core per loader worker of this rank): the last local_world_size x workers cores go to
    the loader workers, one each; the others are split evenly between the local ranks."""
    allowed = sorted(allowed)
    worker_total = local_world_size * workers
    rank_total = len(allowed) - worker_total
    if rank_total < local_world_size:
        raise UserError(f"--cpu-affinity split needs {local_world_size} x {workers} loader-worker cores plus at least "
                        f"one per rank, this process may use {len(allowed)}; lower --loader-workers or use "
                        f"--cpu-affinity none")
    per_rank = rank_total // local_world_size
    rank_cores = allowed[local_rank * per_rank:(local_rank + 1) * per_rank]
    worker_cores = allowed[rank_total + local_rank * workers:rank_total + (local_rank + 1) * workers]
    return rank_cores, [[core] for core in worker_cores]


def bind_rank(cpu_affinity: str, *, local_rank: int, local_world_size: int, workers: int
              ) -> tuple[dict[str, Any], list[list[int]] | None]:
    """Apply `--cpu-affinity` to every thread of this rank now (threads made later inherit it); -> (what was done,
    for config.json; the loader workers' cores or None)."""
    if cpu_affinity == "none":
        return {"cpu_affinity": "none"}, None
    allowed = sorted(os.sched_getaffinity(0))
    rank_cores, worker_cores = split_cores(allowed, local_rank=local_rank, local_world_size=local_world_size,
                                           workers=workers)
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):       # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), rank_cores)
    return {"cpu_affinity": cpu_affinity, "rank_cores": rank_cores,
            "worker_cores": [c[0] for c in worker_cores]}, worker_cores or None


def set_omp_threads(threads: int | None, set_num_threads) -> None:
    """`--omp-num-threads`: OpenMP's and torch's intra-op thread count (DeepSpeed's CPU-Adam reads OMP_NUM_THREADS
    when its op is loaded, at deepspeed.initialize); `set_num_threads` is torch's (this module imports no torch:
    the study reads HOST_KEYS from it)."""
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    set_num_threads(threads)
