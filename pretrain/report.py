"""Study results -> results.csv, report.md (tables + recommendations derived from the data) and PNG plots.

    write_report(read_results_csv("studies/x/results.csv"), "studies/x", setup={})   # or: study report studies/x
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from pipeline.common import UserError, atomic_write_bytes

RESULTS_CSV = "results.csv"
REPORT_MD = "report.md"
GRID_COLUMNS = ("model", "zero", "offload", "micro_batch", "loader_workers", "nproc", "activation_checkpointing")
RESULT_COLUMNS = ("point_id", *GRID_COLUMNS, "global_batch", "grad_accum", "steps", "status", "reason",
                  "steps_done", "steps_measured", "tokens_per_s", "tokens_per_s_spread", "samples_per_s", "tflops_per_gpu", "mfu",
                  "step_time_s", "data_wait_s", "compute_s", "data_wait_share", "peak_mem_gib", "est_gpu_gib",
                  "est_cpu_gib", "est_method", "wall_s")
INT_COLUMNS = {"zero", "micro_batch", "loader_workers", "nproc", "global_batch", "grad_accum", "steps",
               "steps_done", "steps_measured"}
FLOAT_COLUMNS = {"tokens_per_s", "tokens_per_s_spread", "samples_per_s", "tflops_per_gpu", "mfu", "step_time_s", "data_wait_s",
                 "compute_s", "data_wait_share", "peak_mem_gib", "est_gpu_gib", "est_cpu_gib", "wall_s"}
DATA_WAIT_TARGET = 0.01
"""The data-wait share the loader-worker recommendation aims under (1% of step time)."""
TIE_MARGIN = 0.03
"""Throughputs within this fraction of each other, or within either point's own step-to-step spread
(tokens_per_s_spread, when recorded), are reported as a tie: the steps measured cannot separate them."""
PLOTS = {"throughput": "throughput.png", "memory": "memory.png", "data_wait": "data_wait.png",
         "step_time": "step_time.png"}


# ------------------------------------------------------------------------------------------------ csv

def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_results_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """One row per point, columns RESULT_COLUMNS, written atomically."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(RESULT_COLUMNS)
    for row in rows:
        writer.writerow([_cell(row.get(column)) for column in RESULT_COLUMNS])
    atomic_write_bytes(path, buffer.getvalue().encode())


def _parse(column: str, text: str) -> Any:
    if text == "":
        return None if column not in ("reason", "est_method") else ""
    if column in INT_COLUMNS:
        return int(float(text))
    if column in FLOAT_COLUMNS:
        return float(text)
    if column == "activation_checkpointing":
        return text.strip().lower() in ("true", "1", "yes")
    return text


def read_results_csv(path: str | os.PathLike) -> list[dict[str, Any]]:
    """results.csv -> typed rows (ints, floats, bools; empty cells are None)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such results file; run `study run` first")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("model", "zero", "offload", "status") if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path}: lacks columns {missing}; rebuild it with `study report STUDY_DIR`")
        return [{column: _parse(column, row.get(column) or "") for column in RESULT_COLUMNS} for row in reader]


# ------------------------------------------------------------------------------------------------ helpers

def stage_label(zero: int, offload: str) -> str:
    return f"ZeRO-{zero}" + ("" if offload in (None, "", "none") else f" + {offload} offload")


def _group_label(model: str, nproc: int, several_nproc: bool) -> str:
    return f"{model} ({nproc} GPU{'s' if nproc != 1 else ''})" if several_nproc else model


def _fmt(value: Any, spec: str = ".3g", scale: float = 1.0, suffix: str = "") -> str:
    if value is None:
        return "–"
    return f"{value * scale:{spec}}{suffix}"


def format_rate(tokens_per_s: float | None) -> str:
    """41234.5 -> "41.2k tok/s"; None -> "–"."""
    if tokens_per_s is None:
        return "–"
    return f"{tokens_per_s / 1e3:.1f}k tok/s" if tokens_per_s >= 1e3 else f"{tokens_per_s:.0f} tok/s"


def _ok(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s") is not None]


def _largest(rows: Iterable[dict[str, Any]], key: str, default: Any = None) -> Any:
    """The largest recorded (non-empty) value of `key` over `rows`, else `default`."""
    return max((r[key] for r in rows if r.get(key) is not None), default=default)


def _by(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[tuple(row[k] for k in keys)].append(row)
    return dict(groups)


def _stage_order(rows: Iterable[dict[str, Any]]) -> list[tuple[int, str]]:
    order = {"none": 0, "cpu": 1, "nvme": 2}
    return sorted({(r["zero"], r["offload"]) for r in rows}, key=lambda s: (s[0], order.get(s[1], 3)))


def _describe(row: dict[str, Any], *, with_workers: bool = True) -> str:
    parts = [stage_label(row["zero"], row["offload"]), f"micro batch {row['micro_batch']}"]
    if with_workers:
        parts.append(f"{row['loader_workers']} loader worker{'s' if row['loader_workers'] != 1 else ''}")
    if row.get("activation_checkpointing"):
        parts.append("activation checkpointing")
    return ", ".join(parts)


def _model_groups(rows: list[dict[str, Any]]) -> tuple[dict[tuple, list[dict[str, Any]]], bool]:
    several_nproc = len({r["nproc"] for r in rows}) > 1
    return _by(rows, "model", "nproc"), several_nproc


# ------------------------------------------------------------------------------------------------ recommendations

def fastest_that_fits(rows: list[dict[str, Any]]) -> list[str]:
    """Per model (and GPU count): the fastest configuration that ran, with the near-ties and what did not fit."""
    lines = []
    groups, several_nproc = _model_groups(rows)
    for (model, nproc), group in groups.items():
        name = f"**{_group_label(model, nproc, several_nproc)}**"
        ok = sorted(_ok(group), key=lambda r: r["tokens_per_s"], reverse=True)
        failed = [r for r in group if r["status"] != "ok"]
        failed_text = ""
        if failed:
            by_status = _by(failed, "status")
            failed_text = " Did not finish: " + "; ".join(
                f"{status} at " + ", ".join(sorted({stage_label(r['zero'], r['offload']) + f" mb={r['micro_batch']}"
                                                    for r in items}))
                for (status,), items in sorted(by_status.items())) + "."
        if not ok:
            lines.append(f"- {name}: no configuration finished, so the data can't tell which is fastest; "
                         f"try smaller micro batches, offload, activation checkpointing or more GPUs.{failed_text}")
            continue
        best = ok[0]
        mfu = "" if best.get("mfu") is None else f"MFU {best['mfu']:.1%}, "
        text = (f"- {name}: fastest that fits is {_describe(best)}: {format_rate(best['tokens_per_s'])}"
                f" ({mfu}step {_fmt(best.get('step_time_s'), '.3g', 1, ' s')}"
                f"; peak memory {_fmt(best.get('peak_mem_gib'), '.3g', 1, ' GiB')} measured, estimate "
                f"{_fmt(best.get('est_gpu_gib'), '.3g', 1, ' GiB')} per device).")
        stage_best: dict[tuple, dict[str, Any]] = {}
        for r in ok:  # sorted fastest first: the first row of each stage is its best
            stage_best.setdefault((r["zero"], r["offload"]), r)
        def margin(r: dict[str, Any]) -> float:
            return max(TIE_MARGIN, best.get("tokens_per_s_spread") or 0.0, r.get("tokens_per_s_spread") or 0.0)

        ties = [r for stage, r in stage_best.items() if stage != (best["zero"], best["offload"])
                and r["tokens_per_s"] >= best["tokens_per_s"] * (1 - margin(r))]
        if ties:
            text += (" Within the measurement spread of it: " + "; ".join(
                f"{_describe(r)} ({format_rate(r['tokens_per_s'])}, {1 - r['tokens_per_s'] / best['tokens_per_s']:.1%} "
                f"slower, spread {margin(r):.1%})" for r in ties[:3])
                + ": on this data they tie, more steps would separate them.")
        lines.append(text + failed_text)
    return lines


def fewest_workers(rows: list[dict[str, Any]], target: float = DATA_WAIT_TARGET) -> list[str]:
    """Per model and stage/offload: the fewest loader workers whose worst data-wait share is under `target`."""
    lines = []
    several_nproc = len({r["nproc"] for r in rows}) > 1
    groups = _by(_ok(rows), "model", "nproc", "zero", "offload")
    stage_rank = {stage: i for i, stage in enumerate(_stage_order(rows))}
    for (model, nproc, zero, offload), group in sorted(groups.items(),
                                                       key=lambda g: (g[0][0], g[0][1], stage_rank[g[0][2:]])):
        shares: dict[int, float] = {}
        for (workers,), items in _by(group, "loader_workers").items():
            measured = [r["data_wait_share"] for r in items if r.get("data_wait_share") is not None]
            if measured:
                shares[workers] = max(measured)  # the worst over micro batch etc.: a setting that always holds
        name = f"{_group_label(model, nproc, several_nproc)}, {stage_label(zero, offload)}"
        if not shares:
            lines.append(f"- {name}: no data-wait measurements; the data can't tell.")
            continue
        unfinished = sorted({(r["loader_workers"], r["status"]) for r in rows if r["status"] != "ok"
                             and (r["model"], r["nproc"], r["zero"], r["offload"]) == (model, nproc, zero, offload)})
        unfinished_text = "".join(f" {w} worker{'s' if w != 1 else ''}: {status}." for w, status in unfinished)
        tried = sorted(shares)
        listing = ", ".join(f"{w} worker{'s' if w != 1 else ''}: {shares[w]:.2%}" for w in tried)
        under = [w for w in tried if shares[w] < target]
        if not under:
            best = min(tried, key=lambda w: shares[w])
            lines.append(f"- {name}: none of the tried worker counts keeps data wait under {target:.0%} "
                         f"({listing}); the data can't tell how many would: try more than {max(tried)} workers "
                         f"or a faster disk (best here: {best}).{unfinished_text}")
            continue
        fewest = under[0]
        text = f"- {name}: {fewest} loader worker{'s' if fewest != 1 else ''} keep{'s' if fewest == 1 else ''} data wait under {target:.0%} ({listing})."
        if fewest == tried[0] and fewest > 0:
            text += f" It is the fewest that finished, so the data can't tell whether fewer than {fewest} would do."
        above = [w for w in tried if w > fewest and shares[w] >= target]
        if above:
            text += (f" But {', '.join(map(str, above))} workers measured {target:.0%} or more: noise or workers "
                     f"competing for host CPU (offload uses it too); more steps would tell.")
        lines.append(text + unfinished_text)
    return lines


def estimate_accuracy(rows: list[dict[str, Any]]) -> list[str]:
    """Per model: measured peak memory over the recorded estimate, per stage (how far to trust the estimate)."""
    lines = []
    groups, several_nproc = _model_groups(rows)
    for (model, nproc), group in groups.items():
        ratios = []
        for zero, offload in _stage_order(group):
            pairs = [(r["peak_mem_gib"], r["est_gpu_gib"]) for r in _ok(group)
                     if (r["zero"], r["offload"]) == (zero, offload) and r.get("peak_mem_gib") is not None
                     and r.get("est_gpu_gib")]
            if pairs:
                peak, estimate = max(pairs)
                ratios.append(f"{stage_label(zero, offload)} {peak / estimate:.2g}x ({peak:.3g} vs {estimate:.3g} GiB)")
        if ratios:
            lines.append(f"- {_group_label(model, nproc, several_nproc)}: measured peak / estimate per device: "
                         + "; ".join(ratios) + ".")
        else:
            lines.append(f"- {_group_label(model, nproc, several_nproc)}: no finished point with both numbers; "
                         f"the data can't tell.")
    return lines


# ------------------------------------------------------------------------------------------------ markdown

def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def results_table(rows: list[dict[str, Any]]) -> str:
    header = ["model", "stage", "mb", "workers", "GPUs", "ckpt", "status", "tok/s", "samples/s", "TFLOP/s/GPU",
              "MFU", "step s", "data wait s", "compute s", "data wait", "peak GiB", "est GPU GiB", "est CPU GiB",
              "reason"]
    body = [[r["model"], stage_label(r["zero"], r["offload"]), str(r["micro_batch"]), str(r["loader_workers"]),
             str(r["nproc"]), "on" if r.get("activation_checkpointing") else "off", r["status"],
             _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("samples_per_s"), ",.1f"),
             _fmt(r.get("tflops_per_gpu"), ".3g"), _fmt(r.get("mfu"), ".1f", 100, "%"),
             _fmt(r.get("step_time_s"), ".3g"), _fmt(r.get("data_wait_s"), ".3g"), _fmt(r.get("compute_s"), ".3g"),
             _fmt(r.get("data_wait_share"), ".2f", 100, "%"), _fmt(r.get("peak_mem_gib"), ".3g"),
             _fmt(r.get("est_gpu_gib"), ".3g"), _fmt(r.get("est_cpu_gib"), ".3g"), r.get("reason") or ""]
            for r in rows]
    return _table(header, body)


def stage_comparison(rows: list[dict[str, Any]]) -> str:
    """Per model: the best point of each stage/offload, its throughput relative to the model's fastest stage."""
    sections = []
    groups, several_nproc = _model_groups(rows)
    for (model, nproc), group in groups.items():
        ok = _ok(group)
        fastest = _largest(ok, "tokens_per_s")
        body = []
        for zero, offload in _stage_order(group):
            stage_rows = [r for r in group if (r["zero"], r["offload"]) == (zero, offload)]
            stage_ok = _ok(stage_rows)
            count = f"{len(stage_ok)}/{len(stage_rows)}"
            if not stage_ok:
                statuses = ", ".join(sorted({r["status"] for r in stage_rows}))
                body.append([stage_label(zero, offload), "–", "–", "–", "–", "–",
                             _fmt(_largest(stage_rows, "est_gpu_gib"), ".3g"),
                             _fmt(_largest(stage_rows, "est_cpu_gib"), ".3g"), f"{count} ({statuses})"])
                continue
            best = max(stage_ok, key=lambda r: r["tokens_per_s"])
            body.append([stage_label(zero, offload), format_rate(best["tokens_per_s"]),
                         _fmt(best["tokens_per_s"] / fastest, ".2f", 1, "x"), _fmt(best.get("step_time_s"), ".3g"),
                         _fmt(best.get("data_wait_share"), ".2f", 100, "%"),
                         _fmt(_largest(stage_ok, "peak_mem_gib"), ".3g"),
                         _fmt(best.get("est_gpu_gib"), ".3g"), _fmt(best.get("est_cpu_gib"), ".3g"), count])
        header = ["stage", "best throughput", "vs fastest", "step s", "data wait", "max peak GiB", "est GPU GiB",
                  "est CPU GiB", "points ok"]
        sections.append(f"### {_group_label(model, nproc, several_nproc)}\n\n" + _table(header, body))
    return "\n\n".join(sections)


def _setup_section(rows: list[dict[str, Any]], setup: dict[str, Any]) -> str:
    lines = []
    machine = setup.get("machine") or {}
    if machine:
        gpus = ", ".join(machine.get("gpus") or []) or "none"
        lines.append(f"- Machine: {machine.get('platform')}, {machine.get('cpus')} CPUs, {machine.get('ram_gib')} GiB "
                     f"RAM, GPUs: {gpus}; torch {machine.get('torch')}, deepspeed {machine.get('deepspeed')}.")
    else:
        lines.append("- Machine: not recorded (this report was rebuilt from results.csv alone).")
    shard_set = setup.get("shard_set") or {}
    if shard_set:
        lines.append(f"- Shard set: `{shard_set.get('path')}`, fingerprint `{shard_set.get('fingerprint')}`, "
                     f"{shard_set.get('examples')} examples in {shard_set.get('shards')} shards, input/target length "
                     f"{shard_set.get('input_length')}/{shard_set.get('target_length')}, vocabulary "
                     f"{shard_set.get('vocab_size')}.")
    elif setup.get("fingerprint"):
        lines.append(f"- Shard set fingerprint: `{setup['fingerprint']}`.")
    base = setup.get("base") or {}
    if base:
        lines.append(f"- Every point: {base.get('steps')} steps, the first {base.get('skip_steps')} excluded from the "
                     f"medians; global batch {base.get('global_batch')}; precision {base.get('precision') or 'default'}; "
                     f"seed {base.get('seed')}; timeout {base.get('timeout_s')} s per point.")
        if base.get("overlap_startup"):
            lines.append("- overlap_startup: each point's host-side start-up (imports, preflight, model build) ran "
                         "while the point before it trained (not beside offload points); training steps never "
                         "overlapped.")
    else:
        steps = sorted({r["steps"] for r in rows if r.get("steps")})
        batches = sorted({r["global_batch"] for r in rows if r.get("global_batch")})
        lines.append(f"- Every point: steps {steps}, global batch {batches}.")
    if setup.get("earlier_machines"):
        lines.append(f"- Note: some points ran earlier on other machines ({len(setup['earlier_machines'])} recorded "
                     f"in study.json); compare rows with care.")
    commands = setup.get("commands") or []
    text = "\n".join(lines)
    if commands:
        runs = {command: commands.count(command) for command in commands}   # in first-run order
        text += "\n- Commands:\n\n```\n" + "\n".join(
            command + (f"   # run {count} times; each rerun skipped the finished points" if count > 1 else "")
            for command, count in runs.items()) + "\n```"
    if setup.get("point_command"):
        text += "\n- One point's own launch (each point is one such `pretrain` command):\n\n```\n" \
                + setup["point_command"] + "\n```"
    methods = sorted({r["est_method"] for r in rows if r.get("est_method")})
    text += ("\n- Numbers are medians over the steady-state steps of each point; `data wait` is the share of step "
             "time spent blocked on the next batch (total wait / total step time over those steps); `peak` is the "
             "largest peak memory pretrain measured in any step (GPU memory on GPUs, host memory on CPU); `est` is "
             "the memory estimate pretrain records for the stage and offload before training (config.json "
             "`memory_estimate`; method: " + ("; ".join(methods) or "not recorded") + ").")
    return text


def render_markdown(rows: list[dict[str, Any]], setup: dict[str, Any], plots: dict[str, Path]) -> str:
    name = setup.get("study") or "study"
    counts = _by(rows, "status")
    status_text = ", ".join(f"{len(items)} {status}" for (status,), items in sorted(counts.items()))
    plot_lines = "\n\n".join(f"![{key}]({Path(path).name})" for key, path in plots.items())
    parts = [
        f"# Study `{name}`: ZeRO stage x data loading",
        f"{len(rows)} points: {status_text}.",
        "## Setup\n\n" + _setup_section(rows, setup),
        "## Results\n\n" + results_table(rows),
        "## Per-stage comparison\n\nThe best point of each stage (over micro batch, loader workers, checkpointing), "
        "its throughput relative to the model's fastest stage, and memory.\n\n" + stage_comparison(rows),
        "## Plots\n\n" + plot_lines,
        "## Recommendations\n\nDerived from the table above.\n\n### Fastest configuration that fits\n\n"
        + "\n".join(fastest_that_fits(rows))
        + f"\n\n### Fewest loader workers that keep data wait under {DATA_WAIT_TARGET:.0%}\n\n"
        + "\n".join(fewest_workers(rows) or ["- No point finished; the data can't tell."])
        + "\n\n### How far the memory estimate can be trusted\n\nThe estimate counts what pretrain's method "
        "names (see Setup); a measured peak above it is what that method leaves out (allocator cache, "
        "workspaces, communication buffers, fragmentation); plan with the measured peak.\n\n" + "\n".join(estimate_accuracy(rows)),
    ]
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------ plots

def _figure(n_panels: int, width: float = 5.0, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(n_panels, 3) or 1
    nrows = max(1, math.ceil(n_panels / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols, height * nrows), squeeze=False)
    flat = list(axes.ravel())
    for unused in flat[n_panels:]:
        unused.set_visible(False)
    return plt, fig, flat


def _save(plt, fig, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _no_data(ax, text: str = "no finished points") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _per_model_figure(rows: list[dict[str, Any]], path: Path, title: str, draw) -> Path:
    """One panel per model (and GPU count); `draw(ax, group_rows)` fills a panel."""
    groups, several_nproc = _model_groups(rows)
    plt, fig, axes = _figure(max(1, len(groups)))
    for ax, ((model, nproc), group) in zip(axes, groups.items()):
        draw(ax, group)
        ax.set_title(_group_label(model, nproc, several_nproc))
    if not groups:
        _no_data(axes[0])
    fig.suptitle(title)
    return _save(plt, fig, path)


def _stage_ticks(ax, stages: list[tuple[int, str]]) -> None:
    ax.set_xticks(range(len(stages)), [stage_label(z, o).replace(" + ", "\n+") for z, o in stages], fontsize=8)


def plot_throughput(rows: list[dict[str, Any]], path: Path) -> Path:
    """Best tokens/s of each stage/offload, one panel per model; stages that never finished are marked."""
    def draw(ax, group):
        stages = _stage_order(group)
        values = [_largest(_ok(r for r in group if (r["zero"], r["offload"]) == stage), "tokens_per_s", 0.0)
                  for stage in stages]
        bars = ax.bar(range(len(stages)), values, color="tab:blue")
        for bar, value, stage in zip(bars, values, stages):
            if value == 0.0:
                statuses = {r["status"] for r in group if (r["zero"], r["offload"]) == stage}
                ax.text(bar.get_x() + bar.get_width() / 2, 0, "/".join(sorted(statuses)), ha="center",
                        va="bottom", color="tab:red", fontsize=8)
        _stage_ticks(ax, stages)
        ax.set_ylabel("tokens/s (best point)")

    return _per_model_figure(rows, path, "Throughput per ZeRO stage", draw)


def plot_memory(rows: list[dict[str, Any]], path: Path) -> Path:
    """Measured peak memory vs the per-device and host estimates pretrain records, per stage, panel per model."""
    width = 0.27

    def draw(ax, group):
        stages = _stage_order(group)
        by_stage = [[r for r in group if (r["zero"], r["offload"]) == stage] for stage in stages]
        positions = range(len(stages))
        ax.bar([p - width for p in positions], [_largest(_ok(g), "peak_mem_gib", 0.0) for g in by_stage], width,
               label="measured peak", color="tab:blue")
        ax.bar(list(positions), [_largest(g, "est_gpu_gib", 0.0) for g in by_stage], width,
               label="estimate per device", color="tab:orange")
        ax.bar([p + width for p in positions], [_largest(g, "est_cpu_gib", 0.0) for g in by_stage], width,
               label="estimate, host (CPU)", color="tab:gray")
        _stage_ticks(ax, stages)
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)

    return _per_model_figure(rows, path, "Memory: measured peak vs pre-training estimate", draw)


def plot_data_wait(rows: list[dict[str, Any]], path: Path) -> Path:
    """Data-wait share (worst over other axes) vs loader workers, one line per stage/offload, panel per model."""
    colors = {stage: f"C{i % 10}" for i, stage in enumerate(_stage_order(rows))}  # same stage, same colour

    def draw(ax, group):
        for zero, offload in _stage_order(group):
            by_workers = _by([r for r in group if (r["zero"], r["offload"]) == (zero, offload)], "loader_workers")
            workers = sorted(w for (w,), items in by_workers.items() if _largest(items, "data_wait_share") is not None)
            shares = [100 * _largest(by_workers[(w,)], "data_wait_share") for w in workers]
            ax.plot(workers, shares, marker="o", label=stage_label(zero, offload), color=colors[(zero, offload)])
        ax.set_xticks(sorted({r["loader_workers"] for r in group}))
        ax.axhline(100 * DATA_WAIT_TARGET, color="black", linestyle="--", linewidth=0.8,
                   label=f"{DATA_WAIT_TARGET:.0%} target")
        ax.set_xlabel("loader workers")
        ax.set_ylabel("data wait, % of step time")
        ax.legend(fontsize=7)

    return _per_model_figure(_ok(rows), path, "Data-wait share vs loader workers", draw)


def plot_step_time(rows: list[dict[str, Any]], path: Path) -> Path:
    """Median step time of every finished point, stacked: data wait, compute, the rest (optimizer, comms...)."""
    ok = [r for r in _ok(rows) if r.get("step_time_s") is not None]
    plt, fig, axes = _figure(1, width=9.0, height=max(3.0, 0.28 * len(ok) + 1.2))
    ax = axes[0]
    if ok:
        wait = [r.get("data_wait_s") or 0.0 for r in ok]
        compute = [r.get("compute_s") or 0.0 for r in ok]
        rest = [max(0.0, r["step_time_s"] - w - c) for r, w, c in zip(ok, wait, compute)]
        positions = range(len(ok))
        ax.barh(positions, wait, label="data wait", color="tab:red")
        ax.barh(positions, compute, left=wait, label="compute", color="tab:blue")
        ax.barh(positions, rest, left=[w + c for w, c in zip(wait, compute)], label="other", color="tab:gray")
        ax.set_yticks(list(positions), [f"{r['model']} z{r['zero']}{'' if r['offload'] == 'none' else '+' + r['offload']}"
                                        f" mb{r['micro_batch']} w{r['loader_workers']} n{r['nproc']}" for r in ok],
                      fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("seconds per step (median)")
        ax.legend(fontsize=8)
    else:
        _no_data(ax)
    ax.set_title("Step time breakdown")
    return _save(plt, fig, path)


def write_plots(rows: list[dict[str, Any]], out_dir: str | os.PathLike) -> dict[str, Path]:
    out_dir = Path(out_dir)
    return {"throughput": plot_throughput(rows, out_dir / PLOTS["throughput"]),
            "memory": plot_memory(rows, out_dir / PLOTS["memory"]),
            "data_wait": plot_data_wait(rows, out_dir / PLOTS["data_wait"]),
            "step_time": plot_step_time(rows, out_dir / PLOTS["step_time"])}


def write_report(rows: list[dict[str, Any]], out_dir: str | os.PathLike, setup: dict[str, Any]) -> dict[str, Any]:
    """results.csv, report.md and the four PNGs in `out_dir`, all from `rows`."""
    out_dir = Path(out_dir)
    csv_path = out_dir / RESULTS_CSV
    write_results_csv(rows, csv_path)
    plots = write_plots(rows, out_dir)
    md_path = out_dir / REPORT_MD
    atomic_write_bytes(md_path, render_markdown(rows, setup, plots).encode())
    return {"csv": csv_path, "md": md_path, "plots": list(plots.values())}
