"""`prep corpus`: documents -> tokens -> raw windows -> span corruption -> Arrow shards, one work unit at a time.

    result = build_shards(PrepConfig(inputs=["corpus.jsonl"], tokenizer="tok/tokenizer.json", out="shards/demo"))

The steps are plain functions (`unit_texts` -> `TokenWindows` -> `span_corrupt` -> `ShardWriter`) run by
`process_unit`; `pipeline.executor` runs units on Ray. Each unit's randomness is
`np.random.default_rng((seed, unit_id))`, so the bytes never depend on worker count, cluster shape or timing.
A unit is done when `units/UUUUU.json` exists (written after its shards); `manifest.json` is written last.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline import __version__
from pipeline.common import UserError, atomic_write_json, sha256_file, sha256_json
from pipeline.readers import RejectCounter, WorkUnit, batched_texts, discover_inputs, plan_units, unit_texts
from pipeline.shard_format import (DATA_DIR, FORMAT_VERSION, MANIFEST_NAME, UNITS_DIR, read_manifest, shard_name,
                                   shard_file_problem, write_manifest, write_shard)
from pipeline.span_corruption import SpanSpec, span_corrupt

SHARD_TARGET_BYTES = 64 << 20
DEFAULT_UNIT_BYTES = 4 << 20
WINDOWS_PER_CORRUPTION = 4096


@dataclass
class PrepConfig:
    """Everything `prep corpus` needs; the fields that shape the bytes go into the fingerprint."""

    inputs: list[str]
    tokenizer: str
    out: str
    input_length: int = 512
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    seed: int = 0
    shard_rows: int | None = None  # None: about 64 MiB per shard
    text_field: str = "text"
    max_doc_chars: int = 1_000_000
    unit_bytes: int = DEFAULT_UNIT_BYTES
    workers: int = 2
    ray_address: str | None = None
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.shard_rows is not None and self.shard_rows < 1:
            raise UserError(f"--shard-rows {self.shard_rows} must be >= 1")
        if self.max_doc_chars < 1:
            raise UserError(f"--max-doc-chars {self.max_doc_chars} must be >= 1")
        if self.workers < 1:
            raise UserError(f"--workers {self.workers} must be >= 1")


def resolved_shard_rows(config: PrepConfig, spec: SpanSpec) -> int:
    if config.shard_rows is not None:
        return config.shard_rows
    return max(1, SHARD_TARGET_BYTES // (4 * (spec.input_length + spec.target_length)))


def manifest_config(config: PrepConfig, spec: SpanSpec) -> dict[str, Any]:
    """The manifest's "config" section: every setting that shapes the shard bytes."""
    return {"input_length": spec.input_length, "target_length": spec.target_length, "raw_length": spec.raw_length,
            "noise_density": spec.noise_density, "mean_noise_span_length": spec.mean_noise_span_length,
            "num_noise_tokens": spec.num_noise_tokens, "num_noise_spans": spec.num_noise_spans,
            "seed": config.seed, "shard_rows": resolved_shard_rows(config, spec), "text_field": config.text_field,
            "max_doc_chars": config.max_doc_chars, "unit_bytes": config.unit_bytes}


def fingerprint(prep_config: dict, tokenizer_sha256: str, inputs: list[dict]) -> str:
    """hash(config, tokenizer bytes, input bytes): equal fingerprints mean byte-identical shard sets."""
    return sha256_json({"format_version": FORMAT_VERSION, "config": prep_config, "tokenizer_sha256": tokenizer_sha256,
                        "inputs": [[item["bytes"], item["sha256"]] for item in inputs]})


# ----------------------------------------------------------------------------------------------- the steps

class TokenWindows:
    """Tokenise batches of documents (`</s>` after each) and cut the running token stream into raw windows."""

    def __init__(self, tokenizer, raw_length: int, eos_id: int) -> None:
        self.tokenizer = tokenizer
        self.raw_length = raw_length
        self.eos_id = eos_id
        self.carry = np.zeros(0, dtype=np.int32)
        self.documents = 0
        self.tokens = 0

    def push(self, texts: list[str]) -> np.ndarray:
        """Tokenise `texts`; return the full windows now available, [n, raw_length] int32."""
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        id_lists = [e.ids for e in encodings]
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists)) + 1  # + </s>
        stream = np.full(int(lengths.sum()), self.eos_id, dtype=np.int32)
        not_eos = np.ones(len(stream), dtype=bool)
        not_eos[np.cumsum(lengths) - 1] = False
        stream[not_eos] = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32,
                                      count=int(lengths.sum()) - len(id_lists))
        self.documents += len(texts)
        self.tokens += len(stream)
        stream = np.concatenate([self.carry, stream])
        full = len(stream) // self.raw_length * self.raw_length
        self.carry = stream[full:].copy()
        return stream[:full].reshape(-1, self.raw_length)


class ShardWriter:
    """Collect corrupted examples and write `data/part-UUUUU-KKKK.arrow` shards of `shard_rows` rows (tmp + rename)."""

    def __init__(self, out_dir: Path, unit_id: int, shard_rows: int) -> None:
        self.out_dir = out_dir
        self.unit_id = unit_id
        self.shard_rows = shard_rows
        self.pending_inputs: list[np.ndarray] = []
        self.pending_labels: list[np.ndarray] = []
        self.pending_rows = 0
        self.shards: list[dict] = []

    def add(self, input_ids: np.ndarray, labels: np.ndarray) -> None:
        self.pending_inputs.append(input_ids)
        self.pending_labels.append(labels)
        self.pending_rows += len(input_ids)
        while self.pending_rows >= self.shard_rows:
            self._flush(self.shard_rows)

    def close(self) -> list[dict]:
        if self.pending_rows:
            self._flush(self.pending_rows)
        return self.shards

    def _flush(self, rows: int) -> None:
        inputs = np.concatenate(self.pending_inputs)
        labels = np.concatenate(self.pending_labels)
        relative = shard_name(self.unit_id, len(self.shards))
        final = self.out_dir / relative
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        size = write_shard(tmp, inputs[:rows], labels[:rows])
        digest = sha256_file(tmp)
        os.replace(tmp, final)
        self.shards.append({"path": relative, "rows": rows, "bytes": size, "sha256": digest})
        self.pending_inputs, self.pending_labels = [inputs[rows:]], [labels[rows:]]
        self.pending_rows = len(inputs) - rows


_TOKENIZERS: dict[str, Any] = {}


def _cached_tokenizer(path: str):
    if path not in _TOKENIZERS:
        from tokenizer.t5 import load_tokenizer

        _TOKENIZERS[path] = load_tokenizer(path)
    return _TOKENIZERS[path]


def process_unit(job: dict, unit: dict) -> dict:
    """Run one work unit end to end and write its record; returns the record. Pure function of (job, unit)."""
    started = time.perf_counter()
    unit = WorkUnit(**unit)
    config = job["config"]
    tok = job["tokenizer"]
    spec = SpanSpec.derive(config["input_length"], config["noise_density"], config["mean_noise_span_length"])
    out_dir = Path(job["out"])
    rng = np.random.default_rng((config["seed"], unit.unit_id))
    rejected = RejectCounter()
    windows = TokenWindows(_cached_tokenizer(tok["path"]), spec.raw_length, tok["eos_id"])
    writer = ShardWriter(out_dir, unit.unit_id, config["shard_rows"])
    ready: list[np.ndarray] = []
    ready_rows = 0

    def corrupt(batch: list[np.ndarray]) -> None:
        raw = np.concatenate(batch)
        input_ids, labels = span_corrupt(raw, rng, spec, sentinel_first_id=tok["sentinel_first_id"],
                                         eos_id=tok["eos_id"], pad_id=tok["pad_id"])
        writer.add(input_ids, labels)

    for texts in batched_texts(unit_texts(unit, config["text_field"], config["max_doc_chars"], rejected)):
        new_windows = windows.push(texts)
        if len(new_windows):
            ready.append(new_windows)
            ready_rows += len(new_windows)
        if ready_rows >= WINDOWS_PER_CORRUPTION:
            corrupt(ready)
            ready, ready_rows = [], 0
    if ready_rows:
        corrupt(ready)
    shards = writer.close()
    record = {"unit": unit.to_json(), "fingerprint": job["fingerprint"], "shards": shards,
              "stats": {"documents": windows.documents, "tokens": windows.tokens,
                        "examples": sum(s["rows"] for s in shards), "dropped_tail_tokens": int(len(windows.carry)),
                        "input_bytes": unit.bytes, "seconds": round(time.perf_counter() - started, 3)},
              "rejected": dict(rejected)}
    atomic_write_json(unit_record_path(out_dir, unit.unit_id), record)
    return record


def unit_record_path(out_dir: Path, unit_id: int) -> Path:
    return Path(out_dir) / UNITS_DIR / f"{unit_id:05d}.json"


# ------------------------------------------------------------------------------------------ the job

def _shard_ok(out_dir: Path, shard: dict, check_sha: bool) -> bool:
    return shard_file_problem(out_dir, shard, check_sha=check_sha) is None


def completed_record(out_dir: Path, unit: WorkUnit, fp: str) -> dict | None:
    """The unit's record if it and all its shards are present and intact (sizes and checksums), else None."""
    import json

    path = unit_record_path(out_dir, unit.unit_id)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("fingerprint") != fp or record.get("unit") != unit.to_json():
        return None
    if not all(_shard_ok(out_dir, s, check_sha=True) for s in record["shards"]):
        return None
    return record


def _existing_fingerprints(out_dir: Path) -> set[str]:
    import json

    found = set()
    manifest = out_dir / MANIFEST_NAME
    if manifest.is_file():
        try:
            found.add(json.loads(manifest.read_text()).get("fingerprint"))
        except ValueError:
            found.add("unreadable")
    units = out_dir / UNITS_DIR
    if units.is_dir():
        for record in sorted(units.glob("*.json"))[:1]:
            try:
                found.add(json.loads(record.read_text()).get("fingerprint"))
            except ValueError:
                pass
    return found


def _clear_shard_set(out_dir: Path) -> None:
    """Remove what a previous prep job wrote (only our own names), for --overwrite."""
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for sub in (DATA_DIR, UNITS_DIR):
        if (out_dir / sub).is_dir():
            shutil.rmtree(out_dir / sub)


def _remove_temp_files(out_dir: Path) -> None:
    for sub in (DATA_DIR, UNITS_DIR):
        for tmp in (out_dir / sub).glob(".*.tmp"):
            tmp.unlink(missing_ok=True)


@dataclass
class PrepResult:
    manifest: dict
    out: Path
    units_total: int
    units_run: int
    seconds: float
    already_complete: bool = False
    totals: dict = field(default_factory=dict)


def plan_job(config: PrepConfig) -> tuple[dict, list[WorkUnit]]:
    """Resolve inputs, tokenizer and lengths into the job description every unit receives, plus the units."""
    from tokenizer.t5 import tokenizer_info

    spec = SpanSpec.derive(config.input_length, config.noise_density, config.mean_noise_span_length)
    tok = tokenizer_info(config.tokenizer)
    inputs = discover_inputs(config.inputs)
    input_digests = [{"path": item.path, "bytes": item.bytes, "sha256": _input_sha256(item)} for item in inputs]
    prep_config = manifest_config(config, spec)
    fp = fingerprint(prep_config, tok["sha256"], input_digests)
    units = plan_units(inputs, config.unit_bytes)
    job = {"config": prep_config, "tokenizer": tok, "inputs": input_digests, "fingerprint": fp,
           "out": str(Path(config.out).resolve())}
    return job, units


def _input_sha256(item) -> str:
    if item.kind == "arrow_dir":
        from pipeline.readers import _arrow_files

        return sha256_json([sha256_file(p) for p in _arrow_files(Path(item.path))])
    return sha256_file(item.path)


def build_shards(config: PrepConfig, run_units: Callable | None = None) -> PrepResult:
    """Plan, skip what is done, run the rest (on Ray unless `run_units` is given), write the manifest last."""
    started = time.perf_counter()
    job, units = plan_job(config)
    out_dir = Path(job["out"])
    fp = job["fingerprint"]
    others = _existing_fingerprints(out_dir) - {fp}
    if others:
        if not config.overwrite:
            raise UserError(f"{out_dir}: holds a different shard set (fingerprint {sorted(others)[0][:12]}..., "
                            f"this job {fp[:12]}...); pass --overwrite to replace it or choose another --out")
        _clear_shard_set(out_dir)
    (out_dir / DATA_DIR).mkdir(parents=True, exist_ok=True)
    (out_dir / UNITS_DIR).mkdir(parents=True, exist_ok=True)
    _remove_temp_files(out_dir)

    if (out_dir / MANIFEST_NAME).is_file():
        manifest = read_manifest(out_dir)
        if all(_shard_ok(out_dir, s, check_sha=True) for s in manifest["shards"]):
            return PrepResult(manifest, out_dir, len(units), 0, time.perf_counter() - started, already_complete=True,
                              totals=manifest["totals"])
        (out_dir / MANIFEST_NAME).unlink()  # a shard went missing or bad: redo what is needed

    records: dict[int, dict] = {}
    todo: list[WorkUnit] = []
    for unit in units:
        record = completed_record(out_dir, unit, fp)
        if record is None:
            todo.append(unit)
        else:
            records[unit.unit_id] = record
    if todo:
        if run_units is None:
            from pipeline.executor import run_units_on_ray

            run_units = run_units_on_ray
        for record in run_units(job, [u.to_json() for u in todo], workers=config.workers,
                                address=config.ray_address, progress=config.progress,
                                skipped_bytes=sum(u.bytes for u in units) - sum(u.bytes for u in todo)):
            records[record["unit"]["unit_id"]] = record
    manifest = assemble_manifest(job, [records[u.unit_id] for u in units])
    write_manifest(out_dir, manifest)
    return PrepResult(manifest, out_dir, len(units), len(todo), time.perf_counter() - started,
                      totals=manifest["totals"])


def assemble_manifest(job: dict, records: list[dict]) -> dict:
    shards = [s for r in records for s in r["shards"]]
    totals = {key: sum(r["stats"][key] for r in records) for key in ("documents", "tokens", "examples",
                                                                       "dropped_tail_tokens")}
    totals.update(shards=len(shards), bytes=sum(s["bytes"] for s in shards), units=len(records))
    rejected = RejectCounter()
    for record in records:
        for reason, count in record["rejected"].items():
            rejected[reason] = rejected.get(reason, 0) + count
    return {"format_version": FORMAT_VERSION, "tool_version": __version__, "config": job["config"],
            "tokenizer": job["tokenizer"], "inputs": job["inputs"], "shards": shards, "totals": totals,
            "rejected": dict(rejected), "fingerprint": job["fingerprint"]}


def config_dict(config: PrepConfig) -> dict:
    return asdict(config)
