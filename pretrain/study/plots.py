"""A study's five PNG plots (matplotlib, Agg): throughput and memory per ZeRO stage, data wait vs loader workers,
the step-time breakdown of every finished point and its host CPU by role.

    write_plots(read_results_csv("studies/x/results.csv"), "studies/x")   # throughput.png, memory.png, ...
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

from pipeline.common import atomic_write_bytes
from pretrain.study.report import (DATA_WAIT_TARGET, group_by, group_label, largest, model_groups, ok_rows,
                                   stage_label, stage_order)

PLOTS = {"throughput": "throughput.png", "memory": "memory.png", "data_wait": "data_wait.png",
         "step_time": "step_time.png", "host_cpu": "host_cpu.png"}
HOST_ROLES = (("cpu_loader_workers_s", "loader workers", "tab:red"), ("cpu_loader_inline_s", "loading in the rank",
              "tab:orange"), ("cpu_train_s", "forward/backward/comm", "tab:blue"),
              ("cpu_optimizer_s", "optimizer (CPU-Adam)", "tab:green"))


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
    groups, several_nproc = model_groups(rows)
    plt, fig, axes = _figure(max(1, len(groups)))
    for ax, ((model, nproc), group) in zip(axes, groups.items()):
        draw(ax, group)
        ax.set_title(group_label(model, nproc, several_nproc))
    if not groups:
        _no_data(axes[0])
    fig.suptitle(title)
    return _save(plt, fig, path)


def _stage_ticks(ax, stages: list[tuple[int, str]]) -> None:
    ax.set_xticks(range(len(stages)), [stage_label(z, o).replace(" + ", "\n+") for z, o in stages], fontsize=8)


def plot_throughput(rows: list[dict[str, Any]], path: Path) -> Path:
    """Best tokens/s of each stage/offload, one panel per model; stages that never finished are marked."""
    def draw(ax, group):
        stages = stage_order(group)
        values = [largest(ok_rows(r for r in group if (r["zero"], r["offload"]) == stage), "tokens_per_s", 0.0)
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
        stages = stage_order(group)
        by_stage = [[r for r in group if (r["zero"], r["offload"]) == stage] for stage in stages]
        positions = range(len(stages))
        ax.bar([p - width for p in positions], [largest(ok_rows(g), "peak_mem_gib", 0.0) for g in by_stage], width,
               label="measured peak", color="tab:blue")
        ax.bar(list(positions), [largest(g, "est_gpu_gib", 0.0) for g in by_stage], width,
               label="estimate per device", color="tab:orange")
        ax.bar([p + width for p in positions], [largest(g, "est_cpu_gib", 0.0) for g in by_stage], width,
               label="estimate, host (CPU)", color="tab:gray")
        _stage_ticks(ax, stages)
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)

    return _per_model_figure(rows, path, "Memory: measured peak vs pre-training estimate", draw)


def plot_data_wait(rows: list[dict[str, Any]], path: Path) -> Path:
    """Data-wait share (worst over other axes) vs loader workers, one line per stage/offload, panel per model."""
    colors = {stage: f"C{i % 10}" for i, stage in enumerate(stage_order(rows))}  # same stage, same colour

    def draw(ax, group):
        for zero, offload in stage_order(group):
            by_workers = group_by([r for r in group if (r["zero"], r["offload"]) == (zero, offload)], "loader_workers")
            workers = sorted(w for (w,), items in by_workers.items() if largest(items, "data_wait_share") is not None)
            shares = [100 * largest(by_workers[(w,)], "data_wait_share") for w in workers]
            ax.plot(workers, shares, marker="o", label=stage_label(zero, offload), color=colors[(zero, offload)])
        ax.set_xticks(sorted({r["loader_workers"] for r in group}))
        ax.axhline(100 * DATA_WAIT_TARGET, color="black", linestyle="--", linewidth=0.8,
                   label=f"{DATA_WAIT_TARGET:.0%} target")
        ax.set_xlabel("loader workers")
        ax.set_ylabel("data wait, % of step time")
        ax.legend(fontsize=7)

    return _per_model_figure(ok_rows(rows), path, "Data-wait share vs loader workers", draw)


def plot_step_time(rows: list[dict[str, Any]], path: Path, extra_axes: tuple[str, ...] = ()) -> Path:
    """Median step time of every finished point, stacked: data wait, compute, the rest (optimizer, comms...);
    a point's label names the classic axes, then the grid's other axes (`extra_axes`)."""
    ok = [r for r in ok_rows(rows) if r.get("step_time_s") is not None]
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
                                        f" mb{r['micro_batch']} w{r['loader_workers']} n{r['nproc']}"
                                        + "".join(f" {axis}={r.get(axis)}" for axis in extra_axes) for r in ok],
                      fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("seconds per step (median)")
        ax.legend(fontsize=8)
    else:
        _no_data(ax)
    ax.set_title("Step time breakdown")
    return _save(plt, fig, path)


def _point_label(r: dict[str, Any], extra_axes: tuple[str, ...]) -> str:
    return (f"{r['model']} z{r['zero']}{'' if r['offload'] == 'none' else '+' + r['offload']} mb{r['micro_batch']} "
            f"w{r['loader_workers']} n{r['nproc']}" + "".join(f" {axis}={r.get(axis)}" for axis in extra_axes))


def plot_host_cpu(rows: list[dict[str, Any]], path: Path, extra_axes: tuple[str, ...] = ()) -> Path:
    """Host CPU use by role per finished point (rank 0, median CPU seconds per step over the step time: cores)."""
    ok = [r for r in ok_rows(rows) if r.get("cpu_rank_s") is not None and r.get("step_time_s")]
    plt, fig, axes = _figure(1, width=9.0, height=max(3.0, 0.28 * len(ok) + 1.2))
    ax = axes[0]
    if ok:
        left = [0.0] * len(ok)
        for key, label, color in HOST_ROLES:
            cores = [(r.get(key) or 0.0) / r["step_time_s"] for r in ok]
            ax.barh(range(len(ok)), cores, left=left, label=label, color=color)
            left = [a + b for a, b in zip(left, cores)]
        ax.set_yticks(list(range(len(ok))), [_point_label(r, extra_axes) for r in ok], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("host cores busy (rank 0: CPU seconds per step / step time)")
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "no host accounting recorded")
    ax.set_title("Host CPU by role")
    return _save(plt, fig, path)


def write_plots(rows: list[dict[str, Any]], out_dir: str | os.PathLike,
                extra_axes: tuple[str, ...] = ()) -> dict[str, Path]:
    """The four PNGs of PLOTS in `out_dir`."""
    out_dir = Path(out_dir)
    return {"throughput": plot_throughput(rows, out_dir / PLOTS["throughput"]),
            "memory": plot_memory(rows, out_dir / PLOTS["memory"]),
            "data_wait": plot_data_wait(rows, out_dir / PLOTS["data_wait"]),
            "step_time": plot_step_time(rows, out_dir / PLOTS["step_time"], extra_axes),
            "host_cpu": plot_host_cpu(rows, out_dir / PLOTS["host_cpu"], extra_axes)}
