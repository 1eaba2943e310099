"""ShardDataset: a shard set (local directory or `s3://` URL) as one map-style dataset of zero-copy int32 rows.

    dataset = ShardDataset("shards/demo", input_length=512, target_length=114)   # checks, then maps lazily

Every Arrow stream shard is mapped once per process (`pipeline.shard_format.map_shard`) and rows are indexed
through a cumulative row index over the record batches; `ds[i]` returns zero-copy int32 rows and
`ds.get_batch(indices)` gathers a micro-batch with one fancy-indexing call per record batch touched. An `s3://`
URL is first resolved to a local cache (`pretrain.data.storage`). No torch here: the loader adds it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pipeline.common import UserError
from pipeline.shard_format import MANIFEST_NAME, check_shard_file, map_shard, read_manifest
from pretrain.data.storage import is_url, resolve_shard_dir


class ShardDataset:
    """Map-style dataset over a shard set (local directory or fsspec URL); see the module docstring.

    Checks on open: manifest (format version), `input_length` / `target_length` when the caller gives them,
    presence and size of every shard; `verify=True` also recomputes sha256. Mapping a shard (on first
    access) checks its schema and row count.
    The memory maps are opened lazily in each process (the dataset pickles without them).
    """

    def __init__(self, path_or_url: str | os.PathLike, *, input_length: int | None = None,
                 target_length: int | None = None, verify: bool = False,
                 cache_dir: str | os.PathLike | None = None, storage_options: dict[str, Any] | None = None):
        self.source = os.fspath(path_or_url)
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
        hashed_by_cache = is_url(self.source)  # a URL's cache fill hashed every shard it downloaded or reused
        for shard in shards:
            check_shard_file(self.root, shard, check_sha=verify and not hashed_by_cache)
        self.shard_paths = [str(self.root / s["path"]) for s in shards]
        self.shard_rows = np.array([int(s["rows"]) for s in shards], dtype=np.int64)
        self.num_examples = int(self.shard_rows.sum())
        self._chunks: list[tuple[np.ndarray, np.ndarray]] | None = None  # per record batch, lazily mapped
        self._chunk_offsets: np.ndarray | None = None

    def _check_lengths(self, input_length: int | None, target_length: int | None) -> None:
        """The run's lengths against the manifest's (the one lengths check: preflight and trainer open with them)."""
        where = self.root / MANIFEST_NAME
        if input_length is not None and int(input_length) != self.input_length:
            raise UserError(f"{where}: shards have input_length {self.input_length}, the run expects "
                            f"{input_length}; rebuild them with `prep corpus --input-length {input_length}` or "
                            f"use a matching set")
        if target_length is not None and int(target_length) != self.target_length:
            raise UserError(f"{where}: shards have target_length {self.target_length}, the run expects "
                            f"{target_length}; rebuild them with `prep corpus` at the --input-length / "
                            f"--noise-density / --mean-span-length that give it, or use a matching set")

    # -- memory maps (opened lazily, once per process) ------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_chunks"] = None
        state["_chunk_offsets"] = None
        return state

    def _open(self) -> None:
        chunks: list[tuple[np.ndarray, np.ndarray]] = []
        for path, rows in zip(self.shard_paths, self.shard_rows):
            chunks.extend(map_shard(path, self.input_length, self.target_length, rows=int(rows)))
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
