"""The study runner: grid expansion, steady-state medians, and real `pretrain` launches on CPU (gloo, 2 ranks)
with a point forced to fail, a rerun that skips finished points, --retry-failed, and a per-point timeout.

    .venv/bin/python -m pytest tests/pretrain/test_study.py -q
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launching import child_env
from pipeline.common import CONFIGS_DIR, UserError
from pretrain.study import results
from pretrain.study.grid import load_grid

STUDY_CLI = [sys.executable, "-m", "pretrain.study.cli"]


def write_grid(path: Path, **sections) -> Path:
    grid = {"name": "t", "base": {"steps": 4, "skip_steps": 1, "global_batch": 8, "timeout_s": 240},
            "grid": {"model": "t5-tiny", "zero": 2, "micro_batch": 2, "nproc": 2}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(grid.get(key), dict):
            grid[key] = {**grid[key], **value}
        else:
            grid[key] = value
    path.write_text(yaml.safe_dump(grid))
    return path


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return subprocess.run([*STUDY_CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


# ------------------------------------------------------------------------------------------------ grid files

def test_exclude_and_include_rules(tmp_path):
    grid = load_grid(write_grid(
        tmp_path / "g.yaml", grid={"zero": [0, 1, 2, 3], "offload": ["none", "cpu"], "loader_workers": [0, 2]},
        exclude=[{"zero": [0, 1], "offload": "cpu"}],
        include=[{"zero": 3, "offload": "nvme", "micro_batch": [1, 4]}],
        base={"nvme_path": str(tmp_path / "nvme")}))       # the nvme points are checked as pretrain would
    points = grid.points()
    ids = [grid.point_id(p) for p in points]
    assert len(ids) == len(set(ids)) == (2 + 2 + 4 + 4) + 2        # stages 0-1 without offload, 2-3 with both, +2
    assert not any(p.offload == "cpu" and p.zero < 2 for p in points)
    nvme = [p for p in points if p.offload == "nvme"]
    assert sorted(p.micro_batch for p in nvme) == [1, 4] and {p.loader_workers for p in nvme} == {0}
    assert "t5-tiny-z2-cpu-mb2-w2-n2" in ids
    assert grid.label(points[0]) == "t5-tiny zero=0 offload=none mb=2 w=0 n=2"


@pytest.mark.parametrize("sections, message", [
    ({"grid": {"stage": [1]}}, "unknown grid axes ['stage']"),
    ({"base": {"steps": 3, "skip_steps": 3}}, "skip_steps must be in [0, steps=3)"),
    ({"base": {"warmup": 1}}, "unknown base settings ['warmup']"),
    ({"grid": {"offload": "disk"}}, "offload must be one of"),
    ({"exclude": [{"zero": 2}]}, "no points left after exclude"),
    # every point is a TrainConfig, checked when the grid is read: a bad value names the point
    ({"grid": {"zero": [2, 5]}}, "point t5-tiny-z5-none-mb2-w0-n2: --zero must be one of 0, 1, 2, 3"),
    ({"grid": {"zero": [0, 2], "offload": "cpu"}}, "point t5-tiny-z0-cpu-mb2-w0-n2: --offload needs ZeRO stage 1"),
    ({"grid": {"lr": [0.001, "fast"]}}, "lr must be float, got 'fast'"),
    # two axes' values that pretrain refuses together: the exclude rule that keeps the grid's other points
    ({"grid": {"zero": [0, 2], "offload": ["none", "cpu"]}}, "--offload needs ZeRO stage 1 or higher (stage 0 keeps "
     "everything on the device); use --zero 2 or 3; or, to keep the grid's other points, leave this combination "
     "out: exclude: [{zero: 0, offload: cpu}]"),
    ({"base": {"compile": True}, "grid": {"zero": [2, 3], "cudagraphs": [False, True]}},
     "point t5-tiny-z3-none-mb2-w0-n2-cudagraphs1: --cudagraphs: ZeRO 3 gathers"),
    ({"base": {"compile": True}, "grid": {"zero": [2, 3], "cudagraphs": [False, True]}},
     "exclude: [{zero: 3, cudagraphs: true}]"),
    # and what pretrain would refuse at once from the settings alone
    ({"grid": {"model": ["t5-tiny", "t5-nano"]}}, "point t5-nano-z2-none-mb2-w0-n2: model preset 't5-nano' not found"),
    ({"grid": {"micro_batch": [2, 3]}}, "point t5-tiny-z2-none-mb3-w0-n2: --global-batch 8 is not a multiple of "
                                        "--micro-batch 3 x 2 ranks"),
    ({"base": {"extra_args": ["--compile"]}}, "`compile: true` for --compile"),
    ({"base": {"out": "runs/x"}}, "unknown base settings ['out']"),
    ({"base": {"zero": 2}, "grid": {"zero": [0, 1]}}, "['zero'] in both base and grid"),
    ({"repeats": 0}, "repeats must be a count >= 1 or {times: 3, where:"),
    ({"repeats": {"times": 3, "where": [{"stage": 2}]}}, "repeats.where entry {'stage': 2} names unknown axes"),
])
def test_bad_grid_files_name_the_file_and_the_fix(tmp_path, sections, message):
    path = write_grid(tmp_path / "bad.yaml", **sections)
    with pytest.raises(UserError, match=str(path)) as err:
        load_grid(path)
    assert message in str(err.value)


def test_dry_run_refuses_a_bad_point_before_anything_runs(tmp_path):
    path = write_grid(tmp_path / "bad.yaml", grid={"zero": [1, 0], "offload": "cpu"})
    result = run_cli("run", str(path), "--out", str(tmp_path / "study"), "--dry-run")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"{path}: point t5-tiny-z0-cpu-mb2-w0-n2: --offload needs ZeRO stage 1" in result.stderr
    assert not (tmp_path / "study").exists()


def test_a_grid_file_that_is_not_text_is_one_line(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    result = run_cli("run", str(binary), "--out", str(tmp_path / "study"))
    assert result.returncode == 2 and f"{binary}: not UTF-8 text" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "study").exists()


def test_shipped_grids():
    tiny = load_grid(CONFIGS_DIR / "study" / "cpu-tiny.yaml").points()
    assert len(tiny) == 8 and {p.zero for p in tiny} == {0, 3} and {p.loader_workers for p in tiny} == {0, 2}
    assert {p.loader for p in tiny} == {"shards", "online"}
    assert {(p.model, p.nproc) for p in tiny} == {("t5-tiny", 2)}
    x2 = load_grid(CONFIGS_DIR / "study" / "h200x2.yaml").points()
    assert {p.model for p in x2} == {"mt5-base", "mt5-large"} and {p.nproc for p in x2} == {2}
    assert {(p.zero, p.offload) for p in x2} == {(0, "none"), (1, "none"), (2, "none"), (3, "none"),
                                                 (2, "cpu"), (3, "cpu")}
    assert {p.loader_workers for p in x2} == {0, 1, 4} and len(x2) == 36
    x8 = load_grid(CONFIGS_DIR / "study" / "h200x8.yaml").points()
    assert {(p.model, p.zero, p.offload) for p in x8} == {
        ("mt5-xl", 1, "none"), ("mt5-xl", 2, "none"), ("mt5-xl", 3, "none"),
        ("mt5-xxl", 2, "none"), ("mt5-xxl", 2, "cpu"), ("mt5-xxl", 3, "none"), ("mt5-xxl", 3, "cpu")}
    assert all(p.nproc == 8 and p.activation_checkpointing for p in x8)
    assert {p.loader_workers for p in x8} == {1, 4} and len(x8) == 14


def test_steady_state_medians_leave_out_the_warmup_steps():
    metrics = [{"step": s, "tokens_per_s": t, "step_time_s": st, "data_wait_s": w, "compute_s": st - w,
                "peak_mem_gib": m, "grad_accum": 2}
               for s, t, st, w, m in [(1, 10.0, 9.0, 4.0, 3.0), (2, 100.0, 1.0, 0.0, 1.0),
                                      (3, 120.0, 1.0, 0.1, 1.5), (4, 110.0, 2.0, 0.5, 1.2)]]
    medians = results.summarize_metrics(metrics, skip_steps=1)
    assert medians["tokens_per_s"] == 110.0 and medians["step_time_s"] == 1.0
    assert medians["data_wait_share"] == pytest.approx(0.6 / 4.0)  # total wait / total step time, steps 2-4
    assert medians["peak_mem_gib"] == 3.0                          # the peak over every step, warm-up included
    assert medians["peak_reserved_gib"] is None                    # a CPU run records none
    assert (medians["steps_done"], medians["steps_measured"], medians["grad_accum"]) == (4, 3, 2)
    for m, reserved in zip(metrics, (5.0, 4.0, 6.0, 3.0)):        # a GPU run: the allocator's reserve beside it
        m["peak_reserved_gib"] = reserved
    assert results.summarize_metrics(metrics, skip_steps=1)["peak_reserved_gib"] == 6.0



def test_steady_state_medians_leave_out_the_profiled_steps():
    """A point with profile_steps traces its last steps, which the profiler slows (an mt5-xl ZeRO 3 step: 1.5 s
    traced, 0.86 s not): its medians are of the untraced steps, as pretrain's own summary.json."""
    metrics = [{"step": s, "tokens_per_s": 100.0 / st, "step_time_s": st, "data_wait_s": 0.0, "compute_s": st,
                "peak_mem_gib": 1.0, "grad_accum": 1, "profiled": s > 4}
               for s, st in [(1, 9.0), (2, 1.0), (3, 1.1), (4, 1.2), (5, 3.0), (6, 3.0)]]
    medians = results.summarize_metrics(metrics, skip_steps=1)
    assert medians["step_time_s"] == 1.1 and medians["steps_measured"] == 3

# ------------------------------------------------------------------------------------------------ real launches

def test_study_refuses_a_second_shard_set(tiny_shards, tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    (out / results.STUDY_FILE).write_text(json.dumps({"fingerprint": "0" * 64, "shards": "shards/other"}))
    result = run_cli("run", str(write_grid(tmp_path / "g.yaml")), "--out", str(out), "--data", str(tiny_shards))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "000000000000 (shards/other)" in result.stderr and "another --out" in result.stderr
    assert not (out / results.RUNS_DIR).exists()


def test_sweep_records_failures_goes_on_and_skips_finished_points(tiny_shards, tmp_path):
    # Three points on 2 gloo ranks: input length 128 trains; 64 is refused by pretrain (the shard set's is 128),
    # which the grid cannot know; mt5-xxl (13B) is refused by pretrain's memory preflight on this host: oom.
    grid_path = write_grid(tmp_path / "grid.yaml", grid={"input_length": [64, 128]},
                           include=[{"model": "mt5-xxl", "input_length": 128}])
    out = tmp_path / "study"
    first = run_cli("run", str(grid_path), "--out", str(out), "--data", str(tiny_shards))
    assert first.returncode == 0, first.stdout + first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].startswith("[1/3] t5-tiny zero=2 offload=none mb=2 w=0 n=2 input_length=64 ... FAILED: ")
    assert "shards have input_length 128, the run expects 64" in lines[0]
    assert lines[1].startswith("[2/3] t5-tiny zero=2 offload=none mb=2 w=0 n=2 input_length=128 ... ")
    assert "tok/s" in lines[1]
    assert lines[2].startswith("[3/3] mt5-xxl zero=2 offload=none mb=2 w=0 n=2 input_length=128 ... OOM: ")
    assert "will not fit" in lines[2]
    assert "3 points: 1 ok, 1 oom, 1 failed, 0 timeout (0 skipped as finished, 3 launched)" in first.stdout

    with open(out / "results.csv", newline="") as f:
        rows = {row["point_id"]: row for row in csv.DictReader(f)}
    failed, ok = rows["t5-tiny-z2-none-mb2-w0-n2-input_length64"], rows["t5-tiny-z2-none-mb2-w0-n2-input_length128"]
    assert failed["status"] == "failed" and "the run expects 64" in failed["reason"]
    assert failed["tokens_per_s"] == ""
    assert rows["mt5-xxl-z2-none-mb2-w0-n2-input_length128"]["status"] == "oom"
    markdown = (out / "report.md").read_text()
    assert "**mt5-xxl**: no configuration finished" in markdown and "oom at ZeRO-2 mb=2" in markdown
    assert "**t5-tiny**: fastest that fits is ZeRO-2, micro batch 2, 0 loader workers" in markdown
    metrics = [json.loads(line) for line in (out / "runs" / ok["point_id"] / "metrics.jsonl").read_text().splitlines()]
    assert ok["status"] == "ok" and len(metrics) == 4 and ok["steps_measured"] == "3"
    steady = sorted(m["tokens_per_s"] for m in metrics[1:])
    assert float(ok["tokens_per_s"]) == pytest.approx(steady[1], rel=1e-5)      # median of steps 2-4
    assert float(ok["tokens_per_s_spread"]) == pytest.approx((steady[2] - steady[0]) / 2 / steady[1], rel=1e-4)
    assert (ok["zero"], ok["nproc"], ok["global_batch"], ok["grad_accum"]) == ("2", "2", "8", "2")
    assert float(ok["est_gpu_gib"] or 0) >= 0 and ok["est_method"]
    assert 0 <= float(ok["data_wait_share"]) < 1
    state = json.loads((out / results.STUDY_FILE).read_text())
    manifest = json.loads((Path(tiny_shards) / "manifest.json").read_text())
    assert state["fingerprint"] == manifest["fingerprint"] and manifest["fingerprint"] in (out / "report.md").read_text()
    assert all((out / name).stat().st_size > 0 for name in ("throughput.png", "memory.png", "data_wait.png",
                                                            "step_time.png"))
    ok_mtime = (out / "runs" / ok["point_id"] / results.POINT_FILE).stat().st_mtime_ns

    again = run_cli("run", str(grid_path), "--out", str(out), "--data", str(tiny_shards))
    assert again.returncode == 0
    assert "(3 skipped as finished, 0 launched)" in again.stdout and again.stdout.count("skipped (") == 3

    retry = run_cli("run", str(grid_path), "--out", str(out), "--data", str(tiny_shards), "--retry-failed")
    assert retry.returncode == 0
    assert "[1/3] t5-tiny zero=2 offload=none mb=2 w=0 n=2 input_length=64 ... FAILED" in retry.stdout
    assert "[2/3] t5-tiny zero=2 offload=none mb=2 w=0 n=2 input_length=128 ... skipped (ok earlier)" in retry.stdout
    assert "[3/3] mt5-xxl zero=2 offload=none mb=2 w=0 n=2 input_length=128 ... OOM" in retry.stdout
    assert "(1 skipped as finished, 2 launched)" in retry.stdout
    assert (out / "runs" / ok["point_id"] / results.POINT_FILE).stat().st_mtime_ns == ok_mtime
    assert len(state["commands"]) == 1 and len(json.loads((out / results.STUDY_FILE).read_text())["commands"]) == 3


def test_a_rerun_of_an_edited_grid_refuses_points_that_finished_with_other_settings(tiny_shards, tmp_path):
    """A finished point is skipped on a rerun only with the settings it ran with: an edited grid would otherwise
    report the old result as the new one's. Refused in one line before anything is written; the unedited grid
    still resumes."""
    grid_path = write_grid(tmp_path / "grid.yaml", base={"steps": 3, "skip_steps": 1, "global_batch": 4},
                           grid={"nproc": 1})
    out = tmp_path / "study"
    first = run_cli("run", str(grid_path), "--out", str(out), "--data", str(tiny_shards))
    assert first.returncode == 0, first.stdout + first.stderr
    record = out / results.RUNS_DIR / "t5-tiny-z2-none-mb2-w0-n1" / results.POINT_FILE
    kept = {path: path.read_bytes() for path in (record, out / results.STUDY_FILE, out / results.RESULTS_CSV)}

    edited = write_grid(tmp_path / "grid.yaml", base={"steps": 4, "skip_steps": 1, "global_batch": 4},
                        grid={"nproc": 1})
    for extra in ([], ["--dry-run"]):
        again = run_cli("run", str(edited), "--out", str(out), "--data", str(tiny_shards), *extra)
        assert again.returncode == 2 and "Traceback" not in again.stderr and again.stderr.count("\n") == 1
        assert ("point t5-tiny-z2-none-mb2-w0-n1 finished with other settings than it has now (steps: 3 -> 4)"
                in again.stderr and "use another --out" in again.stderr), again.stderr
    assert {path: path.read_bytes() for path in kept} == kept

    write_grid(tmp_path / "grid.yaml", base={"steps": 3, "skip_steps": 1, "global_batch": 4}, grid={"nproc": 1})
    resumed = run_cli("run", str(grid_path), "--out", str(out), "--data", str(tiny_shards))
    assert resumed.returncode == 0 and "skipped (ok earlier)" in resumed.stdout
    assert record.read_bytes() == kept[record]


def test_a_second_study_run_on_the_same_directory_waits_and_skips_the_point_the_first_ran(tiny_shards, tmp_path):
    """Two `study run`s of one grid into one --out: the second waits for the point the first is running, then
    finds it finished and skips it, instead of clearing its run dir and launching it again."""
    grid_path = write_grid(tmp_path / "grid.yaml", base={"steps": 60, "skip_steps": 1, "global_batch": 4},
                           grid={"nproc": 1})
    out = tmp_path / "study"
    run_dir = out / results.RUNS_DIR / "t5-tiny-z2-none-mb2-w0-n1"
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([*STUDY_CLI, "run", str(grid_path), "--out", str(out), "--data", str(tiny_shards)],
                                 stdout=log, stderr=subprocess.STDOUT,
                                 env=child_env(RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false"))
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").is_file():        # the first study's point is training
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.1)
    second = run_cli("run", str(grid_path), "--out", str(out), "--data", str(tiny_shards))
    assert first.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()
    assert second.returncode == 0, second.stdout + second.stderr
    assert "waiting for another study run" in second.stdout
    assert "skipped (ok: another study run finished it meanwhile)" in second.stdout, second.stdout
    assert "(1 skipped as finished, 0 launched)" in second.stdout
    record = json.loads((run_dir / results.POINT_FILE).read_text())
    assert record["status"] == "ok" and len((run_dir / "metrics.jsonl").read_text().splitlines()) == 60


@pytest.mark.slow   # ./scripts/test.sh -m slow (the default suite stays under CI's 20 minutes)
def test_a_point_past_its_timeout_is_stopped_and_recorded(tiny_shards, tmp_path):
    # 4000 steps cannot finish in 15 s; by then pretrain has spawned its 2 ranks (in sessions of their own).
    grid_path = write_grid(tmp_path / "grid.yaml", base={"timeout_s": 15, "steps": 4000})
    out = tmp_path / "study"
    result = run_cli("run", str(grid_path), "--out", str(out), "--data", str(tiny_shards))
    assert result.returncode == 1                       # no point finished
    assert "TIMEOUT: no result within timeout_s=15" in result.stdout
    run_dir = out / "runs" / "t5-tiny-z2-none-mb2-w0-n2"
    record = json.loads((run_dir / results.POINT_FILE).read_text())
    assert record["status"] == "timeout" and record["wall_s"] < 75
    assert (run_dir / "logs" / "rank-1.log").is_file()  # the ranks had started
    # Nothing of the launch is left running: no process still has the run dir on its command line.
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_a_prep_spec_that_fails_names_the_grid_file(tmp_path):
    grid_path = write_grid(tmp_path / "grid.yaml", data={"input": str(tmp_path / "missing.jsonl"),
                                                         "tokenizer": str(tmp_path / "missing.json")})
    result = run_cli("run", str(grid_path), "--out", str(tmp_path / "study"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{grid_path}: `prep corpus` failed (" in result.stderr and "pass --data" in result.stderr


@pytest.mark.slow
def test_the_cpu_demo_grid_end_to_end(tmp_path):
    """configs/study/cpu-tiny.yaml as shipped: tokenizer and shards prepared once, 8 real launches over the loader
    axis (shards vs online) too, the report."""
    out = tmp_path / "cpu-tiny"
    result = run_cli("run", str(CONFIGS_DIR / "study" / "cpu-tiny.yaml"), "--out", str(out), timeout=1200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "8 points: 8 ok, 0 oom, 0 failed, 0 timeout" in result.stdout, result.stdout[-3000:]  # each point's reason
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["zero"], r["loader"], r["loader_workers"]) for r in rows} == {
        (str(z), mode, str(w)) for z in (0, 3) for mode in ("shards", "online") for w in (0, 2)}
    assert all(float(r["tokens_per_s"]) > 0 and r["steps_measured"] == "25" for r in rows)
    assert "fastest that fits is ZeRO-" in (out / "report.md").read_text()


def test_any_pretrain_setting_is_an_axis_and_a_column(tiny_shards, tmp_path):
    """lr is named nowhere in the study's code: a TrainConfig field is an axis, a point-id suffix, a point.yaml
    key the launch reads, and a results.csv column, with no edit to the study. A repeated point runs again
    after every point ran once; results.csv keeps each run, the report one row per point with its range."""
    study_code = "\n".join(p.read_text() for p in Path(results.__file__).parent.glob("*.py"))
    assert not re.search(r"\blr\b", study_code)
    grid_path = write_grid(tmp_path / "grid.yaml", base={"steps": 3, "skip_steps": 1, "global_batch": 4},
                           grid={"lr": [0.001, 0.002], "nproc": 1}, repeats={"times": 2, "where": [{"lr": 0.002}]})
    grid = load_grid(grid_path)
    ids = [Path(p.out).name for p in grid.points()]
    assert ids == ["t5-tiny-z2-none-mb2-w0-n1-lr0.001", "t5-tiny-z2-none-mb2-w0-n1-lr0.002",
                   "t5-tiny-z2-none-mb2-w0-n1-lr0.002-r2"]
    assert [grid.repeat_of(p) for p in grid.points()][1:] == [(ids[1], 1), (ids[1], 2)]
    assert grid.label(grid.points()[1]) == "t5-tiny zero=2 offload=none mb=2 w=0 n=1 lr=0.002"

    out = tmp_path / "study"
    result = run_cli("run", str(grid_path), "--out", str(out), "--data", str(tiny_shards))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 points: 3 ok" in result.stdout and "lr=0.002 (run 2) ..." in result.stdout
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[:10] == ["point_id", "model", "zero", "offload", "micro_batch", "loader_workers",
                                      "nproc", "activation_checkpointing", "lr", "repeat"]
    assert [(r["point_id"], r["lr"], r["repeat"], r["status"]) for r in rows] == [
        (ids[0], "0.001", "1", "ok"), (ids[1], "0.002", "1", "ok"), (ids[2], "0.002", "2", "ok")]
    typed = results.read_results_csv(out / "results.csv")
    assert [r["lr"] for r in typed] == [0.001, 0.002, 0.002]
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0 for r in typed)
    combined = results.combine_runs(typed)
    assert [(r["point_id"], r["runs"]) for r in combined] == [(ids[0], "1/1"), (ids[1], "2/2")]
    rates = sorted(r["tokens_per_s"] for r in typed[1:])
    assert (combined[1]["tokens_per_s_min"], combined[1]["tokens_per_s_max"]) == tuple(rates)
    assert combined[1]["tokens_per_s_spread"] >= (rates[1] - rates[0]) / combined[1]["tokens_per_s"]
    text = (out / "report.md").read_text()
    assert "| ckpt | lr | status |" in text and ", 2 runs)" in text
    assert text.count("| t5-tiny | ZeRO-2 |") == 2           # one row per point, not per run
    for point_id, lr in zip(ids, (0.001, 0.002, 0.002)):
        run_dir = out / results.RUNS_DIR / point_id
        record = json.loads((run_dir / results.POINT_FILE).read_text())
        assert record["command"][-2:] == ["--config", str(run_dir / results.POINT_CONFIG)]   # nothing else
        point = yaml.safe_load((run_dir / results.POINT_CONFIG).read_text())
        assert (point["lr"], point["data"], point["out"], point["steady_skip"]) == (lr, str(tiny_shards),
                                                                                 str(run_dir), 1)
        assert json.loads((run_dir / "config.json").read_text())["train"]["lr"] == lr    # what pretrain ran
