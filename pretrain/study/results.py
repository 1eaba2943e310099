"""A study's results: each finished point's metrics -> one row, results.csv written and read back, and the whole
report (results.csv, report.md, the plots) rebuilt from STUDY/runs.

    rebuild_report("studies/cpu-tiny")      # or: study report studies/cpu-tiny

The grid columns of results.csv are the study's axes, as the point records name them (the classic axes, then
any other pretrain setting the grid varies), never a list kept here; the metric columns follow.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shlex
from pathlib import Path
from typing import Any, Iterable, Sequence

from pipeline.common import UserError, atomic_write_bytes, writing
from pipeline.settings import field_names, setting_type
from pretrain.config import TrainConfig
from pretrain.hostcpu import HOST_KEYS
from pretrain.metrics import PHASE_KEYS, largest_peak, read_metrics, steady_state_figures
from pretrain.study import plots, report
from pretrain.study.grid import CLASSIC_AXES, REPEAT_SUFFIX

STUDY_FILE = "study.json"
POINT_FILE = "study_point.json"
POINT_CONFIG = "point.yaml"
RUNS_DIR = "runs"
RESULTS_CSV = "results.csv"
FINISHED_STATUSES = ("ok", "failed", "oom", "timeout")
HOST_COLUMNS = HOST_KEYS      # rank 0's host accounting, medians over the steady steps (pretrain.hostcpu)
METRIC_COLUMNS = ("repeat", "global_batch", "grad_accum", "steps", "cudagraphs", "status", "reason", "steps_done",
                  "steps_measured", "tokens_per_s", "tokens_per_s_spread", "samples_per_s", "tflops_per_gpu", "mfu",
                  "step_time_s", "data_wait_s", "compute_s", *PHASE_KEYS, "data_wait_share", "peak_mem_gib",
                  "peak_reserved_gib", "est_gpu_gib", "est_cpu_gib", "est_method", "wall_s", *HOST_COLUMNS)
"""The columns after the axes; a TrainConfig field among them (steps, global_batch, cudagraphs: what the run
resolved, its auto included, which sets the memory it needed) is typed as the field."""
INT_COLUMNS = {"repeat", "grad_accum", "steps_done", "steps_measured"}
FLOAT_COLUMNS = {"tokens_per_s", "tokens_per_s_spread", "samples_per_s", "tflops_per_gpu", "mfu", "step_time_s",
                 "data_wait_s", "compute_s", *PHASE_KEYS, "data_wait_share", "peak_mem_gib", "peak_reserved_gib",
                 "est_gpu_gib", "est_cpu_gib", "wall_s", *HOST_COLUMNS}
TEXT_COLUMNS = {"reason", "est_method"}     # empty reads back as "", not None
_SETTINGS = field_names(TrainConfig)


def result_columns(axes: Sequence[str] = CLASSIC_AXES) -> tuple[str, ...]:
    """results.csv's header: point_id, the axes, then the metric columns not already among them."""
    return ("point_id", *axes, *(column for column in METRIC_COLUMNS if column not in axes))


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_results_csv(rows: list[dict[str, Any]], path: str | os.PathLike,
                      axes: Sequence[str] = CLASSIC_AXES) -> None:
    """One row per point, columns `result_columns(axes)`, written atomically."""
    columns = result_columns(axes)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(column)) for column in columns])
    atomic_write_bytes(path, buffer.getvalue().encode())


def _parse(column: str, text: str) -> Any:
    if text == "":
        return "" if column in TEXT_COLUMNS else None
    kind = setting_type(TrainConfig, column) or (int if column in INT_COLUMNS else float if column in FLOAT_COLUMNS else str)
    if kind is bool:
        return text.strip().lower() in ("true", "1", "yes")
    if kind is int:
        return int(float(text))
    return float(text) if kind is float else text


def csv_axes(header: Iterable[str]) -> tuple[str, ...]:
    """The axes of a results.csv: the classic ones, then every other pretrain-setting column before the metrics."""
    header = list(header)
    if "repeat" in header:      # the metrics begin there: a setting before it is an axis (cudagraphs may be either)
        extra = [c for c in header[:header.index("repeat")] if c in _SETTINGS and c not in CLASSIC_AXES]
    else:                       # a file from before repeats
        extra = [c for c in header if c in _SETTINGS and c not in CLASSIC_AXES and c not in METRIC_COLUMNS]
    return (*CLASSIC_AXES, *extra)


def read_results_csv(path: str | os.PathLike) -> list[dict[str, Any]]:
    """results.csv -> typed rows (ints, floats, bools as the pretrain settings and metrics are; empty is None)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such results file; run `study run` first")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("model", "zero", "offload", "status") if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path}: lacks columns {missing}; rebuild it with `study report STUDY_DIR`")
        columns = result_columns(csv_axes(reader.fieldnames or []))
        return [{column: _parse(column, row.get(column) or "") for column in columns} for row in reader]


# ------------------------------------------------------------------------------------------------ one point

def summarize_metrics(metrics: list[dict[str, Any]], skip_steps: int) -> dict[str, Any]:
    """Steady-state figures of one run's metrics (steps after `skip_steps`, less the steps run under the profiler,
    as pretrain's own summary.json; pretrain.metrics.steady_state_figures); peak memory is the max of all steps."""
    after_skip = [m for m in metrics if int(m.get("step", 0)) > skip_steps]
    steady = [m for m in after_skip if not m.get("profiled")] or after_skip[-1:]
    out: dict[str, Any] = {"steps_done": len(metrics), "steps_measured": len(steady)}
    if not steady:
        return out
    out.update(steady_state_figures(steady))
    for key in ("peak_mem_gib", "peak_reserved_gib"):
        out[key] = largest_peak(metrics, key)
    out["grad_accum"] = steady[-1].get("grad_accum")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def result_row(record: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One results.csv row from a finished point's record (study_point.json) and its run dir."""
    config = record["config"]
    launched = _read_json(run_dir / "config.json")      # what pretrain resolved, when it got that far
    row: dict[str, Any] = dict(record["point"])
    row.update(point_id=record["point_id"], repeat=record.get("repeat", 1), status=record["status"],
               reason=record.get("reason", ""),
               steps=config["steps"], global_batch=launched.get("global_batch", config["global_batch"]),
               cudagraphs=(launched.get("train") or config).get("cudagraphs"), wall_s=record.get("wall_s"))
    row.update(summarize_metrics(read_metrics(run_dir / "metrics.jsonl"), config["steady_skip"]))
    if launched:
        estimate = launched.get("memory_estimate") or {}
        row.update(est_gpu_gib=estimate.get("per_gpu_gib"), est_cpu_gib=estimate.get("per_cpu_gib"),
                   est_method=estimate.get("method"))
    return row


def read_point_record(run_dir: Path) -> dict[str, Any] | None:
    """A point's study_point.json, if the point finished (the record is written last)."""
    record = _read_json(run_dir / POINT_FILE)
    return record if record.get("status") in FINISHED_STATUSES else None


def finished_points(study_dir: Path) -> list[tuple[dict[str, Any], Path]]:
    """(record, run dir) of every finished point under STUDY/runs, in grid order where known, else by id."""
    runs = study_dir / RUNS_DIR
    found = []
    for run_dir in sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []:
        record = read_point_record(run_dir)
        if record is not None:
            found.append((record.get("order", 1 << 30), run_dir.name, record, run_dir))
    return [(record, run_dir) for _, _, record, run_dir in sorted(found, key=lambda r: r[:2])]


def recorded_axes(records: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """The axes the point records name, classic ones first, the others in the order they appear."""
    return tuple(dict.fromkeys([*CLASSIC_AXES, *(axis for record in records for axis in record["point"])]))


# ------------------------------------------------------------------------------------------------ repeats

SPREAD_FIGURES = ("tokens_per_s", "step_time_s", "data_wait_share")
"""The figures whose min and max over a point's runs the report shows (`<figure>_min`, `<figure>_max`)."""


def config_id(row: dict[str, Any]) -> str:
    """The id a row's point has without its run suffix: the runs of one point share it."""
    return REPEAT_SUFFIX.sub("", row["point_id"])


def combine_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point from results rows that may hold several runs of it (a grid's `repeats`).

    A point with one run keeps its row. For several: the run whose tokens/s is the median of the ok runs stands
    for the point (so its figures stay one consistent run), with `runs` (ok runs / runs), `<figure>_min` and
    `_max` over the ok runs, and `tokens_per_s_spread` widened to (max - min) / median where that is larger than
    the runs' own step-to-step spread: the report calls two points the same within that spread. A point whose
    runs all failed keeps its first run's row."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(config_id(row), []).append(row)
    combined = []
    for ident, runs in groups.items():
        ok = sorted((r for r in runs if r["status"] == "ok" and r.get("tokens_per_s")), key=lambda r: r["tokens_per_s"])
        if len(runs) == 1 or not ok:
            combined.append({**runs[0], "point_id": ident, "runs": f"{len(ok)}/{len(runs)}"})
            continue
        middle = ok[(len(ok) - 1) // 2]
        row = {**middle, "point_id": ident, "runs": f"{len(ok)}/{len(runs)}"}
        for figure in SPREAD_FIGURES:
            values = [r[figure] for r in ok if r.get(figure) is not None]
            if values:
                row[f"{figure}_min"], row[f"{figure}_max"] = min(values), max(values)
        across = (ok[-1]["tokens_per_s"] - ok[0]["tokens_per_s"]) / middle["tokens_per_s"]
        row["tokens_per_s_spread"] = max(across, *(r.get("tokens_per_s_spread") or 0.0 for r in ok))
        combined.append(row)
    return combined


# ------------------------------------------------------------------------------------------------ the report

def write_report(rows: list[dict[str, Any]], out_dir: str | os.PathLike, setup: dict[str, Any],
                 axes: Sequence[str] = CLASSIC_AXES) -> dict[str, Any]:
    """results.csv (one row per run), report.md and the PNGs in `out_dir` (one row per point: combine_runs)."""
    out_dir = Path(out_dir)
    extra_axes = tuple(axis for axis in axes if axis not in CLASSIC_AXES)
    csv_path = out_dir / RESULTS_CSV
    write_results_csv(rows, csv_path, axes)
    rows = combine_runs(rows)
    written_plots = plots.write_plots(rows, out_dir, extra_axes=extra_axes)
    md_path = out_dir / report.REPORT_MD
    atomic_write_bytes(md_path, report.render_markdown(rows, setup, written_plots, extra_axes=extra_axes).encode())
    return {"csv": csv_path, "md": md_path, "plots": list(written_plots.values())}


def rebuild_report(study_dir: str | os.PathLike) -> dict[str, Any]:
    """results.csv, report.md and the plots from the run dirs (or from results.csv if there are none)."""
    study_dir = Path(study_dir)
    if not study_dir.is_dir():
        raise UserError(f"{study_dir}: " + ("a file, not a study directory" if study_dir.exists() else
                                            "no such study directory")
                        + "; give the --out of a `study run` (or a directory holding its results.csv)")
    setup = _read_json(study_dir / STUDY_FILE)
    points = finished_points(study_dir)
    rows = [result_row(record, run_dir) for record, run_dir in points]
    axes = recorded_axes(record for record, _ in points)
    if points:  # one point's exact command, to reproduce it by hand
        setup["point_command"] = shlex.join(points[0][0]["command"])
    if not rows and (study_dir / RESULTS_CSV).is_file():
        rows = read_results_csv(study_dir / RESULTS_CSV)
        axes = csv_axes(rows[0]) if rows else CLASSIC_AXES
    if not rows:
        raise UserError(f"{study_dir}: no finished points under {RUNS_DIR}/ and no {RESULTS_CSV}; "
                        f"run `study run GRID.yaml --out {study_dir}` first")
    with writing(study_dir, f"make {study_dir} writable, or copy it somewhere writable and run `study report` there"):
        return write_report(rows, study_dir, setup, axes)
