"""The on-disk shard-set contract (DESIGN.md "Shard set on disk"), in one place for the writer and the loader.

    write_shard(path, input_ids, labels)          # Arrow IPC stream, fixed_size_list<int32> columns
    manifest = read_manifest("shards/demo")       # validated dict
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.common import UserError, atomic_write_json, sha256_file

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
UNITS_DIR = "units"
INPUT_COLUMN = "input_ids"
LABEL_COLUMN = "labels"
MANIFEST_KEYS = ("format_version", "tool_version", "config", "tokenizer", "inputs", "shards", "totals",
                 "rejected", "fingerprint")


def shard_name(unit_id: int, part: int) -> str:
    """Relative path of part `part` of work unit `unit_id`: data/part-UUUUU-KKKK.arrow."""
    return f"{DATA_DIR}/part-{unit_id:05d}-{part:04d}.arrow"


def shard_schema(input_length: int, target_length: int) -> pa.Schema:
    return pa.schema([
        pa.field(INPUT_COLUMN, pa.list_(pa.int32(), input_length), nullable=False),
        pa.field(LABEL_COLUMN, pa.list_(pa.int32(), target_length), nullable=False),
    ])


def _int32_array(matrix: np.ndarray) -> pa.Array:
    """A C-contiguous int32 matrix as a flat Arrow array over the same memory (no copy; unlike `pa.array`,
    it does not import pandas, which cost every Ray worker ~0.3 s)."""
    return pa.Array.from_buffers(pa.int32(), matrix.size, [None, pa.py_buffer(matrix)])


def to_record_batch(input_ids: np.ndarray, labels: np.ndarray) -> pa.RecordBatch:
    """Two int32 matrices [rows, input_length] and [rows, target_length] -> one record batch (no copy)."""
    if input_ids.ndim != 2 or labels.ndim != 2 or len(input_ids) != len(labels):
        raise ValueError(f"expected 2-D arrays with equal rows, got {input_ids.shape} and {labels.shape}")
    inputs = np.ascontiguousarray(input_ids, dtype=np.int32)
    targets = np.ascontiguousarray(labels, dtype=np.int32)
    columns = [pa.FixedSizeListArray.from_arrays(_int32_array(inputs), inputs.shape[1]),
               pa.FixedSizeListArray.from_arrays(_int32_array(targets), targets.shape[1])]
    return pa.RecordBatch.from_arrays(columns, schema=shard_schema(inputs.shape[1], targets.shape[1]))


def write_shard(path: str | Path, input_ids: np.ndarray, labels: np.ndarray) -> int:
    """Write one shard as an Arrow IPC stream to `path` (the caller renames a temp path into place).

    Returns the bytes written. The file is readable by `datasets.Dataset.from_file`.
    """
    batch = to_record_batch(input_ids, labels)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return Path(path).stat().st_size


def read_shard_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map one shard and return zero-copy int32 views ([rows, input_length], [rows, target_length])."""
    with pa.memory_map(str(path), "r") as source:
        table = pa.ipc.open_stream(source).read_all()
    arrays = []
    for name in (INPUT_COLUMN, LABEL_COLUMN):
        column = table.column(name).combine_chunks()
        width = column.type.list_size
        flat = column.flatten()  # respects the array's offset, unlike .values
        values = np.frombuffer(flat.buffers()[1], dtype=np.int32, count=len(flat), offset=flat.offset * 4)
        values.setflags(write=False)  # the pages are a read-only map of the shard file
        arrays.append(values.reshape(-1, width))
    return arrays[0], arrays[1]


def shard_file_problem(shard_dir: str | Path, shard: dict[str, Any], *, check_sha: bool = True) -> str | None:
    """Why a shard's file does not match its manifest entry ("missing", a size mismatch, a sha256 mismatch), or
    None when it matches; the sha256 is recomputed only with `check_sha`."""
    path = Path(shard_dir) / shard["path"]
    try:
        size = path.stat().st_size
    except OSError:
        return "missing"
    if size != shard["bytes"]:
        return f"size {size} bytes, manifest says {shard['bytes']}"
    if check_sha and sha256_file(path) != shard["sha256"]:
        return "sha256 differs from the manifest (corrupted or modified)"
    return None


def write_manifest(shard_dir: str | Path, manifest: dict[str, Any]) -> None:
    """Write manifest.json atomically; it is the last file a prep job writes (its presence means 'done')."""
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ValueError(f"manifest lacks {missing}")
    atomic_write_json(Path(shard_dir) / MANIFEST_NAME, manifest)


def read_manifest(shard_dir: str | Path) -> dict[str, Any]:
    """Read and check a shard set's manifest; a user-fixable problem raises `UserError` naming the file."""
    path = Path(shard_dir) / MANIFEST_NAME
    if not path.is_file():
        raise UserError(f"{path}: no manifest; run `prep corpus --out {shard_dir}` first (or finish it: "
                        f"a shard set without manifest.json is incomplete)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err}); rebuild the shard set with `prep corpus --overwrite`")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise UserError(f"{path}: manifest lacks {missing}; rebuild the shard set with `prep corpus --overwrite`")
    if manifest["format_version"] != FORMAT_VERSION:
        raise UserError(f"{path}: shard format version {manifest['format_version']}, this tool reads "
                        f"{FORMAT_VERSION}; rebuild the shard set with this version of `prep corpus`")
    return manifest
