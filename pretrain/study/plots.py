"""A study's five PNG plots (matplotlib, Agg): throughput and memory per ZeRO stage, data wait and step time vs
loader workers per loader mode, the step-time breakdown of every finished point and its host CPU by role.

    write_plots(read_results_csv("studies/x/results.csv"), "studies/x")   # throughput.png, memory.png, ...
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

from pipeline.common import atomic_write_bytes
from pretrain.study.report import (DATA_WAIT_TARGET, group_by, group_label, largest, largest_needed, model_groups,
                                   ok_rows, stage_label, stage_order)

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


def save_figure(plt, fig, path: Path) -> Path:
    """Write `fig` as a PNG atomically (tight layout, 110 dpi) and close it."""
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
    return save_figure(plt, fig, path)


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
        ax.bar([p - width for p in positions], [largest_needed(ok_rows(g), 0.0) for g in by_stage], width,
               label="measured peak", color="tab:blue")
        ax.bar(list(positions), [largest(g, "est_gpu_gib", 0.0) for g in by_stage], width,
               label="estimate per device", color="tab:orange")
        ax.bar([p + width for p in positions], [largest(g, "est_cpu_gib", 0.0) for g in by_stage], width,
               label="estimate, host (CPU)", color="tab:gray")
        _stage_ticks(ax, stages)
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)

    return _per_model_figure(rows, path, "Memory: measured peak vs pre-training estimate", draw)


def plot_loading(rows: list[dict[str, Any]], path: Path) -> Path:
    """Per model, two panels: data-wait share and step time against loader workers, one line per stage/offload
    and loader mode (colour: stage, line style: mode); the bars span a repeated point's min-max over its runs.
    Other axes (micro batch, ...) are reduced to the fastest point at each worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = ok_rows({"loader": "shards", **r} for r in rows)          # rows of older studies have no loader column
    groups, several_nproc = model_groups(ok)
    colors = {stage: f"C{i % 10}" for i, stage in enumerate(stage_order(ok))}   # same stage, same colour
    styles = {"shards": "-", "online": "--", "remote": ":"}
    fig, axes = plt.subplots(max(1, len(groups)), 2, figsize=(10.0, 3.6 * max(1, len(groups))), squeeze=False)
    for (wait_ax, step_ax), ((model, nproc), group) in zip(axes, groups.items()):
        for zero, offload in stage_order(group):
            stage = [r for r in group if (r["zero"], r["offload"]) == (zero, offload)]
            for (mode,), items in sorted(group_by(stage, "loader").items(), key=lambda kv: str(kv[0])):
                best = {w: max(points, key=lambda r: r.get("tokens_per_s") or 0.0)
                        for (w,), points in group_by(items, "loader_workers").items()}
                workers = sorted(best)
                label = f"{stage_label(zero, offload)}, {mode}"
                for ax, key, scale in ((wait_ax, "data_wait_share", 100.0), (step_ax, "step_time_s", 1.0)):
                    values = [scale * (best[w].get(key) or 0.0) for w in workers]
                    low = [v - scale * best[w].get(f"{key}_min", best[w].get(key) or 0.0) for v, w in zip(values, workers)]
                    high = [scale * best[w].get(f"{key}_max", best[w].get(key) or 0.0) - v for v, w in zip(values, workers)]
                    ax.errorbar(workers, values, yerr=[low, high], marker="o", capsize=3, label=label,
                                color=colors[(zero, offload)], linestyle=styles.get(mode, "-."))
        title = group_label(model, nproc, several_nproc)
        wait_ax.axhline(100 * DATA_WAIT_TARGET, color="black", linestyle="--", linewidth=0.8,
                        label=f"{DATA_WAIT_TARGET:.0%} target")
        wait_ax.set(title=f"{title}: data wait", xlabel="loader workers", ylabel="data wait, % of step time")
        step_ax.set(title=f"{title}: step time", xlabel="loader workers", ylabel="seconds per step (median)")
        for ax in (wait_ax, step_ax):
            ax.set_xticks(sorted({r["loader_workers"] for r in group}))
        wait_ax.legend(fontsize=6)
    if not groups:
        _no_data(axes[0][0])
        axes[0][1].set_visible(False)
    fig.suptitle("Data loading: data wait and step time vs loader workers, per loader mode and stage")
    return save_figure(plt, fig, path)


STEP_PARTS = (("data_wait_s", "data wait", "tab:red"), ("forward_s", "forward", "tab:blue"),
              ("backward_s", "backward", "tab:cyan"), ("optimizer_s", "optimizer step", "tab:green"))


def plot_step_time(rows: list[dict[str, Any]], path: Path, extra_axes: tuple[str, ...] = ()) -> Path:
    """Median step time of every finished point, stacked: data wait, forward, backward, optimizer step, and the
    rest (communication outside those calls, host gaps); rows without the phase split show compute as one part."""
    ok = [r for r in ok_rows(rows) if r.get("step_time_s") is not None]
    plt, fig, axes = _figure(1, width=9.0, height=max(3.0, 0.28 * len(ok) + 1.2))
    ax = axes[0]
    if ok:
        left = [0.0] * len(ok)
        split = [r.get("forward_s") is not None for r in ok]
        parts = [*STEP_PARTS, ("compute_s", "compute (not split)", "tab:purple")]
        for key, label, color in parts:
            if key == "compute_s":
                widths = [0.0 if has else (r.get(key) or 0.0) for r, has in zip(ok, split)]
            else:
                widths = [r.get(key) or 0.0 for r in ok]
            if any(widths):
                ax.barh(range(len(ok)), widths, left=left, label=label, color=color)
                left = [a + b for a, b in zip(left, widths)]
        rest = [max(0.0, r["step_time_s"] - done) for r, done in zip(ok, left)]
        ax.barh(range(len(ok)), rest, left=left, label="communication, host gaps", color="tab:gray")
        ax.set_yticks(list(range(len(ok))), [_point_label(r, extra_axes) for r in ok], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("seconds per step (median)")
        ax.legend(fontsize=8)
    else:
        _no_data(ax)
    ax.set_title("Step time breakdown")
    return save_figure(plt, fig, path)


def _point_label(r: dict[str, Any], extra_axes: tuple[str, ...]) -> str:
    return (f"{r['model']} z{r['zero']}{'' if r['offload'] == 'none' else '+' + r['offload']} mb{r['micro_batch']} "
            f"w{r['loader_workers']} n{r['nproc']}"
            + "".join(f" {axis}={r[axis]}" for axis in extra_axes if r.get(axis) is not None))


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
    return save_figure(plt, fig, path)


def write_plots(rows: list[dict[str, Any]], out_dir: str | os.PathLike,
                extra_axes: tuple[str, ...] = ()) -> dict[str, Path]:
    """The PNGs of PLOTS in `out_dir`."""
    out_dir = Path(out_dir)
    return {"throughput": plot_throughput(rows, out_dir / PLOTS["throughput"]),
            "memory": plot_memory(rows, out_dir / PLOTS["memory"]),
            "data_wait": plot_loading(rows, out_dir / PLOTS["data_wait"]),
            "step_time": plot_step_time(rows, out_dir / PLOTS["step_time"], extra_axes),
            "host_cpu": plot_host_cpu(rows, out_dir / PLOTS["host_cpu"], extra_axes)}
