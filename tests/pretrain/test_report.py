"""The study report built from a fixed results file: table values, recommendations text, valid PNGs.

    .venv/bin/python -m pytest tests/pretrain/test_report.py -q
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image  # noqa: E402
import pytest  # noqa: E402

from pretrain.study import plots, report, results  # noqa: E402

ASSET = Path(__file__).resolve().parents[1] / "assets" / "study_results.csv"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def rows():
    return results.read_results_csv(ASSET)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`study report DIR` run as a user would, on a directory holding only the fixed results.csv."""
    study_dir = tmp_path_factory.mktemp("study")
    shutil.copy(ASSET, study_dir / results.RESULTS_CSV)
    result = subprocess.run([sys.executable, "-m", "pretrain.study.cli", "report", str(study_dir)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return study_dir, result


def test_csv_round_trip_keeps_types_and_values(rows, tmp_path):
    assert len(rows) == 36
    first = rows[0]
    assert (first["model"], first["zero"], first["offload"], first["loader_workers"]) == ("mt5-base", 0, "none", 0)
    assert first["activation_checkpointing"] is False and first["tokens_per_s"] == pytest.approx(56513.0)
    oom = [r for r in rows if r["status"] == "oom"]
    assert len(oom) == 3 and all(r["tokens_per_s"] is None for r in oom)
    results.write_results_csv(rows, tmp_path / "again.csv")
    assert results.read_results_csv(tmp_path / "again.csv") == rows


def test_table_and_stage_comparison_values(rows):
    table = report.results_table(rows)
    assert table.count("\n") == len(rows) + 1                  # header, rule, one line per point
    assert "| mt5-base | ZeRO-1 | 8 | 4 | 2 | off | ok | 61,000 |" in table
    assert "| mt5-large | ZeRO-0 | 8 | 0 | 2 | off | oom | – |" in table
    comparison = report.stage_comparison(rows)
    # mt5-large: ZeRO-2 is the fastest stage (1.00x); ZeRO-1 = 22000 / 23500 of it; ZeRO-0 never fit.
    assert "| ZeRO-2 | 23.5k tok/s | 1.00x |" in comparison
    assert f"| ZeRO-1 | 22.0k tok/s | {22000 / 23500:.2f}x |" in comparison
    assert "| ZeRO-0 | – | – | – | – | – | 18.4 | 0 | 0/3 (oom) |" in comparison   # the estimate, beside the OOM


def test_the_table_shows_reserved_memory_where_it_was_recorded(rows):
    """On GPUs (peak_reserved_gib recorded) a `reserved GiB` column follows the peak: CUDA graphs' pools show there
    only; the CPU rows of the asset (null reserved) keep the table as it was."""
    assert "reserved GiB" not in report.results_table(rows)
    graphed = [dict(rows[0], peak_mem_gib=30.5, peak_reserved_gib=63.25)]
    table = report.results_table(graphed)
    header, _, line = table.splitlines()
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert columns.index("reserved GiB") == columns.index("peak GiB") + 1 and len(cells) == len(columns)
    assert cells[columns.index("peak GiB")] == "30.5" and cells[columns.index("reserved GiB")] == "63.2"
    # the estimate's accuracy: a graphed point's peak is what it reserved, a graph-free one's what it allocated
    accuracy = report.estimate_accuracy([dict(graphed[0], status="ok", est_gpu_gib=40.0, cudagraphs=True)])
    assert "(63.2 vs 40 GiB)" in accuracy[0]
    assert "(30.5 vs 40 GiB)" in report.estimate_accuracy([dict(graphed[0], status="ok", est_gpu_gib=40.0)])[0]
    # the per-stage comparison's max peak (and the memory plot's bar) likewise
    stages = report.stage_comparison([dict(graphed[0], status="ok", est_gpu_gib=40.0, cudagraphs=True)])
    assert "| 63.2 | 40 |" in stages


def test_fastest_configuration_follows_the_data(rows):
    lines = report.fastest_that_fits(rows)
    assert len(lines) == 2
    base, large = lines
    # The recommendation is the row with the highest tokens/s among the points that finished.
    best_base = max((r for r in rows if r["model"] == "mt5-base" and r["status"] == "ok"),
                    key=lambda r: r["tokens_per_s"])
    assert (best_base["zero"], best_base["loader_workers"]) == (1, 4)
    assert "**mt5-base**: fastest that fits is ZeRO-1, micro batch 8, 4 loader workers: 61.0k tok/s" in base
    assert "ZeRO-0" in base and "ZeRO-2" in base and "they tie" in base      # 60.0k and 59.8k are within 3%
    assert "ZeRO-3" not in base                                              # 48k is not a tie
    assert "fastest that fits is ZeRO-2, micro batch 8, 4 loader workers: 23.5k tok/s" in large
    # ZeRO-1 is 6.4% slower, more than the 3% floor but inside its own 8% step-to-step spread: a tie.
    assert "ZeRO-1, micro batch 8, 4 loader workers (22.0k tok/s, 6.4% slower, spread 8.0%)" in large
    narrow = [dict(r, tokens_per_s_spread=0.01) for r in rows if r["model"] == "mt5-large"]
    assert "tie" not in report.fastest_that_fits(narrow)[0]
    assert "oom at ZeRO-0 mb=8" in large and "timeout at ZeRO-1 mb=8" in large


def test_fewest_workers_and_when_the_data_cannot_tell(rows):
    lines = report.fewest_workers(rows)
    text = "\n".join(lines)
    assert "- mt5-base, ZeRO-1: 1 loader worker keeps data wait under 1%" in text
    assert "- mt5-base, ZeRO-2 + cpu offload: 4 loader workers keep data wait under 1%" in text
    large_offload = next(line for line in lines if line.startswith("- mt5-large, ZeRO-3 + cpu offload"))
    assert "none of the tried worker counts" in large_offload and "can't tell" in large_offload
    large_z1 = next(line for line in lines if line.startswith("- mt5-large, ZeRO-1:"))
    assert "fewest that finished" in large_z1 and "0 workers: timeout" in large_z1
    # Without the 0-worker points the fewest tried already passes: the data can't tell whether fewer would do.
    fewer = report.fewest_workers([r for r in rows if r["loader_workers"] != 0 and r["model"] == "mt5-base"])
    assert any("can't tell whether fewer than 1" in line for line in fewer)
    # No finished point at all: says so instead of recommending.
    failed = [dict(r, status="oom") for r in rows if r["model"] == "mt5-large"]
    assert "no configuration finished" in report.fastest_that_fits(failed)[0]
    assert report.fewest_workers(failed) == []


def test_loading_cores_come_from_the_cpu_cost_per_example_pooled_over_the_points(rows):
    """Online workers make a whole unit's examples at once: a slow point can consume, in its measured steps, what
    they made before them (0 loader cores there). Its stage's need is then the mode's CPU per example, measured at
    the other points, times its rate."""
    ok = [r for r in rows if r["model"] == "mt5-base" and r["status"] == "ok" and r["zero"] in (0, 2)]
    fast = [dict(r, loader="online", loader_cores=0.6 if r["zero"] == 0 else 0.0, loader_workers=1) for r in ok]
    assert all(r["nproc"] == 2 for r in fast)
    per_example = report.loader_cpu_per_example(fast)
    zero0 = [r for r in fast if r["zero"] == 0]
    assert zero0 and per_example["online"] == pytest.approx(statistics.median(0.6 * 2 / r["samples_per_s"] for r in zero0))
    lines = report.loading_findings(fast)
    zero2 = next(line for line in lines if "ZeRO-2**" in line)
    rate = max(r["samples_per_s"] for r in fast if r["zero"] == 2)
    assert f"`online` needs {per_example['online'] * rate:.2g} host cores at this stage's {rate:.0f} examples/s" in zero2
    assert "before the measured steps" in zero2
    # nothing measured anywhere: says so rather than reporting 0 cores
    idle = report.loading_findings([dict(r, loader_cores=0.0) for r in fast])
    assert all("no loader CPU in the measured steps" in line and "needs" not in line for line in idle)


def test_estimate_accuracy_per_stage(rows):
    base = report.estimate_accuracy(rows)[0]
    assert base.startswith("- mt5-base: measured peak / estimate per device: ZeRO-0 3.5x (30.2 vs 8.7 GiB)")


def test_study_report_cli_writes_markdown_and_valid_pngs(built):
    study_dir, result = built
    assert "report:" in result.stdout
    markdown = (study_dir / report.REPORT_MD).read_text()
    for heading in ("## Setup", "## Results", "## Per-stage comparison", "## Plots", "## Recommendations"):
        assert heading in markdown
    assert "36 points: 32 ok, 3 oom, 1 timeout." in markdown
    assert "rebuilt from results.csv alone" in markdown
    for name in plots.PLOTS.values():
        path = study_dir / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 300 and image.std() > 0.01   # not blank
        assert f"]({name})" in markdown
    assert results.read_results_csv(study_dir / results.RESULTS_CSV) == results.read_results_csv(ASSET)


def test_report_cli_refuses_an_empty_directory(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pretrain.study.cli", "report", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "study run" in result.stderr and "Traceback" not in result.stderr


def test_report_cli_says_a_file_or_a_missing_path_is_no_study_directory(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("notes\n")
    for path, says in ((afile, "a file, not a study directory"), (tmp_path / "nothing", "no such study directory")):
        result = subprocess.run([sys.executable, "-m", "pretrain.study.cli", "report", str(path)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and f"{path}: {says}" in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert afile.read_text() == "notes\n" and not (tmp_path / "nothing").exists()


def test_report_cli_on_a_read_only_study_is_one_line_and_keeps_its_files(tmpfs):
    study_dir = tmpfs("study", "size=4m")
    shutil.copy(ASSET, study_dir / results.RESULTS_CSV)
    tmpfs.read_only(study_dir)
    result = subprocess.run([sys.executable, "-m", "pretrain.study.cli", "report", str(study_dir)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Read-only file system" in result.stderr, result.stderr
    assert f"make {study_dir} writable" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert (study_dir / results.RESULTS_CSV).read_bytes() == ASSET.read_bytes()


def test_a_row_carries_the_cudagraphs_its_run_resolved(rows, tmp_path):
    """results.csv's `cudagraphs` column is what the run resolved (config.json), its auto included, so a grid that
    does not vary it still reads a graphed run's reserved peak as the memory it needed; as an axis it stays one."""
    import json

    record = {"point_id": "p", "point": {"model": "mt5-large", "zero": 2}, "status": "ok",
              "config": {"steps": 12, "global_batch": 64, "steady_skip": 5, "cudagraphs": None}}
    run_dir = tmp_path / "p"
    run_dir.mkdir()
    assert results.result_row(record, run_dir)["cudagraphs"] is None           # never launched: as the point says
    (run_dir / "config.json").write_text(json.dumps({"train": {"cudagraphs": True}, "global_batch": 64}))
    row = {**rows[0], **results.result_row(record, run_dir), "peak_mem_gib": 29.3, "peak_reserved_gib": 42.7,
           "est_gpu_gib": 40.0}
    assert row["cudagraphs"] is True and "(42.7 vs 40 GiB)" in report.estimate_accuracy([row])[0]
    results.write_results_csv([row], tmp_path / "results.csv")
    again = results.read_results_csv(tmp_path / "results.csv")[0]
    assert again["cudagraphs"] is True and "cudagraphs" not in results.csv_axes(list(again))
    assert "CUDA graphs (`--cudagraphs` as each run resolved it" in report._setup_section([row, rows[1]], {})
    assert "runs; their memory is their reserved peak" not in report._setup_section(rows, {})
    axis = dict(row, point_id="q")
    results.write_results_csv([axis], tmp_path / "axis.csv", axes=(*results.CLASSIC_AXES, "cudagraphs"))
    header = (tmp_path / "axis.csv").read_text().splitlines()[0].split(",")
    assert results.csv_axes(header)[-1] == "cudagraphs" and header.count("cudagraphs") == 1
