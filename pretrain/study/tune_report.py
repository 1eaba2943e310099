"""What `study tune` writes: best.yaml (a `pretrain --config` file), tune.md (every candidate: measured, predicted
or pruned, and why), the two plots, and the progress/summary lines.

    paths = write_outputs(tune)      # {"best": DIR/best.yaml, "md": DIR/tune.md, "plots": [...]}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.common import atomic_write_bytes
from pipeline.settings import to_yaml_values
from pretrain.config import TrainConfig
from pretrain.study import tune_compare
from pretrain.study.plots import save_figure
from pretrain.study.report import format_rate

BEST_FILE = "best.yaml"
TUNE_MD = "tune.md"
PLOTS = {"predicted": "tune_predicted.png", "candidates": "tune_candidates.png"}


def candidate_summary(candidate) -> dict[str, Any]:
    """A candidate as tune.json keeps it: id, memory verdict, prediction, each rung's measurement."""
    keys = ("status", "reason", "steps", "tokens_per_s", "tokens_per_s_spread", "step_time_s", "data_wait_s",
            "peak_mem_gib", "wall_s")
    return {"point_id": candidate.point_id, "default": candidate.default, "memory": candidate.memory,
            "why": candidate.why, "estimate_gib": round(candidate.estimate_gib, 3),
            "calibrated_gib": round(candidate.calibrated_gib, 3),
            "predicted_tokens_per_s": round(candidate.predicted.get("tokens_per_s", 0.0), 1),
            "predicted_from_siblings": candidate.predicted.get("siblings", 0),
            "predicted_graph_ratio": candidate.predicted.get("graph_ratio"),
            "results": {str(rung): {k: row.get(k) for k in keys} for rung, row in candidate.results.items()}}


def speedup(tune) -> tuple[float | None, str]:
    """The best's tokens/s over the default's, at the highest rung both were measured at ok (and what was used)."""
    best = tune.best()
    default = next((c for c in tune.candidates if c.default), None)
    if best is None or default is None or not default.best_result():
        return None, "the default was not measured ok"
    common = [r for r in best.results if r in default.results and default.results[r]["status"] == "ok"
              and best.results[r]["status"] == "ok"]
    if not common:
        rung_b, row_b = best.best_result()
        rung_d, row_d = default.best_result()
        return row_b["tokens_per_s"] / row_d["tokens_per_s"], f"best at rung {rung_b}, default at rung {rung_d}"
    rung = max(common)
    return (best.results[rung]["tokens_per_s"] / default.results[rung]["tokens_per_s"],
            f"both at rung {rung} ({tune.options.rung_steps[rung]} steps)")


def _ordered(tune) -> list:
    """Measured (fastest first), then predicted only (by prediction), then pruned."""
    def key(c):
        result = c.best_result()
        if result:
            return (0, -result[0], -result[1]["tokens_per_s"])
        return (1 if c.memory != "pruned" else 2, 0, -c.predicted.get("tokens_per_s", 0.0))
    return sorted(tune.candidates, key=key)


def _state(candidate) -> str:
    if candidate.results:
        return ", ".join(f"rung {r}: {row['status']}" + (f" ({row['reason']})" if row["status"] != "ok" else "")
                         for r, row in sorted(candidate.results.items()))
    return "pruned" if candidate.memory == "pruned" else "predicted"


def print_ranking(tune) -> None:
    """--dry-run: every candidate in rank order with its prediction and memory verdict."""
    for n, c in enumerate(_ordered(tune), 1):
        mark = " (the default)" if c.default else ""
        memory = f"est {c.estimate_gib:.2f} GiB, calibrated {c.calibrated_gib:.2f} of {tune.calibration.capacity_gib:.1f}"
        print(f"[{n}/{len(tune.candidates)}] {c.point_id}{mark}: {_state(c)}; predicted "
              f"{format_rate(c.predicted['tokens_per_s'])}; {memory}" + (f"; {c.why}" if c.why else ""))
    pruned = sum(c.memory == "pruned" for c in tune.candidates)
    print(f"dry run: {len(tune.candidates)} candidates, {pruned} pruned, nothing launched")


def _cell(value: Any, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def render_markdown(tune) -> str:
    best = tune.best()
    ratio, basis = speedup(tune)
    device = tune.device
    lines = ["# study tune", "", "```", *tune.state.get("commands", []), "```", "",
             f"- machine: {device['kind']} {device['name']}, capacity {device['capacity_gib']:.1f} GiB per "
             f"device, host {device['host_ram_gib']} GiB, {device['cpus']} CPUs; precision {device['precision']}",
             f"- run: {tune.grid.base['model']} ({tune.shape.parameters / 1e6:.1f}M parameters), "
             f"{tune.grid.base['nproc']} rank(s), global batch {tune.grid.base['global_batch']}, "
             f"{tune.shape.tokens_per_step} tokens per step",
             f"- space: {len(tune.candidates)} candidates over " + ", ".join(
                 f"{axis} {values}" for axis, values in tune.grid.axes.items() if len(values) > 1),
             f"- rungs: {list(tune.options.rung_steps)} steps, the first {tune.options.skip_steps} left out; "
             f"launches {len(tune.state.get('launches', []))}, {tune.spent_s:.0f} s",
             ""]
    if best:
        rung, row = best.best_result()
        lines += [f"**Best: `{best.point_id}`**, {format_rate(row['tokens_per_s'])} at rung {rung} "
                  f"(`pretrain --config {tune.options.out / BEST_FILE}`)."]
        lines += [f"Speed-up over the defaults (pretrain's own value on every axis): "
                  f"{'%.2fx' % ratio if ratio else 'n/a'} ({basis})."]
    lines += ["", "Why it stopped:", *(f"- {stop}" for stop in tune.stops), "",
              f"Cost model: {tune.model.explain()}", "",
              "Memory calibration (measured peak / estimate): " + (", ".join(
                  f"z{z}/{o} {r:.2f} ({src})" for z, o, r, src in tune.calibration.ratios) or "none measured yet, "
                  f"prior {tune.calibration.prior}"), "",
              "Predicted: the cost model's tokens/s; (sibling): its compute taken from measured candidates that "
              "differ from it only in loading, the model giving the rest; (graphs): a --cudagraphs candidate's "
              "compute, its graph-free twin's times the graphed / graph-free ratio of measured pairs "
              f"({_cell(tune.model.explain()['graph_ratio'], '.3f') or 'none measured'}).", "",
              "| candidate | state | predicted | rung | tokens/s | spread | step s | data wait s | peak GiB | "
              "estimate GiB (calibrated) | memory |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in _ordered(tune):
        name = f"`{c.point_id}`" + (" (default)" if c.default else "")
        result = c.best_result()
        rung, row = result if result else ("", {})
        sibling = " (sibling)" if c.predicted.get("siblings") else ""
        sibling += " (graphs)" if c.predicted.get("graph_ratio") else ""
        lines.append(f"| {name} | {_state(c)} | {format_rate(c.predicted.get('tokens_per_s'))}{sibling} | {rung} | "
                     f"{format_rate(row.get('tokens_per_s')) if row else ''} | "
                     f"{_cell(row.get('tokens_per_s_spread'), '.1%')} | {_cell(row.get('step_time_s'), '.3f')} | "
                     f"{_cell(row.get('data_wait_s'), '.4f')} | {_cell(row.get('peak_mem_gib'), '.2f')} | "
                     f"{c.estimate_gib:.2f} ({c.calibrated_gib:.2f}) | {c.memory}{': ' + c.why if c.why else ''} |")
    if tune.state.get("against_grid"):
        lines += tune_compare.render(tune.state["against_grid"])
    return "\n".join(lines) + "\n"


def write_plots(tune) -> list[Path]:
    """Predicted vs measured tokens/s of every launch, and the measured tokens/s of every candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [c for c in _ordered(tune) if c.best_result()]
    if not measured:
        return []
    written = []
    fig, ax = plt.subplots(figsize=(5, 4))
    for c in measured:
        ax.scatter(c.predicted["tokens_per_s"], c.best_result()[1]["tokens_per_s"],
                   color="tab:red" if c.default else "tab:blue")
    top = max(max(c.predicted["tokens_per_s"], c.best_result()[1]["tokens_per_s"]) for c in measured) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.set(xlabel="predicted tokens/s (final model)", ylabel="measured tokens/s", title="cost model (red: default)")
    written.append(save_figure(plt, fig, tune.options.out / PLOTS["predicted"]))
    fig, ax = plt.subplots(figsize=(6, max(2.5, 0.3 * len(measured))))
    ax.barh([c.point_id for c in measured][::-1], [c.best_result()[1]["tokens_per_s"] for c in measured][::-1],
            color=["tab:red" if c.default else "tab:blue" for c in measured][::-1])
    ax.set(xlabel="tokens/s (highest rung measured)", title="measured candidates (red: default)")
    written.append(save_figure(plt, fig, tune.options.out / PLOTS["candidates"]))
    return written


def best_config(tune) -> TrainConfig:
    """best.yaml's settings: the best candidate's, for a real run of --best-steps steps into DIR/best-run, with
    pretrain's default final checkpoint."""
    return tune.best().config.replace(steps=tune.options.best_steps, out=str(tune.options.out / "best-run"),
                                      save_final=TrainConfig(data="-", out="-").save_final)


def write_outputs(tune) -> dict[str, Any]:
    """best.yaml (when a candidate finished ok), tune.md and the plots."""
    out = tune.options.out
    written: dict[str, Any] = {"best": None}
    if tune.best() is not None:
        path = out / BEST_FILE
        text = (f"# study tune: the fastest of {len(tune.candidates)} candidates ({tune.best().point_id}); run it "
                f"as\n#   pretrain --config {path}\n" + yaml.safe_dump(to_yaml_values(best_config(tune)),
                                                                         sort_keys=False))
        atomic_write_bytes(path, text.encode())
        written["best"] = path
    written["plots"] = write_plots(tune)
    written["md"] = out / TUNE_MD
    atomic_write_bytes(written["md"], render_markdown(tune).encode())
    return written
