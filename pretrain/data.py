"""The shard loader: memory-mapped span-corruption examples, a world-size-independent global order, exact resume.

    loader = make_loader(ShardDataset("shards/demo"), micro_batch_size=8, global_batch_size=64, seed=0)

- `ShardDataset` maps every Arrow stream shard of a set once and indexes rows through a cumulative row index;
  `ds[i]` returns zero-copy int32 rows, `ds.get_batch(indices)` gathers a micro-batch with one fancy-indexing
  call per record batch touched. An `s3://` URL is first resolved to a local cache (`pretrain.storage`).
- `GlobalOrderSampler` fixes the order of samples per epoch from (seed, epoch) alone; global batch k is
  perm[k*B:(k+1)*B] at every world size and rank r reads the r-th contiguous slice of it. The remainder
  `num_samples % B` of each epoch's permutation is dropped (a different remainder every epoch).
- `ShardLoader` (built by `make_loader`) wraps a torch `DataLoader` and yields int64 micro-batches forever,
  epoch after epoch; it counts what the consumer took, so `state_dict()` after an optimizer step is exact
  and `load_state_dict()` resumes at the next global batch, at the same or another world size. Each
  DataLoader task gathers a group of consecutive micro-batches (about FETCH_BYTES) into one tensor, so a
  worker sends one message per group instead of two tensors per micro-batch.

State: {"seed", "epoch", "consumed_samples"} where consumed_samples counts the global samples of `epoch`
already consumed (k*B after k global batches). Only states at a global-batch boundary resume at another world
size; a mid-batch state (k*B + q*world_size: every rank took q samples of its slice) resumes at the same one.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Sampler

from pipeline.common import UserError, sha256_file
from pipeline.shard_format import INPUT_COLUMN, LABEL_COLUMN, read_manifest
from pretrain.storage import is_url, resolve_shard_dir


class ShardDataset:
    """Map-style dataset over a shard set (local directory or fsspec URL); see the module docstring.

    Checks on open: manifest (format version), `input_length` / `target_length` / `tokenizer_sha256` when
    the caller gives them, presence and size of every shard; `verify=True` also recomputes sha256.
    The memory maps are opened lazily in each process (the dataset pickles without them).
    """

    def __init__(self, path_or_url: str | os.PathLike, *, input_length: int | None = None,
                 target_length: int | None = None, tokenizer_sha256: str | None = None, verify: bool = False,
                 cache_dir: str | os.PathLike | None = None, storage_options: dict[str, Any] | None = None):
        self.source = os.fspath(path_or_url)
        self.root = resolve_shard_dir(path_or_url, cache_dir=cache_dir, storage_options=storage_options,
                                      verify=verify)
        self.manifest = read_manifest(self.root)
        config = self.manifest["config"]
        self.input_length = int(config["input_length"])
        self.target_length = int(config["target_length"])
        self._check_expected(input_length, target_length, tokenizer_sha256)
        shards = self.manifest["shards"]
        if not shards:
            raise UserError(f"{self.root}: the manifest lists no shards (the corpus gave no examples); "
                            f"check `rejected` in manifest.json and rerun `prep corpus` on more text")
        hashed_by_cache = is_url(self.source)  # a URL's cache fill hashed every shard it downloaded or reused
        for shard in shards:
            self._check_shard_file(shard, verify and not hashed_by_cache)
        self.shard_paths = [str(self.root / s["path"]) for s in shards]
        self.shard_rows = np.array([int(s["rows"]) for s in shards], dtype=np.int64)
        self.num_examples = int(self.shard_rows.sum())
        self._chunks: list[tuple[np.ndarray, np.ndarray]] | None = None  # per record batch, lazily mapped
        self._chunk_offsets: np.ndarray | None = None

    def _check_expected(self, input_length, target_length, tokenizer_sha256) -> None:
        where = self.root / "manifest.json"
        if input_length is not None and int(input_length) != self.input_length:
            raise UserError(f"{where}: shards have input_length {self.input_length}, the run expects "
                            f"{input_length}; rebuild them with `prep corpus --input-length {input_length}` or "
                            f"use a matching set")
        if target_length is not None and int(target_length) != self.target_length:
            raise UserError(f"{where}: shards have target_length {self.target_length}, the run expects "
                            f"{target_length}; rebuild them with `prep corpus` at the --input-length / "
                            f"--noise-density / --mean-span-length that give it, or use a matching set")
        have_sha = self.manifest.get("tokenizer", {}).get("sha256")
        if tokenizer_sha256 is not None and have_sha != tokenizer_sha256:
            raise UserError(f"{where}: shards were made with tokenizer sha256 {str(have_sha)[:12]}.., the run "
                            f"uses {tokenizer_sha256[:12]}..; rebuild the shards with this tokenizer "
                            f"(`prep corpus --tokenizer ...`) or train with the tokenizer of the shards")

    def _check_shard_file(self, shard: dict[str, Any], verify: bool) -> None:
        path = self.root / shard["path"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise UserError(f"{path}: shard listed in {self.root}/manifest.json is missing; restore it or "
                            f"rebuild the shard set with `prep corpus`") from None
        if size != shard["bytes"]:
            raise UserError(f"{path}: {size} bytes, the manifest says {shard['bytes']} (truncated or replaced); "
                            f"rebuild the shard set with `prep corpus` (or re-copy it)")
        if verify and sha256_file(path) != shard["sha256"]:
            raise UserError(f"{path}: sha256 does not match {self.root}/manifest.json (corrupt shard); rebuild "
                            f"the shard set with `prep corpus` (or re-copy it)")

    # -- memory maps (opened lazily, once per process) ------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_chunks"] = None
        state["_chunk_offsets"] = None
        return state

    def _open(self) -> None:
        chunks: list[tuple[np.ndarray, np.ndarray]] = []
        for path, rows in zip(self.shard_paths, self.shard_rows):
            shard_chunks = _map_shard(path, self.input_length, self.target_length)
            got = sum(len(c[0]) for c in shard_chunks)
            if got != rows:
                raise UserError(f"{path}: {got} rows, the manifest says {rows}; rebuild the shard set with "
                                f"`prep corpus`")
            chunks.extend(shard_chunks)
        self._chunk_offsets = np.cumsum([0] + [len(c[0]) for c in chunks], dtype=np.int64)
        self._chunks = chunks

    def _mapped(self) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        if self._chunks is None:
            self._open()
        return self._chunks, self._chunk_offsets  # type: ignore[return-value]

    # -- access -----------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        chunks, offsets = self._mapped()
        index = int(index)
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        chunk = int(np.searchsorted(offsets, index, side="right")) - 1
        row = index - int(offsets[chunk])
        inputs, labels = chunks[chunk]
        return {"input_ids": inputs[row], "labels": labels[row]}

    def get_batch(self, indices, dtype=np.int32, *, out: tuple[np.ndarray, np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """Rows `indices` (in that order) as two arrays [n, input_length], [n, target_length] of `dtype`.

        One fancy-indexing gather per record batch touched, written straight into the output arrays
        (`out`, when given: two writable arrays of those shapes, e.g. views of one shared buffer).
        """
        chunks, offsets = self._mapped()
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_examples):
            raise IndexError(f"indices outside [0, {self.num_examples})")
        if out is None:
            out = (np.empty((indices.size, self.input_length), dtype=dtype),
                   np.empty((indices.size, self.target_length), dtype=dtype))
        inputs, labels = out
        chunk_of = np.searchsorted(offsets, indices, side="right") - 1
        # group positions by record batch: one stable sort, then one gather per run of equal chunk ids
        order = np.argsort(chunk_of, kind="stable")
        sorted_chunks = chunk_of[order]
        starts = np.flatnonzero(np.r_[True, sorted_chunks[1:] != sorted_chunks[:-1]]) if indices.size else []
        ends = list(starts[1:]) + [indices.size]
        for start, end in zip(starts, ends):
            chunk = int(sorted_chunks[start])
            where = order[start:end]
            rows = indices[where] - offsets[chunk]
            chunk_inputs, chunk_labels = chunks[chunk]
            inputs[where] = chunk_inputs[rows]
            labels[where] = chunk_labels[rows]
        return inputs, labels

    def __repr__(self) -> str:
        return (f"ShardDataset({self.source!r}, examples={self.num_examples}, shards={len(self.shard_paths)}, "
                f"input_length={self.input_length}, target_length={self.target_length})")


def _map_shard(path: str, input_length: int, target_length: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Memory-map one Arrow stream shard; zero-copy int32 views (inputs, labels) per record batch."""
    try:
        source = pa.memory_map(path, "r")
        reader = pa.ipc.open_stream(source)
        batches = list(reader)
    except (OSError, pa.ArrowInvalid) as err:
        raise UserError(f"{path}: not a readable Arrow stream shard ({err}); rebuild the shard set with "
                        f"`prep corpus`") from None
    widths = {INPUT_COLUMN: input_length, LABEL_COLUMN: target_length}
    for name, width in widths.items():
        field = reader.schema.field(name) if name in reader.schema.names else None
        if (field is None or not pa.types.is_fixed_size_list(field.type) or field.type.list_size != width
                or field.type.value_type != pa.int32()):
            raise UserError(f"{path}: column {name} is {field.type if field else 'missing'}, expected "
                            f"fixed_size_list<int32>[{width}] from the manifest; rebuild the shard set")
    chunks = []
    for batch in batches:
        if batch.num_rows == 0:
            continue
        chunks.append(tuple(_int32_rows(batch.column(name), width, path) for name, width in widths.items()))
    return chunks


def _int32_rows(column: pa.FixedSizeListArray, width: int, path: str) -> np.ndarray:
    """Zero-copy read-only [rows, width] int32 view of a fixed_size_list<int32> column's data buffer.

    Reads the buffer directly (np.frombuffer) rather than through Array.to_numpy, which imports pandas:
    half a second of time-to-first-batch in a fresh process.
    """
    values = column.values
    if column.null_count or values.null_count:
        raise UserError(f"{path}: null tokens in the shard; rebuild the shard set with `prep corpus`")
    data = values.buffers()[1]
    first = values.offset + column.offset * width
    return np.frombuffer(data, dtype=np.int32, count=len(column) * width, offset=first * 4).reshape(-1, width)


class GlobalOrderSampler(Sampler[int]):
    """This rank's sample indices, global batch after global batch, epoch after epoch (forever).

    Epoch e's order is `np.random.default_rng((seed, e)).permutation(num_samples)`, cut into
    num_samples // global_batch_size global batches (the remainder is dropped); rank r takes the r-th
    contiguous slice of global_batch_size // world_size indices of each. Iterating advances the state.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if global_batch_size < 1 or global_batch_size % world_size:
            raise UserError(f"global batch {global_batch_size} is not divisible by world size {world_size}; "
                            f"pick a --global-batch that is a multiple of the number of ranks")
        if num_samples < global_batch_size:
            raise UserError(f"the shard set has {num_samples} examples, fewer than one global batch of "
                            f"{global_batch_size}; lower --global-batch or prepare more data")
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.rank_batch_size = self.global_batch_size // self.world_size
        self.batches_per_epoch = self.num_samples // self.global_batch_size
        self.epoch = 0
        self.rank_position = 0  # indices of `epoch` this rank has yielded (over all its slices)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's indices of `epoch` as [batches_per_epoch, rank_batch_size] (row k: its slice of batch k)."""
        order = np.random.default_rng((self.seed, int(epoch))).permutation(self.num_samples)
        batches = order[: self.batches_per_epoch * self.global_batch_size].reshape(self.batches_per_epoch, -1)
        start = self.rank * self.rank_batch_size
        return batches[:, start:start + self.rank_batch_size]

    def global_batch(self, epoch: int, k: int) -> np.ndarray:
        """All B indices of global batch k of `epoch` (what every world size agrees on)."""
        order = np.random.default_rng((self.seed, int(epoch))).permutation(self.num_samples)
        return order[k * self.global_batch_size:(k + 1) * self.global_batch_size]

    def __len__(self) -> int:
        """Indices per epoch on this rank."""
        return self.batches_per_epoch * self.rank_batch_size

    def __iter__(self) -> Iterator[int]:
        while True:
            flat = self.epoch_indices(self.epoch).reshape(-1)
            while self.rank_position < flat.size:
                index = int(flat[self.rank_position])
                self.rank_position += 1
                yield index
            self.epoch += 1
            self.rank_position = 0

    def state_dict(self) -> dict[str, int]:
        full, partial = divmod(self.rank_position, self.rank_batch_size)
        return {"seed": self.seed, "epoch": self.epoch,
                "consumed_samples": full * self.global_batch_size + partial * self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (the seed comes from the state: a resumed run keeps the saved order)."""
        seed, epoch, consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed_samples"])
        full, partial = divmod(consumed, self.global_batch_size)
        if epoch < 0 or consumed < 0 or partial % self.world_size:
            raise UserError(f"sampler state {dict(state)} does not fit global batch {self.global_batch_size} at "
                            f"world size {self.world_size}; resume from a checkpoint saved after an optimizer "
                            f"step, with the same --global-batch")
        epoch += full // self.batches_per_epoch  # a state at the very end of an epoch continues in the next
        full %= self.batches_per_epoch
        self.seed, self.epoch = seed, epoch
        self.rank_position = full * self.rank_batch_size + partial // self.world_size


FETCH_BYTES = 4 << 20  # size of one DataLoader task: a group of consecutive micro-batches, as one tensor


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


class ShardLoader:
    """Micro-batches {"input_ids", "labels"} (int64 tensors) forever; resumable. Build it with `make_loader`.

    `grad_accum` micro-batches make this rank's share of one global batch. Each DataLoader task fetches a
    group of `fetch_group` consecutive micro-batches (about FETCH_BYTES) as one tensor, so a worker hands
    over one message per group and `prefetch_factor` counts groups. Positions are counted as the consumer
    receives each micro-batch, never when a worker prefetches it.
    """

    def __init__(self, dataset: ShardDataset, sampler: GlobalOrderSampler, micro_batch_size: int, *,
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2,
                 persistent_workers: bool = True):
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
        self.fetch_group = max(1, FETCH_BYTES // micro_bytes)
        self._groups = _MicroBatchGroups(sampler, micro_batch_size, self.fetch_group)
        workers = num_workers > 0
        self.dataloader = DataLoader(
            _PackedFetch(dataset), batch_sampler=self._groups, collate_fn=_collate_packed,
            num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor if workers else None,
            persistent_workers=persistent_workers and workers,
            # the DataLoader draws worker seeds from its generator: give it one so global RNG stays untouched
            generator=torch.Generator().manual_seed(sampler.seed))
        self._iterating = False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._iterating = True
        sampler, micro = self.sampler, self.micro_batch_size
        input_length, target_length = self.dataset.input_length, self.dataset.target_length
        while True:
            for packed in self.dataloader:
                rows = packed.numel() // (input_length + target_length)
                inputs = packed[:rows * input_length].view(rows, input_length)
                labels = packed[rows * input_length:].view(rows, target_length)
                for start in range(0, rows, micro):
                    sampler.rank_position += micro  # counted as the consumer takes it
                    yield {"input_ids": inputs[start:start + micro], "labels": labels[start:start + micro]}
            sampler.epoch += 1
            sampler.rank_position = 0

    @property
    def micro_batches_per_epoch(self) -> int:
        return len(self.sampler) // self.micro_batch_size

    def close(self) -> None:
        """Shut down the worker processes now (they also stop when the loader is garbage-collected)."""
        iterator = getattr(self.dataloader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.dataloader._iterator = None

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
                prefetch_factor: int = 2, persistent_workers: bool = True) -> ShardLoader:
    """A `ShardLoader` for this rank: GlobalOrderSampler + micro-batches gathered by `dataset.get_batch`."""
    sampler = GlobalOrderSampler(len(dataset), global_batch_size, seed, rank=rank, world_size=world_size)
    return ShardLoader(dataset, sampler, micro_batch_size, num_workers=num_workers, pin_memory=pin_memory,
                       prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)

