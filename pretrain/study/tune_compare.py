"""`study tune --compare-grid STUDY_DIR`: the tune against a full grid measured over the same space, the check of
issue 17 (the best found within GOAL_GAP of the grid's best, in at most GOAL_TIME of the grid's device time).

    rows = grid_rows(Path("studies/mt5-large-full"))          # every run of the grid (read before the tune)
    against = compare_with_grid(tune, Path("studies/mt5-large-full"), rows)   # tune.json keeps it, tune.md shows it

The grid is any study directory (its runs, or its results.csv): `study run` of the tune's `--write-grid` file, or
a study whose grid spans the same space. Points are matched by their settings, not their ids (a setting the grid
did not vary, absent from its results, at pretrain's default). The best found is
judged by the grid's own measurement of the configuration the tune chose (the same launches' conditions as the
grid's best), and the tune's own figure for it is shown beside. Device time is the launches' wall seconds: the
grid's first run of every point (repeats are the grid's spread, not its cost), the tune's every launch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.common import UserError
from pretrain.config import TrainConfig
from pretrain.study.grid import CLASSIC_AXES
from pretrain.study.results import (RESULTS_CSV, combine_runs, finished_points, read_results_csv,
                                    result_row)

GOAL_GAP = 0.03     # the best found at most 3% below the grid's best
GOAL_TIME = 0.25    # in at most a quarter of the grid's device time


def grid_rows(study_dir: Path) -> list[dict[str, Any]]:
    """Every run of the study: from its run directories, else from its results.csv."""
    rows = [result_row(record, run_dir) for record, run_dir in finished_points(study_dir)]
    if not rows and (study_dir / RESULTS_CSV).is_file():
        rows = read_results_csv(study_dir / RESULTS_CSV)
    if not rows:
        raise UserError(f"--compare-grid {study_dir}: no finished points there (runs/ or {RESULTS_CSV}); run the "
                        f"full grid first: study tune ... --write-grid FILE, then study run FILE --out {study_dir}")
    return rows


def _same(a: Any, b: Any) -> bool:
    return a == b or (a in (None, "") and b in (None, ""))


def _matches(config, row: dict[str, Any], axes: list[str]) -> bool:
    return all(_same(getattr(config, axis), row.get(axis)) for axis in axes)


def compare_with_grid(tune, study_dir: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The tune's best against the grid's best (`rows`: the grid's runs, grid_rows), the two device times, and how
    the two spaces differ."""
    # an axis of the tune that a row has no value for (the grid did not vary it) counts at pretrain's default there:
    # its results do not say otherwise. cudagraphs counts as off: rows carry what each run resolved since its auto
    # (2026-12-05); a results.csv from before has no such column (read back as None), and graphs were opt-in then
    defaults = TrainConfig(data="-", out="-")
    unrecorded = {axis: False if axis == "cudagraphs" else getattr(defaults, axis) for axis in tune.grid.axes}
    rows = [{**row, **{axis: value for axis, value in unrecorded.items() if row.get(axis) is None}} for row in rows]
    axes = [axis for axis in dict.fromkeys([*CLASSIC_AXES, *tune.grid.axes]) if axis in rows[0]]
    grid_s = sum(float(r.get("wall_s") or 0.0) for r in rows if (r.get("repeat") or 1) == 1)
    points = combine_runs(rows)
    ok = [p for p in points if p["status"] == "ok" and p.get("tokens_per_s")]
    if not ok:
        raise UserError(f"--compare-grid {study_dir}: no point of that grid finished ok; nothing to compare against")
    grid_best = max(ok, key=lambda p: p["tokens_per_s"])
    best = tune.best()
    chosen = next((p for p in points if best and _matches(best.config, p, axes)), None)
    result: dict[str, Any] = {
        "study_dir": str(study_dir), "axes": axes, "grid_points": len(points), "grid_ok": len(ok),
        "grid_device_s": round(grid_s, 1), "tune_device_s": round(tune.spent_s, 1),
        "time_share": round(tune.spent_s / grid_s, 4) if grid_s else None,
        "grid_best": {"point_id": grid_best["point_id"], "tokens_per_s": grid_best["tokens_per_s"],
                      "spread": grid_best.get("tokens_per_s_spread")},
        "tune_best": None, "gap": None,
        "grid_points_not_in_tune": [p["point_id"] for p in points
                                    if not any(_matches(c.config, p, axes) for c in tune.candidates)],
        "tune_candidates_not_in_grid": [c.point_id for c in tune.candidates
                                        if not any(_matches(c.config, p, axes) for p in points)],
    }
    if best:
        rung, row = best.best_result()
        result["tune_best"] = {"point_id": best.point_id, "tokens_per_s_tune": row["tokens_per_s"],
                               "in_grid": chosen["point_id"] if chosen else None,
                               "tokens_per_s_grid": chosen.get("tokens_per_s") if chosen else None}
        if chosen and chosen.get("tokens_per_s"):
            result["gap"] = round(1 - chosen["tokens_per_s"] / grid_best["tokens_per_s"], 4)
    result["goal_met"] = bool(result["gap"] is not None and result["gap"] <= GOAL_GAP
                              and result["time_share"] is not None and result["time_share"] <= GOAL_TIME)
    return result


def render(against: dict[str, Any]) -> list[str]:
    """tune.md's section on the comparison."""
    best, chosen = against["grid_best"], against["tune_best"]
    lines = ["", f"## Against the full grid ({against['study_dir']})", "",
             f"- grid: {against['grid_points']} points ({against['grid_ok']} ok), {against['grid_device_s']:.0f} s of "
             f"launches (first runs); its best `{best['point_id']}` {best['tokens_per_s']:.0f} tok/s"
             + (f" (spread {best['spread']:.1%})" if best.get("spread") else ""),
             f"- tune: {against['tune_device_s']:.0f} s of launches, "
             + (f"{against['time_share']:.1%} of the grid's" if against["time_share"] is not None else "n/a")]
    if chosen is None:
        lines.append("- the tune has no best (nothing finished ok)")
    elif chosen["in_grid"] is None:
        lines.append(f"- its best `{chosen['point_id']}` is not a point of the grid: the spaces differ")
    else:
        lines.append(f"- its best `{chosen['point_id']}`: {chosen['tokens_per_s_tune']:.0f} tok/s in the tune, "
                     f"{chosen['tokens_per_s_grid']:.0f} in the grid (`{chosen['in_grid']}`), "
                     f"{against['gap']:.1%} below the grid's best")
    for key, what in (("grid_points_not_in_tune", "grid points outside the tune's space"),
                      ("tune_candidates_not_in_grid", "tune candidates outside the grid (the default is measured "
                                                      "first, in the grid or not)")):
        if against[key]:
            lines.append(f"- {what} (compared on {', '.join(against['axes'])}): {', '.join(against[key])}")
    lines.append(f"- goal (within {GOAL_GAP:.0%} of the grid's best, in at most {GOAL_TIME:.0%} of its time): "
                 + ("met" if against["goal_met"] else "not met"))
    return lines
