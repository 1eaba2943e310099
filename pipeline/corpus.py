"""`prep corpus`: plan a job, run its work units (one per slice of the inputs) on an executor, write the manifest.

    result = build_shards(CorpusConfig(input=["corpus.jsonl"], tokenizer="tok/tokenizer.json", out="shards/demo"))

`process_unit(job, unit)` composes the steps for one unit: `readers.unit_texts` -> `steps.TokenWindows` ->
`steps.window_batches` -> `steps.corrupted` (span corruption) -> `steps.ShardWriter`; `pipeline.executor` runs it
on Ray. Each unit's randomness is `np.random.default_rng((seed, unit_id))`, so the bytes never depend on worker
count, cluster shape or timing. A unit is done when `units/UUUUU.json` exists (written after its shards);
`manifest.json` is written last.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline.common import UserError, atomic_write_json, sha256_json
from pipeline.config import CorpusConfig
from pipeline.executor import run_units_on_ray
from pipeline.readers import (RejectCounter, WorkUnit, batched_texts, discover_inputs, input_digest, plan_units,
                              unit_texts)
from pipeline.shard_format import (DATA_DIR, FORMAT_VERSION, MANIFEST_NAME, UNITS_DIR, read_manifest,
                                   shard_file_problem, write_manifest)
from pipeline.span_corruption import SpanSpec
from pipeline.steps import (WINDOWS_PER_CORRUPTION, ShardWriter, TokenWindows, cached_t5_tokenizer, corrupted,
                            tokenizer_errors_as_user_errors, window_batches)

TOOL_VERSION = "0.1.0"  # the manifest's tool_version


@dataclass(frozen=True)
class CorpusJob:
    """What every unit of one job receives (put into Ray's object store once): the settings that shape the bytes,
    the tokenizer and input digests, and where to write."""

    out: str  # absolute shard set directory
    spec: SpanSpec
    seed: int
    shard_rows: int
    text_field: str
    max_doc_chars: int
    unit_bytes: int
    tokenizer: dict  # the manifest's "tokenizer" section (path, sha256, special ids)
    inputs: tuple[dict, ...]  # the manifest's "inputs" section (path, bytes, sha256)

    def manifest_config(self) -> dict[str, Any]:
        """The manifest's "config" section: every setting that shapes the shard bytes."""
        spec = self.spec
        return {"input_length": spec.input_length, "target_length": spec.target_length,
                "raw_length": spec.raw_length, "noise_density": spec.noise_density,
                "mean_noise_span_length": spec.mean_noise_span_length, "num_noise_tokens": spec.num_noise_tokens,
                "num_noise_spans": spec.num_noise_spans, "seed": self.seed, "shard_rows": self.shard_rows,
                "text_field": self.text_field, "max_doc_chars": self.max_doc_chars, "unit_bytes": self.unit_bytes}

    @cached_property
    def fingerprint(self) -> str:
        """hash(config, tokenizer bytes, input bytes): equal fingerprints mean byte-identical shard sets."""
        return sha256_json({"format_version": FORMAT_VERSION, "config": self.manifest_config(),
                            "tokenizer_sha256": self.tokenizer["sha256"],
                            "inputs": [[item["bytes"], item["sha256"]] for item in self.inputs]})


def plan_job(config: CorpusConfig) -> tuple[CorpusJob, list[WorkUnit]]:
    """Resolve inputs, tokenizer and lengths into the job every unit receives, plus the units."""
    from tokenizer.t5 import tokenizer_info

    with tokenizer_errors_as_user_errors():
        tokenizer = tokenizer_info(config.tokenizer)
    inputs = discover_inputs(config.input)
    job = CorpusJob(out=str(Path(config.out).resolve()), spec=config.span_spec(), seed=config.seed,
                    shard_rows=config.resolved_shard_rows(), text_field=config.text_field,
                    max_doc_chars=config.max_doc_chars, unit_bytes=config.unit_bytes, tokenizer=tokenizer,
                    inputs=tuple(input_digest(item) for item in inputs))
    return job, plan_units(inputs, config.unit_bytes)


# ----------------------------------------------------------------------------------------------- one unit

def process_unit(job: CorpusJob, unit: WorkUnit) -> dict:
    """Run one work unit end to end and write its record; returns the record. Pure function of (job, unit)."""
    started = time.perf_counter()
    tokenizer = job.tokenizer
    rejected = RejectCounter()
    texts = unit_texts(unit, job.text_field, job.max_doc_chars, rejected)
    windows = TokenWindows(cached_t5_tokenizer(tokenizer["path"]), job.spec.raw_length, tokenizer["eos_id"])
    raw_batches = window_batches(map(windows.push, batched_texts(texts)), WINDOWS_PER_CORRUPTION)
    rng = np.random.default_rng((job.seed, unit.unit_id))
    writer = ShardWriter(Path(job.out), unit.unit_id, job.shard_rows)
    for input_ids, labels in corrupted(raw_batches, rng, job.spec, tokenizer):
        writer.add(input_ids, labels)
    shards = writer.close()
    record = {"unit": unit.to_json(), "fingerprint": job.fingerprint, "shards": shards,
              "stats": {"documents": windows.documents, "tokens": windows.tokens,
                        "examples": sum(s["rows"] for s in shards), "dropped_tail_tokens": int(len(windows.carry)),
                        "input_bytes": unit.bytes, "seconds": round(time.perf_counter() - started, 3)},
              "rejected": dict(rejected)}
    atomic_write_json(unit_record_path(job.out, unit.unit_id), record)
    return record


def unit_record_path(out_dir: str | Path, unit_id: int) -> Path:
    return Path(out_dir) / UNITS_DIR / f"{unit_id:05d}.json"


# ------------------------------------------------------------------------------------------ the job

def _shard_ok(out_dir: Path, shard: dict) -> bool:
    return shard_file_problem(out_dir, shard, check_sha=True) is None


def completed_record(job: CorpusJob, unit: WorkUnit) -> dict | None:
    """The unit's record if it and all its shards are present and intact (sizes and checksums), else None."""
    try:
        record = json.loads(unit_record_path(job.out, unit.unit_id).read_text())
    except (OSError, ValueError):
        return None
    if record.get("fingerprint") != job.fingerprint or record.get("unit") != unit.to_json():
        return None
    if not all(_shard_ok(Path(job.out), s) for s in record["shards"]):
        return None
    return record


def _existing_fingerprints(out_dir: Path) -> set[str]:
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
class CorpusResult:
    manifest: dict
    out: Path
    units_total: int
    units_run: int
    seconds: float
    already_complete: bool = False
    totals: dict = field(default_factory=dict)


def build_shards(config: CorpusConfig, run_units: Callable = run_units_on_ray) -> CorpusResult:
    """Plan, skip what is done, run the rest with `run_units` (Ray), write the manifest last."""
    started = time.perf_counter()
    job, units = plan_job(config)
    out_dir = Path(job.out)
    others = _existing_fingerprints(out_dir) - {job.fingerprint}
    if others:
        if not config.overwrite:
            raise UserError(f"{out_dir}: holds a different shard set (fingerprint {sorted(others)[0][:12]}..., "
                            f"this job {job.fingerprint[:12]}...); pass --overwrite to replace it or choose another "
                            f"--out")
        _clear_shard_set(out_dir)
    (out_dir / DATA_DIR).mkdir(parents=True, exist_ok=True)
    (out_dir / UNITS_DIR).mkdir(parents=True, exist_ok=True)
    _remove_temp_files(out_dir)

    if (out_dir / MANIFEST_NAME).is_file():
        manifest = read_manifest(out_dir)
        if all(_shard_ok(out_dir, s) for s in manifest["shards"]):
            return CorpusResult(manifest, out_dir, len(units), 0, time.perf_counter() - started,
                                already_complete=True, totals=manifest["totals"])
        (out_dir / MANIFEST_NAME).unlink()  # a shard went missing or bad: redo what is needed

    records: dict[int, dict] = {}
    todo: list[WorkUnit] = []
    for unit in units:
        record = completed_record(job, unit)
        if record is None:
            todo.append(unit)
        else:
            records[unit.unit_id] = record
    if todo:
        for record in run_units(process_unit, job, todo, workers=config.workers, address=config.ray_address,
                                progress=not config.quiet,
                                skipped_bytes=sum(u.bytes for u in units) - sum(u.bytes for u in todo)):
            records[record["unit"]["unit_id"]] = record
    manifest = assemble_manifest(job, [records[u.unit_id] for u in units])
    write_manifest(out_dir, manifest)
    return CorpusResult(manifest, out_dir, len(units), len(todo), time.perf_counter() - started,
                        totals=manifest["totals"])


def assemble_manifest(job: CorpusJob, records: list[dict]) -> dict:
    shards = [s for r in records for s in r["shards"]]
    totals = {key: sum(r["stats"][key] for r in records) for key in ("documents", "tokens", "examples",
                                                                       "dropped_tail_tokens")}
    totals.update(shards=len(shards), bytes=sum(s["bytes"] for s in shards), units=len(records))
    rejected = RejectCounter()
    for record in records:
        for reason, count in record["rejected"].items():
            rejected[reason] = rejected.get(reason, 0) + count
    return {"format_version": FORMAT_VERSION, "tool_version": TOOL_VERSION, "config": job.manifest_config(),
            "tokenizer": job.tokenizer, "inputs": list(job.inputs), "shards": shards, "totals": totals,
            "rejected": dict(rejected), "fingerprint": job.fingerprint}
