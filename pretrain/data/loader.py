"""ShardLoader: int64 micro-batches of a ShardDataset forever, epoch after epoch, resumable exactly.

    loader = make_loader(ShardDataset("shards/demo"), micro_batch_size=8, global_batch_size=64, seed=0)

`make_loader` builds a `GlobalOrderSampler` for this rank and a `ShardLoader` over it, which wraps a torch
`DataLoader`; it counts what the consumer took, so `state_dict()` after an optimizer step is exact and
`load_state_dict()` resumes at the next global batch, at the same or another world size. Each DataLoader task
gathers a group of consecutive micro-batches (about FETCH_BYTES) into one tensor, so a worker sends one
message per group instead of two tensors per micro-batch.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from pipeline.common import UserError
from pretrain.data.dataset import ShardDataset
from pretrain.data.sampler import GlobalOrderSampler, ShardOrderSampler

FETCH_BYTES = 4 << 20  # size of one DataLoader task: a group of consecutive micro-batches, as one tensor
USER_ERROR_LINE = "pipeline.common.UserError: "


class WorkerInit:
    """A DataLoader worker's start: pin it to its core (`cores[worker_id]`, when given), keep HF tokenizers to
    one thread (one loader worker = one core; what `--loader-workers` counts), and leave the preemption signals
    (SIGTERM, SIGUSR1, SIGINT) to its rank: srun and torchrun signal the whole process group, and the rank saves a
    checkpoint before it ends its workers (torch's workers exit when their rank does). Picklable."""

    def __init__(self, cores: list[list[int]] | None = None):
        self.cores = cores

    def __call__(self, worker_id: int) -> None:
        import os

        import signal

        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        if self.cores:
            os.sched_setaffinity(0, self.cores[worker_id % len(self.cores)])


def one_line_user_errors(batches: Iterator[Any]) -> Iterator[Any]:
    """`batches`, with a UserError raised in a DataLoader worker (which torch re-raises wrapped in the worker's
    traceback) raised again as the one line the worker wrote."""
    try:
        yield from batches
    except UserError as err:
        lines = [line for line in str(err).splitlines() if line.startswith(USER_ERROR_LINE)]
        if lines:
            raise UserError(lines[-1][len(USER_ERROR_LINE):]) from None
        raise


class LoaderProcesses:
    """What the host accounting reads from a loader: its worker processes and the time to its first batch."""

    dataloader: DataLoader | None = None
    first_batch_s: float | None = None
    per_rank_state = False          # True when state_dict() differs between ranks (the trainer gathers them)

    def worker_pids(self) -> list[int]:
        """The pids of the DataLoader worker processes now running (none with 0 workers or before iterating)."""
        iterator = getattr(self.dataloader, "_iterator", None)
        workers = getattr(iterator, "_workers", None) or []
        return [w.pid for w in workers if w.pid is not None]

    def _shutdown_workers(self) -> None:
        iterator = getattr(self.dataloader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        if self.dataloader is not None:
            self.dataloader._iterator = None

    def _mark_first_batch(self) -> None:
        if self.first_batch_s is None:
            self.first_batch_s = time.perf_counter() - self._created


def data_loader(dataset, *, num_workers: int, pin_memory: bool, prefetch_factor: int, persistent_workers: bool,
                seed: int, worker_cores: list[list[int]] | None, **kwargs) -> DataLoader:
    """The torch DataLoader under both loaders: its own seeded generator (global RNG stays untouched)."""
    workers = num_workers > 0
    return DataLoader(dataset, num_workers=num_workers, pin_memory=pin_memory,
                      prefetch_factor=prefetch_factor if workers else None,
                      persistent_workers=persistent_workers and workers,
                      worker_init_fn=WorkerInit(worker_cores) if workers else None,
                      generator=torch.Generator().manual_seed(seed), **kwargs)


class _MicroBatchGroups:
    """Batch sampler: this rank's micro-batches of the current epoch from the loader's position, in groups.

    A group is up to `group` consecutive micro-batches (aligned to multiples of `group` from the epoch's
    start) as one [n_micro, micro_batch_size] index array: one worker task, one inter-process message.
    """

    def __init__(self, sampler: GlobalOrderSampler, micro_batch_size: int, group: int):
        self.sampler = sampler
        self.micro_batch_size = micro_batch_size
        self.group = group

    def __iter__(self) -> Iterator[np.ndarray]:
        micro_batches = self.sampler.epoch_indices(self.sampler.epoch).reshape(-1, self.micro_batch_size)
        first = self.sampler.rank_position // self.micro_batch_size
        cuts = np.arange(-(-first // self.group) * self.group, len(micro_batches), self.group)
        yield from (g for g in np.split(micro_batches[first:], cuts[cuts > first] - first) if len(g))

    def __len__(self) -> int:
        return -(-len(self.sampler) // (self.micro_batch_size * self.group))


class _PackedFetch:
    """Dataset view for the DataLoader: a group of micro-batches -> one flat int64 tensor (inputs, then labels).

    One tensor (one storage) per task keeps the worker->main hand-over and the pinning to a single buffer.
    """

    def __init__(self, dataset: ShardDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, group: np.ndarray) -> torch.Tensor:
        rows = group.size
        input_size = rows * self.dataset.input_length
        packed = torch.empty(input_size + rows * self.dataset.target_length, dtype=torch.int64)
        flat = packed.numpy()
        self.dataset.get_batch(group.reshape(-1), out=(flat[:input_size].reshape(rows, -1),
                                                       flat[input_size:].reshape(rows, -1)))
        return packed


def _collate_packed(packed: torch.Tensor) -> torch.Tensor:
    return packed  # _PackedFetch already returns the one tensor of the group


class ShardLoader(LoaderProcesses):
    """Micro-batches {"input_ids", "labels"} (int64 tensors) forever; resumable. Build it with `make_loader`.

    `grad_accum` micro-batches make this rank's share of one global batch. Each DataLoader task fetches a
    group of `fetch_group` consecutive micro-batches (about FETCH_BYTES) as one tensor, so a worker hands
    over one message per group and `prefetch_factor` counts groups. Positions are counted as the consumer
    receives each micro-batch, never when a worker prefetches it.
    """

    def __init__(self, dataset: ShardDataset, sampler: GlobalOrderSampler, micro_batch_size: int, *,
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2,
                 persistent_workers: bool = True, worker_cores: list[list[int]] | None = None):
        self._created = time.perf_counter()
        if micro_batch_size < 1 or sampler.rank_batch_size % micro_batch_size:
            raise UserError(f"micro batch {micro_batch_size} does not divide the per-rank batch "
                            f"{sampler.rank_batch_size} (global batch {sampler.global_batch_size} / world size "
                            f"{sampler.world_size}); pick --micro-batch that divides it")
        self.dataset = dataset
        self.sampler = sampler
        self.micro_batch_size = micro_batch_size
        self.grad_accum = sampler.rank_batch_size // micro_batch_size
        self.num_workers = num_workers
        micro_bytes = 8 * micro_batch_size * (dataset.input_length + dataset.target_length)
        # a streamed set reads shard after shard: one micro-batch per task, so no task reaches far ahead
        self.fetch_group = 1 if dataset.streamer is not None else max(1, FETCH_BYTES // micro_bytes)
        self._groups = _MicroBatchGroups(sampler, micro_batch_size, self.fetch_group)
        self.dataloader = data_loader(_PackedFetch(dataset), batch_sampler=self._groups, collate_fn=_collate_packed,
                                      num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                                      persistent_workers=persistent_workers, seed=sampler.seed,
                                      worker_cores=worker_cores)
        self._iterating = False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._iterating = True
        sampler, micro = self.sampler, self.micro_batch_size
        input_length, target_length = self.dataset.input_length, self.dataset.target_length
        while True:
            for packed in one_line_user_errors(iter(self.dataloader)):
                self._mark_first_batch()
                rows = packed.numel() // (input_length + target_length)
                inputs = packed[:rows * input_length].view(rows, input_length)
                labels = packed[rows * input_length:].view(rows, target_length)
                for start in range(0, rows, micro):
                    sampler.rank_position += micro  # counted as the consumer takes it
                    yield {"input_ids": inputs[start:start + micro], "labels": labels[start:start + micro]}
            sampler.next_epoch()

    def close(self) -> None:
        """Shut down the worker processes now (they also stop when the loader is garbage-collected)."""
        self._shutdown_workers()
        if self.dataset.streamer is not None:
            self.dataset.streamer.stop()

    def __enter__(self) -> "ShardLoader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def state_dict(self) -> dict[str, int]:
        """{seed, epoch, consumed_samples}; exact after an optimizer step (a global-batch boundary)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state`; call before iterating."""
        if self._iterating:
            raise RuntimeError("load_state_dict must be called before iterating the loader")
        self.sampler.load_state_dict(state)
        if self.sampler.rank_position % self.micro_batch_size:
            raise UserError(f"sampler state {dict(state)} stops inside a micro-batch of "
                            f"{self.micro_batch_size}; resume from a checkpoint saved after an optimizer step")
        self.dataloader.generator.manual_seed(self.sampler.seed)


def make_loader(dataset: ShardDataset, *, micro_batch_size: int, global_batch_size: int, seed: int,
                rank: int = 0, world_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
                prefetch_factor: int = 2, persistent_workers: bool = True,
                worker_cores: list[list[int]] | None = None) -> ShardLoader:
    """A `ShardLoader` for this rank: GlobalOrderSampler + micro-batches gathered by `dataset.get_batch`.

    A streaming dataset (`ShardDataset(url, streamer=...)`, the `remote` mode) gets a ShardOrderSampler (shard after
    shard) and its streamer starts following it."""
    if dataset.streamer is not None:
        sampler = ShardOrderSampler(dataset.shard_rows, global_batch_size, seed, rank=rank, world_size=world_size)
    else:
        sampler = GlobalOrderSampler(len(dataset), global_batch_size, seed, rank=rank, world_size=world_size)
    loader = ShardLoader(dataset, sampler, micro_batch_size, num_workers=num_workers, pin_memory=pin_memory,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         worker_cores=worker_cores)
    if dataset.streamer is not None:
        dataset.streamer.start(sampler)
    return loader
