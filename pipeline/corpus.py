"""`prep corpus`: plan a job, run its work units (one per slice of the inputs) on an executor, write the manifest.

    result = build_shards(CorpusConfig(input=["corpus.jsonl"], tokenizer="tok/tokenizer.json", out="shards/demo"))

`process_unit(job, unit)` runs one unit: `steps.unit_examples` (`readers.unit_texts` -> `steps.TokenWindows` ->
`steps.window_batches` -> `steps.corrupted`, span corruption) -> `steps.ShardWriter`; `pipeline.executor` runs it
on Ray. Each unit's randomness is `np.random.default_rng((seed, unit_id))`, so the bytes never depend on worker
count, cluster shape or timing. A unit is done when `units/UUUUU.json` exists (written after its shards);
`manifest.json` is written last.

`--out` must be new, empty, or a shard set this tool wrote (its `.t5zero-shards` marker, written first, or a
valid manifest); `--overwrite` makes the new set beside the old one (in `--out/.next/`), and only once it is complete
removes this tool's own files of the old one (manifest, unit records, shards, temp files), saying what it removes
first, and moves the new one in: a job that fails (a corrupt input, a full disk, a signal) leaves the old set whole.
A job that yields no example stops with a `UserError` that says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from pipeline.common import UserError, atomic_write_json, sha256_json, writing
from pipeline.config import CorpusConfig
from pipeline.executor import check_ray_address, run_units_on_ray
from pipeline.readers import RejectCounter, WorkUnit, discover_inputs, input_digest, plan_units
from pipeline.shard_format import (DATA_DIR, FORMAT_VERSION, MANIFEST_NAME, MARKER_NAME, UNITS_DIR, parse_manifest,
                                   read_manifest, shard_file_problem, write_manifest)
from pipeline.span_corruption import SpanSpec
from pipeline.steps import ShardWriter, tokenizer_errors_as_user_errors, unit_examples

TOOL_VERSION = "0.1.0"  # the manifest's tool_version
STAGING_DIR = ".next"  # --overwrite makes the new set here, beside the old one, and moves it in once it is complete
OWN_FILES = {DATA_DIR: re.compile(r"part-\d{5}-\d{4}\.arrow|\.part-\d{5}-\d{4}\.arrow\.\d+\.tmp"),
             UNITS_DIR: re.compile(r"\d{5}\.json|\.\d{5}\.json\.\w+\.tmp")}  # the only names --overwrite removes


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
    """Resolve inputs, tokenizer and lengths into the job every unit receives, plus the units; an --out that
    cannot hold this job's shard set is refused before the inputs are hashed."""
    from tokenizer.t5 import tokenizer_info

    with tokenizer_errors_as_user_errors():
        tokenizer = tokenizer_info(config.tokenizer)
    inputs = discover_inputs(config.input)
    check_out_dir(Path(config.out).resolve(), [item.path for item in inputs])
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
    examples, windows = unit_examples(unit, tokenizer, job.spec, job.seed, text_field=job.text_field,
                                      max_doc_chars=job.max_doc_chars, rejected=rejected)
    writer = ShardWriter(Path(job.out), unit.unit_id, job.shard_rows)
    for input_ids, labels in examples:
        writer.add(input_ids, labels)
    shards = writer.close()
    record = {"unit": unit.to_json(), "fingerprint": job.fingerprint, "shards": shards,
              "stats": {"documents": windows.documents, "tokens": windows.tokens,
                        "examples": sum(s["rows"] for s in shards), "dropped_tail_tokens": int(len(windows.carry)),
                        "input_bytes": unit.bytes, "seconds": round(time.perf_counter() - started, 3)},
              "rejected": dict(rejected)}
    path = unit_record_path(job.out, unit.unit_id)
    with writing(path, fix="free some space or choose another --out; a rerun resumes"):
        atomic_write_json(path, record)
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
        for record in sorted(u for u in units.glob("*.json") if OWN_FILES[UNITS_DIR].fullmatch(u.name))[:1]:
            try:
                found.add(json.loads(record.read_text()).get("fingerprint"))
            except ValueError:
                pass
    return found


def _owned(out_dir: Path) -> bool:
    """Whether `out_dir` is a shard set this tool wrote: its marker, or (sets older than the marker) a manifest."""
    if (out_dir / MARKER_NAME).is_file():
        return True
    try:
        parse_manifest((out_dir / MANIFEST_NAME).read_bytes(), out_dir / MANIFEST_NAME)
    except (OSError, UserError):
        return False
    return True


def check_out_dir(out_dir: Path, input_paths: list[str]) -> None:
    """Refuse an --out that is a file, that holds files prep did not write, or that holds an input."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: a file, not a directory; choose a directory for --out")
    for path in input_paths:
        if Path(path).is_relative_to(out_dir):
            raise UserError(f"{path}: this input lies inside --out {out_dir}, where prep writes and "
                            f"--overwrite removes files; choose an --out outside the corpus")
    if out_dir.is_dir() and not _owned(out_dir):
        entries = sorted(p.name for p in out_dir.iterdir())
        if entries:
            shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
            raise UserError(f"{out_dir}: not empty ({shown}) and not a shard set written by `prep corpus` (no "
                            f"{MARKER_NAME} marker); choose a new or empty --out (nothing was changed)")


def own_files(out_dir: Path) -> list[Path]:
    """This tool's files in a shard set: manifest, unit records, shards and their temp files (nothing else)."""
    found = [out_dir / MANIFEST_NAME] if (out_dir / MANIFEST_NAME).is_file() else []
    for sub, pattern in OWN_FILES.items():
        if (out_dir / sub).is_dir():
            found += sorted(p for p in (out_dir / sub).iterdir() if p.is_file() and pattern.fullmatch(p.name))
    return found


def _clear_shard_set(out_dir: Path, others: set[str]) -> None:
    """--overwrite: say what goes, then remove only this tool's own files (other files in --out stay)."""
    files = own_files(out_dir)
    shards = [p for p in files if p.parent.name == DATA_DIR and p.suffix == ".arrow"]
    records = [p for p in files if p.parent.name == UNITS_DIR and p.suffix == ".json"]
    temps = [p for p in files if p.name.endswith(".tmp")]
    size = sum(p.stat().st_size for p in shards)
    manifest = "manifest.json, " if (out_dir / MANIFEST_NAME) in files else ""
    print(f"prep corpus --overwrite: removing the shard set {sorted(others)[0][:12]}... in {out_dir}: {manifest}"
          f"{len(records)} unit records, {len(shards)} shards ({size / 2**20:,.1f} MiB), {len(temps)} temp files; "
          f"nothing else there is touched", file=sys.stderr, flush=True)
    with writing(out_dir, fix="make --out writable to replace its shard set, or choose another --out"):
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # first: the set is no longer complete
        for path in files:
            path.unlink(missing_ok=True)


def _remove_temp_files(out_dir: Path) -> None:
    for path in own_files(out_dir):
        if path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)


def _make_dirs(out_dir: Path) -> None:
    """data/ and units/ (for the shards and unit records), without the temp files of a job cut short."""
    (out_dir / DATA_DIR).mkdir(parents=True, exist_ok=True)
    (out_dir / UNITS_DIR).mkdir(parents=True, exist_ok=True)
    _remove_temp_files(out_dir)


def _claim(out_dir: Path) -> None:
    """Make --out a shard set of ours: the directories and the marker, written before any shard."""
    with writing(out_dir, fix="choose a writable --out with free space"):
        _make_dirs(out_dir)
        if not (out_dir / MARKER_NAME).is_file():
            atomic_write_json(out_dir / MARKER_NAME, {"written_by": "t5zero prep corpus", "tool_version": TOOL_VERSION,
                                                      "note": "prep corpus --overwrite removes only its own files here"})


def _move_in(staging: Path, out_dir: Path, records: list[dict]) -> None:
    """Move finished units from the staging directory into --out: each unit's shards, then its record (so a unit
    whose record is in --out is whole there; one cut short stays in staging, or runs again)."""
    for record in records:
        for shard in record["shards"]:
            os.replace(staging / shard["path"], out_dir / shard["path"])
        unit_id = record["unit"]["unit_id"]
        os.replace(unit_record_path(staging, unit_id), unit_record_path(out_dir, unit_id))


def _remove_staging(staging: Path) -> None:
    """The staging directory's own files, then the directory (a file there that is not ours keeps it)."""
    for path in own_files(staging):
        path.unlink(missing_ok=True)
    for directory in (staging / DATA_DIR, staging / UNITS_DIR, staging):
        try:
            directory.rmdir()
        except OSError:
            pass


def _finish_staged_units(job: CorpusJob, units: list[WorkUnit]) -> None:
    """A job without another set in --out, after an --overwrite cut short while it moved the new set in: the units
    still in the staging directory whole are moved in (the rest run again in --out), and the directory goes."""
    staging = Path(job.out) / STAGING_DIR
    if not staging.is_dir():
        return
    staged = dataclasses.replace(job, out=str(staging))
    with writing(job.out, fix="make --out writable so that prep can finish it, or choose another --out"):
        _move_in(staging, Path(job.out), [r for u in units if (r := completed_record(staged, u)) is not None])
        _remove_staging(staging)


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
    """Plan, skip what is done, run the rest with `run_units` (Ray), write the manifest last.

    With --overwrite over another set, the units run in `--out/.next/` and the old set is removed only when every
    unit there is done: everything that can fail (an input, the disk, Ray, a signal) fails while the old set is
    still whole, and the same command resumes. It needs room for both sets until then."""
    started = time.perf_counter()
    job, units = plan_job(config)
    out_dir = Path(job.out)
    others = _existing_fingerprints(out_dir) - {job.fingerprint}
    if others and not config.overwrite:
        raise UserError(f"{out_dir}: holds a different shard set (fingerprint {sorted(others)[0][:12]}..., "
                        f"this job {job.fingerprint[:12]}...); pass --overwrite to replace it or choose another "
                        f"--out")
    if not others and (out_dir / MANIFEST_NAME).is_file():
        try:
            manifest = read_manifest(out_dir)
        except UserError:  # this job's manifest, cut or edited by hand: made again from the unit records
            manifest = None
        if manifest and all(_shard_ok(out_dir, s) for s in manifest["shards"]):  # done: nothing is written
            return CorpusResult(manifest, out_dir, len(units), 0, time.perf_counter() - started,
                                already_complete=True, totals=manifest["totals"])
        with writing(out_dir, fix="make --out writable so that prep can repair it, or choose another --out"):
            (out_dir / MANIFEST_NAME).unlink()  # a shard went missing or bad: redo what is needed
    if config.ray_address:
        check_ray_address(config.ray_address)  # before anything is written
    _claim(out_dir)
    staging = out_dir / STAGING_DIR
    if others:
        print(f"prep corpus --overwrite: making the new shard set in {staging}; the shard set "
              f"{sorted(others)[0][:12]}... in {out_dir} stays until it is complete", file=sys.stderr, flush=True)
        with writing(staging, fix="choose a writable --out with free space"):
            _make_dirs(staging)
    else:
        _finish_staged_units(job, units)
    build_job = dataclasses.replace(job, out=str(staging)) if others else job

    records: dict[int, dict] = {}
    todo: list[WorkUnit] = []
    for unit in units:
        record = completed_record(build_job, unit)
        if record is None:
            todo.append(unit)
        else:
            records[unit.unit_id] = record
    if todo:
        for record in run_units(process_unit, build_job, todo, workers=config.workers, address=config.ray_address,
                                progress=not config.quiet,
                                skipped_bytes=sum(u.bytes for u in units) - sum(u.bytes for u in todo)):
            records[record["unit"]["unit_id"]] = record
    manifest = assemble_manifest(job, [records[u.unit_id] for u in units])
    if manifest["totals"]["examples"] == 0:
        for unit in units:  # nothing to keep: leave --out as an empty shard set of ours, not a half-made one
            unit_record_path(build_job.out, unit.unit_id).unlink(missing_ok=True)
        if others:
            _remove_staging(staging)
        raise UserError(no_examples_message(job, manifest))
    if others:  # the new set is complete beside the old one: now the old one goes and the new one moves in
        _clear_shard_set(out_dir, others)
        with writing(out_dir, fix="make --out writable, then rerun the same command to finish the move"):
            _move_in(staging, out_dir, [records[u.unit_id] for u in units])
            _remove_staging(staging)
    with writing(out_dir / MANIFEST_NAME, fix="free some space or choose another --out; a rerun resumes"):
        write_manifest(out_dir, manifest)
    return CorpusResult(manifest, out_dir, len(units), len(todo), time.perf_counter() - started,
                        totals=manifest["totals"])


def no_examples_message(job: CorpusJob, manifest: dict) -> str:
    """Why a job made no example, and what to change."""
    totals, rejected = manifest["totals"], {k: v for k, v in manifest["rejected"].items() if v}
    inputs = job.inputs[0]["path"] if len(job.inputs) == 1 else f"{len(job.inputs)} inputs"
    skipped = f"; skipped {', '.join(f'{k} {v:,}' for k, v in sorted(rejected.items()))}" if rejected else ""
    if rejected.get("missing_text", 0) + rejected.get("not_text", 0) > totals["documents"]:
        fix = f"name the field that holds the text with --text-field (now {job.text_field!r})"
    elif totals["documents"] == 0:
        fix = "pass a corpus with text in it (.jsonl records, .txt lines, a parquet/arrow text column)"
    else:
        fix = "give more text, a smaller --input-length, or a larger --unit-bytes"
    return (f"{inputs}: no examples made ({totals['documents']:,} documents, {totals['tokens']:,} tokens; an "
            f"example needs {job.spec.raw_length} tokens within one work unit{skipped}); {fix}; nothing was written")


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
