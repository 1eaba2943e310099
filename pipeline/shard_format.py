"""The on-disk shard-set contract (docs/design.md "Shard set on disk"): the one writer, reader and checker of
shards and manifests, shared by `prep corpus`, `prep verify`/`inspect`, the loader and the s3 cache.

    write_shard(path, input_ids, labels)          # Arrow IPC stream, fixed_size_list<int32> columns
    manifest = read_manifest("shards/demo")       # validated dict (format version checked here only)
    batches = map_shard(path, input_length=512, target_length=114, rows=100)  # zero-copy int32 views

A shard that does not match its manifest raises `ShardProblem`, a `UserError` naming the file and the fix;
its `problem` attribute says what is wrong without the file or the fix (`prep verify` prints its own fix).
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
MARKER_NAME = ".t5zero-shards"  # written first by `prep corpus`: this directory is a shard set it owns
INPUT_COLUMN = "input_ids"
LABEL_COLUMN = "labels"
MANIFEST_KEYS = ("format_version", "tool_version", "config", "tokenizer", "inputs", "shards", "totals",
                 "rejected", "fingerprint")
SECTION_TYPES = {"config": dict, "tokenizer": dict, "inputs": list, "shards": list, "totals": dict, "rejected": dict}
# The fields every reader of a shard set relies on (verify, inspect, the loader, the preflight), checked at reading
# so that a hand-edited or cut manifest is one line naming it, not a KeyError wherever a field is first used.
SECTION_FIELDS = {"config": {"input_length": int, "target_length": int},
                  "tokenizer": {"path": str, "sha256": str, "vocab_size": int}}
SHARD_FIELDS = {"path": str, "rows": int, "bytes": int, "sha256": str}


class ShardProblem(UserError):
    """A shard file that does not match its manifest: `path`, and `problem` (what is wrong, without the fix)."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}; rebuild the shard set with `prep corpus` (or re-copy it)")
        self.path = str(path)
        self.problem = problem


# -- writing ----------------------------------------------------------------------------------------------------

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


def write_shard(path: str | Path, input_ids: np.ndarray, labels: np.ndarray, *, record_batches: int = 1) -> int:
    """Write one shard as an Arrow IPC stream to `path` (the caller renames a temp path into place).

    Returns the bytes written. The file is readable by `datasets.Dataset.from_file`. `record_batches` > 1
    splits the rows over several record batches of one stream (a layout any Arrow writer may produce).
    """
    cuts = np.array_split(np.arange(len(input_ids)), record_batches) if record_batches > 1 else [slice(None)]
    batches = [to_record_batch(input_ids[rows], labels[rows]) for rows in cuts]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return Path(path).stat().st_size


def write_manifest(shard_dir: str | Path, manifest: dict[str, Any]) -> None:
    """Write manifest.json atomically; it is the last file a prep job writes (its presence means 'done')."""
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ValueError(f"manifest lacks {missing}")
    atomic_write_json(Path(shard_dir) / MANIFEST_NAME, manifest)


# -- the manifest --------------------------------------------------------------------------------------------

def read_manifest(shard_dir: str | Path) -> dict[str, Any]:
    """Read and check a shard set's manifest; a user-fixable problem raises `UserError` naming the file."""
    path = Path(shard_dir) / MANIFEST_NAME
    if Path(shard_dir).is_file():
        raise UserError(f"{shard_dir}: a file, not a shard set directory; pass the directory that holds {MANIFEST_NAME}")
    if not path.is_file():
        raise UserError(f"{path}: no manifest; run `prep corpus --out {shard_dir}` first (or finish it: "
                        f"a shard set without manifest.json is incomplete)")
    return parse_manifest(path.read_bytes(), path)


def parse_manifest(data: bytes | str, where: str | Path) -> dict[str, Any]:
    """Parse and check the bytes of a manifest read from `where` (a file or a URL, named in any error):
    valid JSON, every key, this tool's format version."""
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{where}: not valid JSON ({err}); rebuild the shard set with `prep corpus --overwrite`")
    missing = [k for k in MANIFEST_KEYS if k not in manifest] if isinstance(manifest, dict) else list(MANIFEST_KEYS)
    if missing:
        raise UserError(f"{where}: manifest lacks {missing}; rebuild the shard set with `prep corpus --overwrite`")
    if manifest["format_version"] != FORMAT_VERSION:
        raise UserError(f"{where}: shard format version {manifest['format_version']}, this tool reads "
                        f"{FORMAT_VERSION}; rebuild the shard set with this version of `prep corpus`")
    problem = _manifest_problem(manifest)
    if problem:
        raise UserError(f"{where}: {problem}; rebuild the shard set with `prep corpus --overwrite`")
    return manifest


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the sections and shard entries of a manifest (a field missing, of another type, a shard
    path outside the set), or None."""
    for section, kind in SECTION_TYPES.items():
        if not isinstance(manifest[section], kind):
            return f"its {section} is {type(manifest[section]).__name__}, not a {kind.__name__}"
    for section, fields in SECTION_FIELDS.items():
        problem = _fields_problem(manifest[section], fields)
        if problem:
            return f"its {section} {problem}"
    for k, shard in enumerate(manifest["shards"]):
        problem = (_fields_problem(shard, SHARD_FIELDS) if isinstance(shard, dict)
                   else f"is {type(shard).__name__}, not a mapping")
        if problem is None and (Path(shard["path"]).is_absolute() or ".." in Path(shard["path"]).parts):
            problem = f"path {shard['path']!r} leads outside the shard set"
        if problem:
            return f"shard entry {k} {problem}"
    return None


def _fields_problem(entry: dict[str, Any], fields: dict[str, type]) -> str | None:
    for name, kind in fields.items():
        if name not in entry:
            return f"lacks {name!r} (needs {', '.join(fields)})"
        value = entry[name]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            return f"{name!r} is {value!r}, not a {'non-negative integer' if kind is int else 'string'}"
    return None


# -- a shard against its manifest entry --------------------------------------------------------------------------

def shard_file_problem(shard_dir: str | Path, shard: dict[str, Any], *, check_sha: bool = True) -> str | None:
    """Why the file of manifest entry `shard` does not match it (missing, another size, another sha256), or
    None when it matches; the sha256 is recomputed only with `check_sha`."""
    path = Path(shard_dir) / shard["path"]
    manifest_path = Path(shard_dir) / MANIFEST_NAME
    try:
        size = path.stat().st_size
    except OSError:
        return f"shard listed in {manifest_path} is missing"
    if size != shard["bytes"]:
        return f"{size} bytes, the manifest says {shard['bytes']} (truncated or replaced)"
    if check_sha and sha256_file(path) != shard["sha256"]:
        return f"sha256 does not match {manifest_path} (corrupt shard)"
    return None


def check_shard_file(shard_dir: str | Path, shard: dict[str, Any], *, check_sha: bool) -> None:
    """`shard_file_problem`, raised as a `ShardProblem` naming the file."""
    problem = shard_file_problem(shard_dir, shard, check_sha=check_sha)
    if problem:
        raise ShardProblem(Path(shard_dir) / shard["path"], problem)


# -- reading a shard -------------------------------------------------------------------------------------------

def map_shard(path: str | Path, input_length: int | None = None, target_length: int | None = None,
              rows: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Memory-map one shard: per non-empty record batch, zero-copy read-only int32 views (inputs [n, input_length],
    labels [n, target_length]). Checks the schema (fixed_size_list<int32> of the given widths, when given),
    nulls, and the total row count (when `rows` is given); any mismatch raises `ShardProblem`."""
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path), "r"))
        batches = list(reader)
    except (OSError, pa.ArrowInvalid) as err:
        raise ShardProblem(path, f"not a readable Arrow stream shard ({err})") from None
    widths = {}
    for name, width in ((INPUT_COLUMN, input_length), (LABEL_COLUMN, target_length)):
        field = reader.schema.field(name) if name in reader.schema.names else None
        if (field is None or not pa.types.is_fixed_size_list(field.type) or field.type.value_type != pa.int32()
                or width is not None and field.type.list_size != width):
            expected = "fixed_size_list<int32>" + (f"[{width}] from the manifest" if width is not None else "")
            raise ShardProblem(path, f"column {name} is {field.type if field else 'missing'}, expected {expected}")
        widths[name] = field.type.list_size
    chunks = [tuple(_int32_rows(batch.column(name), width, path) for name, width in widths.items())
              for batch in batches if batch.num_rows]
    got = sum(len(inputs) for inputs, _ in chunks)
    if rows is not None and got != rows:
        raise ShardProblem(path, f"{got} rows, the manifest says {rows}")
    return chunks


def _int32_rows(column: pa.FixedSizeListArray, width: int, path: str | Path) -> np.ndarray:
    """Zero-copy read-only [rows, width] int32 view of a fixed_size_list<int32> column's data buffer.

    Reads the buffer directly (np.frombuffer) rather than through Array.to_numpy, which imports pandas:
    half a second of time-to-first-batch in a fresh process.
    """
    values = column.values
    if column.null_count or values.null_count:
        raise ShardProblem(path, "null tokens in the shard")
    first = values.offset + column.offset * width
    view = np.frombuffer(values.buffers()[1], dtype=np.int32, count=len(column) * width, offset=first * 4)
    view.setflags(write=False)  # the pages are a read-only map of the shard file
    return view.reshape(-1, width)


def read_shard_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The whole shard as two int32 arrays ([rows, input_length], [rows, target_length]); zero-copy views
    when it holds one record batch."""
    chunks = map_shard(path)
    if len(chunks) == 1:
        return chunks[0]
    if not chunks:
        raise ShardProblem(path, "no rows")
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])
