"""Inputs -> work units -> documents: the reading step of `prep corpus` (and of `prep tokenizer`).

    units = plan_units(discover_inputs(["corpus/*.jsonl"]), unit_bytes=32 << 20)
    for batch in batched_texts(unit_texts(units[0], "text", max_doc_chars=1_000_000, rejected=RejectCounter())): ...

Formats: `.jsonl` / `.json` (one JSON object per line, text under `text_field`), `.jsonl.gz`, `.jsonl.zst`,
`.txt` (one document per line; blank lines separate nothing and are skipped), `.parquet` (column `text_field`),
and a directory written by `datasets.Dataset.save_to_disk` (its `data-*.arrow` files, column `text_field`).
A directory that is not a `datasets` directory is searched recursively for files of those formats; globs work.

Work units are a deterministic split of the sorted inputs that never depends on the number of workers:
uncompressed `.jsonl`/`.txt` files in line-aligned byte ranges of about `unit_bytes` (a line belongs to the
range holding its first byte), compressed files whole, parquet files by groups of row groups, `datasets`
directories by arrow file.

A directory walk skips shard sets (a `.t5zero-shards` marker) and `tokenizer.json` files, so a shard set or a
tokenizer written inside the corpus directory never becomes part of the corpus. An input that cannot be read
(a truncated or CRC-bad .gz, a .zst that is not zstd, a broken parquet or arrow file) is a `UserError` naming it.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.common import UserError, sha256_file, sha256_json
from pipeline.shard_format import MARKER_NAME

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt",)
REJECT_REASONS = ("invalid_utf8", "malformed_json", "missing_text", "not_text", "empty", "too_long", "nul_bytes",
                  "lone_surrogate")
SKIPPED_IN_WALKS = ("tokenizer.json",)  # written by `prep tokenizer`; never corpus text
DOCS_PER_BATCH = 512
BYTES_PER_BATCH = 4 << 20


def _read_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [OSError, EOFError, zlib.error, pa.ArrowException, json.JSONDecodeError]
    with contextlib.suppress(ImportError):
        import zstandard

        types.append(zstandard.ZstdError)
    return tuple(types)


@contextlib.contextmanager
def reading(path: str | os.PathLike):
    """A failure to read input `path` (truncated, corrupt, not the format its name says) -> one `UserError`."""
    try:
        yield
    except UserError:
        raise
    except _read_error_types() as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise UserError(f"{path}: cannot read this input ({type(err).__name__}: {reason}); re-copy or repair the "
                        f"file, or leave it out of --input") from None


def input_kind(path: Path) -> str | None:
    """The reader for a file or directory, or None when it is not a corpus input."""
    name = path.name.lower()
    if path.is_dir():
        return "arrow_dir" if (path / "state.json").is_file() and (path / "dataset_info.json").is_file() else None
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(tuple(s + ".gz" for s in JSONL_SUFFIXES)):
        return "jsonl.gz"
    if name.endswith(tuple(s + ".zst" for s in JSONL_SUFFIXES)):
        return "jsonl.zst"
    if name.endswith(TEXT_SUFFIXES):
        return "txt"
    if name.endswith(".txt.gz"):
        return "txt.gz"
    if name.endswith(".txt.zst"):
        return "txt.zst"
    if name.endswith(".parquet"):
        return "parquet"
    return None


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    kind: str
    bytes: int


def discover_inputs(patterns: list[str]) -> list[InputFile]:
    """Expand paths, globs and directories into a sorted, de-duplicated list of inputs; `UserError` if none."""
    found: dict[str, InputFile] = {}
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(os.path.exists(m) for m in matches):
            missing = pattern if not matches else next(m for m in matches if not os.path.exists(m))
            raise UserError(f"{missing}: input not found; check the --input path (files, directories and globs work)")
        for match in matches:
            if (Path(match) / MARKER_NAME).is_file():
                raise UserError(f"{match}: a shard set written by `prep corpus`, not a corpus; pass the corpus "
                                f"files to --input")
            for path in _expand(Path(match)):
                kind = input_kind(path)
                with reading(path):
                    size = (sum(f.stat().st_size for f in _arrow_files(path)) if kind == "arrow_dir"
                            else path.stat().st_size)
                found[str(path.resolve())] = InputFile(str(path.resolve()), kind, size)
    if not found:
        raise UserError(f"{', '.join(patterns)}: no corpus files found (expected .jsonl[.gz|.zst], .txt, .parquet "
                        f"or a datasets save_to_disk directory)")
    return [found[k] for k in sorted(found)]


def _expand(path: Path) -> Iterator[Path]:
    kind = input_kind(path)
    if kind is not None:
        yield path
    elif path.is_dir():
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            here = Path(dirpath)
            if (here / MARKER_NAME).is_file():
                dirnames.clear()  # a shard set inside the corpus directory is not corpus
                continue
            if input_kind(here) == "arrow_dir" and here != path:
                dirnames.clear()
                yield here
                continue
            for name in sorted(filenames):
                if not name.startswith(".") and name not in SKIPPED_IN_WALKS and input_kind(here / name) is not None:
                    yield here / name
    else:
        raise UserError(f"{path}: unsupported input format; use .jsonl[.gz|.zst], .txt, .parquet or a datasets "
                        f"save_to_disk directory")


def _arrow_files(dataset_dir: Path) -> list[Path]:
    with reading(dataset_dir / "state.json"):
        state = json.loads((dataset_dir / "state.json").read_text())
    return [dataset_dir / f["filename"] for f in state.get("_data_files", [])]


def input_digest(item: InputFile) -> dict:
    """The manifest's entry for one input: path, bytes and the sha256 of its bytes (of its arrow files' digests
    for a `datasets` directory)."""
    with reading(item.path):
        if item.kind == "arrow_dir":
            digest = sha256_json([sha256_file(p) for p in _arrow_files(Path(item.path))])
        else:
            digest = sha256_file(item.path)
    return {"path": item.path, "bytes": item.bytes, "sha256": digest}


@dataclass(frozen=True)
class WorkUnit:
    """One deterministic slice of the inputs: a byte range, a group of parquet row groups, or one arrow file."""

    unit_id: int
    path: str  # the file to read (for datasets directories, one of its arrow files)
    kind: str
    start: int  # byte offset (jsonl/txt), first row group (parquet), 0 otherwise
    end: int  # byte offset (exclusive), row group (exclusive), or file size
    bytes: int  # approximate input bytes, for progress

    def to_json(self) -> dict:
        return asdict(self)


def plan_units(inputs: list[InputFile], unit_bytes: int) -> list[WorkUnit]:
    """Split sorted inputs into numbered work units of about `unit_bytes` (independent of worker count)."""
    units: list[WorkUnit] = []

    def add(path: str, kind: str, start: int, end: int, size: int) -> None:
        units.append(WorkUnit(len(units), path, kind, start, end, size))

    for item in inputs:
        if item.kind in ("jsonl", "txt"):
            for start in range(0, max(item.bytes, 1), unit_bytes):
                end = min(start + unit_bytes, item.bytes)
                add(item.path, item.kind, start, end, end - start)
        elif item.kind == "parquet":
            with reading(item.path):
                meta = pq.ParquetFile(item.path).metadata
            group_start, group_bytes = 0, 0
            for g in range(meta.num_row_groups):
                group_bytes += meta.row_group(g).total_byte_size
                if group_bytes >= unit_bytes or g == meta.num_row_groups - 1:
                    add(item.path, item.kind, group_start, g + 1, group_bytes)
                    group_start, group_bytes = g + 1, 0
        elif item.kind == "arrow_dir":
            for arrow_file in _arrow_files(Path(item.path)):
                size = arrow_file.stat().st_size
                add(str(arrow_file), "arrow", 0, size, size)
        else:  # compressed: one unit per file
            add(item.path, item.kind, 0, item.bytes, item.bytes)
    return units


class RejectCounter(dict):
    """Counts of skipped records per reason (all reasons present, zero when none)."""

    def __init__(self) -> None:
        super().__init__({reason: 0 for reason in REJECT_REASONS})


def check_text(text: object, max_doc_chars: int, rejected: RejectCounter) -> str | None:
    """The document text when it is acceptable, else None after counting the reason it is not."""
    if not isinstance(text, str):
        rejected["missing_text" if text is None else "not_text"] += 1
        return None
    if "\x00" in text:
        rejected["nul_bytes"] += 1
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        rejected["lone_surrogate"] += 1
        return None
    if not text.strip():
        rejected["empty"] += 1
        return None
    if len(text) > max_doc_chars:
        rejected["too_long"] += 1
        return None
    return text


def _line_range(path: str, start: int, end: int) -> Iterator[bytes]:
    """Lines whose first byte lies in [start, end)."""
    with open(path, "rb", buffering=1 << 20) as f:
        position = start
        if start > 0:
            f.seek(start - 1)
            position = start - 1 + len(f.readline())  # finish the line that began before `start`
        while position < end:
            line = f.readline()
            if not line:
                break
            position += len(line)
            yield line


def _compressed_lines(path: str, kind: str) -> Iterator[bytes]:
    if kind.endswith(".gz"):  # gzip itself raises on a truncated stream (EOFError) and a bad CRC (BadGzipFile)
        with gzip.open(path, "rb") as f:
            yield from io.BufferedReader(f, 1 << 20)
    else:
        yield from _lines(_zstd_chunks(path))


def _zstd_chunks(path: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The decompressed bytes of a .zst file, frame after frame; a last frame cut short is a `ZstdError` (zstd's
    stream reader would just stop, and the tail of the corpus would be lost without a word)."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame, fed = decompressor.decompressobj(), False
    with open(path, "rb") as raw:
        while chunk := raw.read(chunk_bytes):
            while chunk:
                if frame.eof:
                    frame, fed = decompressor.decompressobj(), False
                fed = True
                if out := frame.decompress(chunk):
                    yield out
                chunk = frame.unused_data if frame.eof else b""
    if fed and not frame.eof:
        raise zstandard.ZstdError("the file ends inside a zstd frame (truncated)")


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Re-cut a stream of byte chunks into lines, each with its b"\\n" (the last one may lack it)."""
    rest = b""
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


def _texts_from_jsonl(lines: Iterator[bytes], text_field: str, max_doc_chars: int, rejected: RejectCounter) -> Iterator[str]:
    for line in lines:
        if not line.strip():
            continue  # blank lines separate nothing; they are not records
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError:
            rejected["invalid_utf8"] += 1
            continue
        try:
            record = json.loads(decoded)
        except json.JSONDecodeError:
            rejected["malformed_json"] += 1
            continue
        if not isinstance(record, dict):
            rejected["malformed_json"] += 1
            continue
        text = check_text(record.get(text_field), max_doc_chars, rejected)
        if text is not None:
            yield text


def _texts_from_txt(lines: Iterator[bytes], max_doc_chars: int, rejected: RejectCounter) -> Iterator[str]:
    for line in lines:
        if not line.strip():
            continue
        try:
            decoded = line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            rejected["invalid_utf8"] += 1
            continue
        text = check_text(decoded, max_doc_chars, rejected)
        if text is not None:
            yield text


def check_text_column(schema: pa.Schema, path: str, text_field: str) -> None:
    """`UserError` unless `schema` has a string column `text_field` (an int column is named as not text)."""
    if text_field not in schema.names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); pass --text-field")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        text_columns = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        raise UserError(f"{path}: column {text_field!r} is {kind}, not text; pass --text-field naming a string "
                        f"column (string columns: {', '.join(text_columns) or 'none'})")


def _texts_from_table_batches(batches: Iterator[pa.RecordBatch], path: str, text_field: str, max_doc_chars: int,
                              rejected: RejectCounter) -> Iterator[str]:
    for batch in batches:
        check_text_column(batch.schema, path, text_field)
        for text in batch.column(text_field).to_pylist():
            text = check_text(text, max_doc_chars, rejected)
            if text is not None:
                yield text


def unit_texts(unit: WorkUnit, text_field: str, max_doc_chars: int, rejected: RejectCounter) -> Iterator[str]:
    """The acceptable documents of one unit, in file order; skipped records are counted in `rejected`; a file
    that cannot be read is a `UserError` naming it."""
    with reading(unit.path):
        yield from _unit_texts(unit, text_field, max_doc_chars, rejected)


def _unit_texts(unit: WorkUnit, text_field: str, max_doc_chars: int, rejected: RejectCounter) -> Iterator[str]:
    kind = unit.kind
    if kind == "jsonl":
        yield from _texts_from_jsonl(_line_range(unit.path, unit.start, unit.end), text_field, max_doc_chars, rejected)
    elif kind == "txt":
        yield from _texts_from_txt(_line_range(unit.path, unit.start, unit.end), max_doc_chars, rejected)
    elif kind in ("jsonl.gz", "jsonl.zst"):
        yield from _texts_from_jsonl(_compressed_lines(unit.path, kind), text_field, max_doc_chars, rejected)
    elif kind in ("txt.gz", "txt.zst"):
        yield from _texts_from_txt(_compressed_lines(unit.path, kind), max_doc_chars, rejected)
    elif kind == "parquet":
        parquet = pq.ParquetFile(unit.path)
        check_text_column(parquet.schema_arrow, unit.path, text_field)
        batches = parquet.iter_batches(batch_size=DOCS_PER_BATCH, row_groups=list(range(unit.start, unit.end)),
                                       columns=[text_field])
        yield from _texts_from_table_batches(batches, unit.path, text_field, max_doc_chars, rejected)
    elif kind == "arrow":
        with pa.memory_map(unit.path, "r") as source:
            reader = pa.ipc.open_stream(source)
            yield from _texts_from_table_batches(iter(reader), unit.path, text_field, max_doc_chars, rejected)
    else:
        raise ValueError(f"unknown unit kind {kind!r}")


def batched_texts(texts: Iterator[str]) -> Iterator[list[str]]:
    """Group documents into batches of at most DOCS_PER_BATCH documents or about BYTES_PER_BATCH characters."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) >= DOCS_PER_BATCH or chars >= BYTES_PER_BATCH:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def iter_corpus_texts(patterns: list[str], text_field: str = "text", max_doc_chars: int = 1_000_000,
                      rejected: RejectCounter | None = None) -> Iterator[str]:
    """Every acceptable document of the inputs in unit order (used to train tokenizers)."""
    rejected = rejected if rejected is not None else RejectCounter()
    for unit in plan_units(discover_inputs(patterns), unit_bytes=1 << 30):
        yield from unit_texts(unit, text_field, max_doc_chars, rejected)
