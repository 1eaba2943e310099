"""ShardDataset: a shard set (local directory or `s3://` URL) as one map-style dataset of zero-copy int32 rows.

    dataset = ShardDataset("shards/demo", input_length=512, target_length=114)   # checks, then maps lazily

Every Arrow stream shard is mapped on first use, once per process (`pipeline.shard_format.map_shard`); a global
index goes to (shard, record batch, row) through cumulative row counts. `ds[i]` returns zero-copy int32 rows
and `ds.get_batch(indices)` gathers a micro-batch with one fancy-indexing call per record batch touched. An
`s3://` URL is first resolved to a local cache (`pretrain.data.storage`), or, with `streamer=` (the loader's
`remote` mode), read shard by shard as the streamer fetches them. `token_limit` (the model's vocabulary, set by
the trainer) makes every gathered batch check its ids: a shard with a flipped byte is named, not trained on.
No torch here: the loader adds it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pipeline.common import UserError
from pipeline.shard_format import MANIFEST_NAME, check_shard_file, map_shard, read_manifest
from pretrain.data.storage import is_url, resolve_shard_dir

MAPPED_SHARDS_STREAMING = 4
"""Shards a streaming dataset keeps mapped per process (older maps are dropped so evicted files free their space)."""


class ShardDataset:
    """Map-style dataset over a shard set (local directory or fsspec URL); see the module docstring.

    Checks on open: manifest (format version), `input_length` / `target_length` when the caller gives them,
    presence and size of every shard; `verify=True` also recomputes sha256. Mapping a shard (on first
    access) checks its schema and row count. With `streamer` (a `pretrain.data.storage.ShardStreamer`) the
    manifest is the remote one and a shard's file is fetched (checked) when it is first read.
    The memory maps are opened lazily in each process (the dataset pickles without them).
    """

    def __init__(self, path_or_url: str | os.PathLike, *, input_length: int | None = None,
                 target_length: int | None = None, verify: bool = False,
                 cache_dir: str | os.PathLike | None = None, storage_options: dict[str, Any] | None = None,
                 streamer=None):
        self.source = os.fspath(path_or_url)
        self.streamer = streamer
        if streamer is not None:
            self.root, self.manifest = streamer.local_dir, streamer.manifest
        else:
            self.root = resolve_shard_dir(path_or_url, cache_dir=cache_dir, storage_options=storage_options,
                                          verify=verify)
            self.manifest = read_manifest(self.root)
        config = self.manifest["config"]
        self.input_length = int(config["input_length"])
        self.target_length = int(config["target_length"])
        self._check_lengths(input_length, target_length)
        shards = self.manifest["shards"]
        if not shards:
            raise UserError(f"{self.root}: the manifest lists no shards (the corpus gave no examples); "
                            f"check `rejected` in manifest.json and rerun `prep corpus` on more text")
        if streamer is None:
            hashed_by_cache = is_url(self.source)  # a URL's cache fill hashed every shard it downloaded or reused
            for shard in shards:
                check_shard_file(self.root, shard, check_sha=verify and not hashed_by_cache)
        self.shard_paths = [str(self.root / s["path"]) for s in shards]
        self.shard_rows = np.array([int(s["rows"]) for s in shards], dtype=np.int64)
        self.shard_offsets = np.concatenate([[0], np.cumsum(self.shard_rows)]).astype(np.int64)
        self.num_examples = int(self.shard_rows.sum())
        self.token_limit: int | None = None   # ids must lie in [0, token_limit) (the model's vocabulary) when set
        self._mapped: dict[int, tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]] = {}

    def _check_lengths(self, input_length: int | None, target_length: int | None) -> None:
        self.check_lengths_of(self.manifest, self.root / MANIFEST_NAME, input_length, target_length)

    @staticmethod
    def check_lengths_of(manifest: dict[str, Any], where, input_length: int | None, target_length: int | None) -> None:
        """The run's lengths against a manifest's (the one lengths check: preflight and trainer open with them)."""
        have_input, have_target = int(manifest["config"]["input_length"]), int(manifest["config"]["target_length"])
        if input_length is not None and int(input_length) != have_input:
            raise UserError(f"{where}: shards have input_length {have_input}, the run expects "
                            f"{input_length}; rebuild them with `prep corpus --input-length {input_length}` or "
                            f"use a matching set")
        if target_length is not None and int(target_length) != have_target:
            raise UserError(f"{where}: shards have target_length {have_target}, the run expects "
                            f"{target_length}; rebuild them with `prep corpus` at the --input-length / "
                            f"--noise-density / --mean-span-length that give it, or use a matching set")

    # -- memory maps (opened lazily, shard by shard, once per process) ------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_mapped"] = {}
        return state

    def shard_chunks(self, shard: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Shard `shard`'s record batches as (inputs, labels) views, and their row offsets within the shard."""
        if not self._mapped and self.streamer is None:     # a local set maps (and so checks) all its shards at once
            for other in range(len(self.shard_paths)):
                self._map(other)
        if shard not in self._mapped:
            self._map(shard)
        return self._mapped[shard]

    def _map(self, shard: int) -> None:
        if shard not in self._mapped:
            if self.streamer is not None:
                self.streamer.fetch(shard)               # blocks until the file is in the cache, checked
                while len(self._mapped) >= MAPPED_SHARDS_STREAMING:
                    self._mapped.pop(next(iter(self._mapped)))
            chunks = map_shard(self.shard_paths[shard], self.input_length, self.target_length,
                               rows=int(self.shard_rows[shard]))
            self._mapped[shard] = chunks, np.cumsum([0] + [len(c[0]) for c in chunks], dtype=np.int64)

    # -- access -----------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        shard = int(np.searchsorted(self.shard_offsets, index, side="right")) - 1
        chunks, offsets = self.shard_chunks(shard)
        row = index - int(self.shard_offsets[shard])
        chunk = int(np.searchsorted(offsets, row, side="right")) - 1
        inputs, labels = chunks[chunk]
        return {"input_ids": inputs[row - int(offsets[chunk])], "labels": labels[row - int(offsets[chunk])]}

    def get_batch(self, indices, dtype=np.int32, *, out: tuple[np.ndarray, np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """Rows `indices` (in that order) as two arrays [n, input_length], [n, target_length] of `dtype`.

        One fancy-indexing gather per record batch touched, written straight into the output arrays
        (`out`, when given: two writable arrays of those shapes, e.g. views of one shared buffer). With
        `token_limit` set, each shard's rows are checked to hold ids in [0, token_limit).
        """
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_examples):
            raise IndexError(f"indices outside [0, {self.num_examples})")
        if out is None:
            out = (np.empty((indices.size, self.input_length), dtype=dtype),
                   np.empty((indices.size, self.target_length), dtype=dtype))
        inputs, labels = out
        for shard, where in _runs(np.searchsorted(self.shard_offsets, indices, side="right") - 1):
            chunks, offsets = self.shard_chunks(shard)
            rows_in_shard = indices[where] - self.shard_offsets[shard]
            for chunk, in_chunk in _runs(np.searchsorted(offsets, rows_in_shard, side="right") - 1):
                positions = where[in_chunk]
                rows = rows_in_shard[in_chunk] - offsets[chunk]
                chunk_inputs, chunk_labels = chunks[chunk]
                inputs[positions] = chunk_inputs[rows]
                labels[positions] = chunk_labels[rows]
            if self.token_limit is not None:
                self._check_ids(shard, inputs[where], labels[where])
        return inputs, labels

    def _check_ids(self, shard: int, inputs: np.ndarray, labels: np.ndarray) -> None:
        low = min(int(inputs.min()), int(labels.min()))
        high = max(int(inputs.max()), int(labels.max()))
        if low < 0 or high >= self.token_limit:
            bad = low if low < 0 else high
            raise UserError(f"{self.shard_paths[shard]}: token id {bad} outside the model's vocabulary "
                            f"[0, {self.token_limit}): the shard is corrupt (a changed byte); find every bad shard "
                            f"with `prep verify {self.root}` and rebuild the set with `prep corpus`")

    def __repr__(self) -> str:
        return (f"ShardDataset({self.source!r}, examples={self.num_examples}, shards={len(self.shard_paths)}, "
                f"input_length={self.input_length}, target_length={self.target_length})")


def _runs(keys: np.ndarray):
    """(key, positions) for each distinct key, positions in input order: one stable sort, no per-item Python."""
    if not keys.size:
        return
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    for start, end in zip(starts, [*starts[1:], keys.size]):
        yield int(sorted_keys[start]), order[start:end]
