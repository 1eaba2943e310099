"""`study tune` on CPU (t5-tiny, 1 rank, real `pretrain` launches through the study runner): pruning by the memory
estimate, ranking and early stop, a tune killed mid-way and rerun, a budget that runs out, best.yaml run as is.

    .venv/bin/python -m pytest tests/pretrain/test_tune.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.common import REPO_ROOT
from pretrain.study.grid import load_grid
from pretrain.study.tune import TuneOptions, space_grid

# a space the cost model can rank: the default (ZeRO 2, micro 8) against micro 16 and micro 1 (32 accumulation
# steps) at stages 0 and 2; one 5-step rung
SMALL_SPACE = ["--model", "t5-tiny", "--nproc", "1", "--global-batch", "32", "--set", "zero=0,2",
               "--set", "micro_batch=1,16", "--set", "activation_checkpointing=false", "--set", "loader_workers=0",
               "--set", "offload=none", "--rung-steps", "5", "--skip-steps", "2", "--min-measured", "2",
               "--best-steps", "3"]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false")


def tune(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.study.cli", "tune", *args], capture_output=True,
                          text=True, timeout=timeout, env=env(), cwd=REPO_ROOT)


def tune_state(out: Path) -> dict:
    return json.loads((out / "tune.json").read_text())


def test_pruning_says_why_and_never_prunes_what_fits(tiny_shards, tmp_path):
    space = ["--model", "t5-tiny", "--nproc", "1", "--global-batch", "32", "--data", str(tiny_shards),
             "--set", "zero=0,3", "--set", "offload=none", "--set", "loader_workers=0", "--dry-run"]
    wide = tune(*space, "--out", str(tmp_path / "wide"), "--write-grid", str(tmp_path / "full.yaml"))
    assert wide.returncode == 0, wide.stderr
    estimates = sorted(c["estimate_gib"] for c in tune_state(tmp_path / "wide")["candidates"])
    capacity = estimates[len(estimates) // 2]          # half the space is above it

    narrow = tune(*space, "--out", str(tmp_path / "narrow"), "--device-memory-gib", f"{capacity:.4f}")
    assert narrow.returncode == 0, narrow.stderr
    candidates = tune_state(tmp_path / "narrow")["candidates"]
    pruned = [c for c in candidates if c["memory"] == "pruned"]
    assert pruned and len(pruned) < len(candidates)
    for c in candidates:            # prior calibration 1.0, margin 10%: pruned only well above the capacity
        assert (c["memory"] == "pruned") == (c["estimate_gib"] > capacity * 1.1), c
        if c["memory"] == "pruned":
            assert f"> capacity {capacity:.3g} GiB" in c["why"]
            assert any(line.startswith(f"[") and f"] {c['point_id']}" in line and ": pruned;" in line
                       for line in narrow.stdout.splitlines()), c
        if capacity * 0.9 < c["estimate_gib"] <= capacity * 1.1:
            assert c["memory"] == "near" and "measured, not pruned" in c["why"]
    assert "nothing launched" in narrow.stdout and not (tmp_path / "narrow" / "runs").exists()

    # --write-grid: the whole (unpruned) space as a study grid, the default among its points
    grid = load_grid(tmp_path / "full.yaml")
    assert len(grid.points()) == len(candidates) == 2 * 6 * 2 + 1        # zero x micro 1..32 x ckpt + the default
    assert "t5-tiny-z2-none-mb8-w0-n1" in [grid.point_id(p) for p in grid.points()]


def test_ranking_early_stop_and_best_yaml_runs_as_is(tiny_shards, tmp_path):
    out = tmp_path / "tune"
    result = tune(*SMALL_SPACE, "--data", str(tiny_shards), "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    state = tune_state(out)
    launched = [launch["point_id"] for launch in state["launches"]]
    assert launched[0] == "t5-tiny-z2-none-mb8-w0-n1-s5"                 # the default, always measured first
    # micro 1 is predicted slowest: launched, if at all (the cost model's margin widens when the 2 cores are busy
    # with other work), only after every micro 16 point; and the early stop leaves something unmeasured
    mb1 = [i for i, point in enumerate(launched) if "-mb1-" in point]
    mb16 = [i for i, point in enumerate(launched) if "-mb16-" in point]
    assert mb16 and all(i > max(mb16) for i in mb1), launched
    assert any("early stop" in stop for stop in state["stops"]) and "early stop" in result.stdout
    assert len(launched) < len(state["candidates"]), launched
    assert "the defaults" in result.stdout
    md = (out / "tune.md").read_text()
    for c in state["candidates"]:
        assert f"`{c['point_id']}`" in md
    assert (out / "tune_candidates.png").stat().st_size > 0 and (out / "tune_predicted.png").stat().st_size > 0

    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["out"] == str(out / "best-run") and best["steps"] == 3
    run = subprocess.run([sys.executable, "-m", "pretrain.cli", "--config", str(out / "best.yaml")],
                         capture_output=True, text=True, timeout=240, env=env(), cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((out / "best-run" / "summary.json").read_text())["status"] == "ok"


@pytest.mark.slow   # ./scripts/test.sh -m slow (the default suite stays under CI's 20 minutes)
def test_a_killed_tune_rerun_finishes_without_redoing_launches(tiny_shards, tmp_path):
    out = tmp_path / "tune"
    command = [sys.executable, "-m", "pretrain.study.cli", "tune", *SMALL_SPACE, "--data", str(tiny_shards),
               "--out", str(out)]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=REPO_ROOT)
    first_record = out / "runs" / "t5-tiny-z2-none-mb8-w0-n1-s5" / "study_point.json"
    deadline = time.monotonic() + 180
    while not (first_record.is_file() and len(list((out / "runs").iterdir())) >= 2):   # the second launch began
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    finished_at = first_record.stat().st_mtime

    rerun = tune(*SMALL_SPACE, "--data", str(tiny_shards), "--out", str(out))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "skipped (ok earlier)" in rerun.stdout and first_record.stat().st_mtime == finished_at
    state = tune_state(out)
    assert len(state["commands"]) == 2 and (out / "best.yaml").is_file()
    assert any("early stop" in stop or "every candidate" in stop for stop in state["stops"])


@pytest.mark.slow   # ./scripts/test.sh -m slow (the default suite stays under CI's 20 minutes)
def test_a_budget_that_runs_out_stops_with_that_reason(tiny_shards, tmp_path):
    out = tmp_path / "tune"
    result = tune(*SMALL_SPACE, "--data", str(tiny_shards), "--out", str(out), "--budget-s", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    state = tune_state(out)
    assert [launch["point_id"] for launch in state["launches"]] == ["t5-tiny-z2-none-mb8-w0-n1-s5"]
    assert state["stops"][-1].startswith("budget spent") and "budget spent" in (out / "tune.md").read_text()


def test_user_mistakes_are_one_line(tiny_shards, tmp_path):
    bad_set = tune("--model", "t5-tiny", "--nproc", "1", "--global-batch", "8", "--data", str(tiny_shards),
                   "--out", str(tmp_path / "a"), "--set", "stage=1", "--dry-run")
    assert bad_set.returncode == 2 and "--set stage=1: no such setting 'stage'" in bad_set.stderr
    assert "Traceback" not in bad_set.stderr
    no_batch = tune("--model", "t5-tiny", "--nproc", "1", "--data", str(tiny_shards), "--out", str(tmp_path / "b"))
    assert no_batch.returncode == 2 and "--global-batch is required" in no_batch.stderr
    # a second tune on a directory another one is using (held here, as a running tune holds it) is refused
    from pretrain.runlock import TUNE_LOCK_NAME, acquire_run_lock
    held = acquire_run_lock(tmp_path / "busy", name=TUNE_LOCK_NAME)
    busy = tune("--model", "t5-tiny", "--nproc", "1", "--global-batch", "8", "--data", str(tiny_shards),
                "--out", str(tmp_path / "busy"), "--dry-run")
    held.release()
    assert busy.returncode == 2 and "another study tune is using this tune directory" in busy.stderr, busy.stderr
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == [TUNE_LOCK_NAME]     # nothing written


@pytest.mark.parametrize("flag, says", [
    (["--budget-s", "0"], "--budget-s must be > 0 seconds"),
    (["--keep", "0"], "--keep is the share of a rung kept for the next, in (0, 1]"),
    (["--keep", "3"], "--keep is the share of a rung kept for the next, in (0, 1]"),
    (["--min-measured", "0"], "--min-measured must be >= 1"),
    (["--model-margin", "-0.1"], "--model-margin is a relative error, >= 0"),
    (["--sibling-margin", "-0.1"], "--sibling-margin is a relative error, >= 0"),
    (["--device-memory-gib", "0"], "--device-memory-gib must be > 0"),
    (["--rung-steps", "12,6"], "--rung-steps must grow from rung to rung"),
    (["--rung-steps", "6,6"], "--rung-steps must grow from rung to rung"),
    (["--best-steps", "0"], "--best-steps must be >= 1"),
    (["--skip-steps", "-1"], "--skip-steps must be >= 0"),
    (["--skip-steps", "6"], "--skip-steps 6 leaves no measured step"),
])
def test_a_numeric_option_out_of_range_is_refused_up_front(tmp_path, flag, says):
    result = tune("--model", "t5-tiny", "--nproc", "1", "--global-batch", "8", "--data", "shards", "--dry-run",
                  "--out", str(tmp_path / "tune"), *flag)
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "tune").exists()


@pytest.mark.slow   # a benchmark tool's bookkeeping: ./scripts/test.sh -m slow
def test_compare_grid_judges_the_best_found_against_a_full_grid_of_the_same_space(tiny_shards, tmp_path):
    """A study grid file is a tune space as is; --compare-grid reads the grid's measurements and says how far the
    tune's best is from the grid's best (by the grid's own figure for it) and what share of the grid's time the
    tune took."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "cmp", "base": {"steps": 5, "skip_steps": 2, "global_batch": 32},
                                    "grid": {"model": "t5-tiny", "nproc": 1, "zero": [0, 2], "offload": "none",
                                             "micro_batch": 8, "loader_workers": 0,
                                             "activation_checkpointing": False}}))
    study = tmp_path / "study"
    ran = subprocess.run([sys.executable, "-m", "pretrain.study.cli", "run", str(grid), "--data", str(tiny_shards),
                          "--out", str(study)], capture_output=True, text=True, timeout=300, env=env(), cwd=REPO_ROOT)
    assert ran.returncode == 0, ran.stdout + ran.stderr

    missing = tune("--space", str(grid), "--data", str(tiny_shards), "--out", str(tmp_path / "none"),
                   "--compare-grid", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "--compare-grid" in missing.stderr and "Traceback" not in missing.stderr
    assert not (tmp_path / "none").exists()

    out = tmp_path / "tune"
    result = tune("--space", str(grid), "--data", str(tiny_shards), "--out", str(out), "--rung-steps", "5",
                  "--skip-steps", "2", "--min-measured", "1", "--compare-grid", str(study))
    assert result.returncode == 0, result.stdout + result.stderr
    state = tune_state(out)
    against = state["against_grid"]
    assert (against["grid_points"], against["grid_ok"]) == (2, 2)
    assert against["grid_points_not_in_tune"] == [] and against["tune_candidates_not_in_grid"] == []
    records = [json.loads(p.read_text()) for p in (study / "runs").glob("*/study_point.json")]
    assert against["grid_device_s"] == pytest.approx(sum(r["wall_s"] for r in records), abs=0.2)
    assert against["tune_device_s"] == pytest.approx(state["spent_s"], abs=0.2)
    assert against["time_share"] == pytest.approx(against["tune_device_s"] / against["grid_device_s"], rel=0.01)
    grid_points = {p.name for p in (study / "runs").iterdir()}
    best = against["grid_best"]
    chosen = against["tune_best"]
    assert best["point_id"] in grid_points and chosen["in_grid"] in grid_points
    assert chosen["point_id"].startswith(chosen["in_grid"])           # the same settings, a rung suffix
    assert against["gap"] == pytest.approx(1 - chosen["tokens_per_s_grid"] / best["tokens_per_s"], abs=1e-4)
    assert against["goal_met"] == (against["gap"] <= 0.03 and against["time_share"] <= 0.25)
    assert "## Against the full grid" in (out / "tune.md").read_text()
    assert "against the grid" in result.stdout and ("goal met" in result.stdout or "goal not met" in result.stdout)


def test_write_grid_never_replaces_a_file_the_tune_did_not_write(tiny_shards, tmp_path, tmpfs):
    """--write-grid FILE: a user's file, a directory and the --space file are refused in one line before anything
    is written; a grid an earlier tune wrote is written again (a rerun of the same command), and a read-only
    place is one line too."""
    space = ["--model", "t5-tiny", "--nproc", "1", "--global-batch", "8", "--data", str(tiny_shards),
             "--set", "zero=2", "--set", "offload=none", "--set", "loader_workers=0",
             "--set", "activation_checkpointing=false", "--dry-run"]
    mine = tmp_path / "notes.yaml"
    mine.write_text("my notes\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    for target, says in ((mine, "which `study tune` did not write"), (folder, "--write-grid is a directory")):
        refused = tune(*space, "--out", str(tmp_path / "refused"), "--write-grid", str(target))
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert mine.read_text() == "my notes\n" and list(folder.iterdir()) == []
    assert not (tmp_path / "refused").exists()

    full = tmp_path / "full.yaml"
    for _ in range(2):          # the second run replaces the grid the first wrote
        written = tune(*space, "--out", str(tmp_path / "tune"), "--write-grid", str(full))
        assert written.returncode == 0, written.stderr
    assert len(load_grid(full).points()) == 4           # micro batch 1, 2, 4, 8 (the default among them)
    as_space = tune("--space", str(full), "--data", str(tiny_shards), "--dry-run", "--out", str(tmp_path / "again"),
                    "--write-grid", str(full))
    assert as_space.returncode == 2 and "names the --space file" in as_space.stderr

    read_only = tmpfs.read_only(tmpfs("ro"))
    denied = tune(*space, "--out", str(tmp_path / "ro-tune"), "--write-grid", str(read_only / "full.yaml"))
    assert denied.returncode == 2 and "Read-only file system" in denied.stderr and "--write-grid" in denied.stderr
    assert denied.stderr.count("\n") == 1 and "Traceback" not in denied.stderr


def test_a_space_or_flag_that_cannot_be_read_is_one_line(tmp_path):
    """Not UTF-8, not YAML, a rank count of 0 or a word: one line naming the file or flag, nothing written."""
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    broken = tmp_path / "broken.yaml"
    broken.write_text("base: {steps: [\n")
    words = tmp_path / "words.yaml"
    words.write_text("base: {nproc: two}\n")
    flags = ["--model", "t5-tiny", "--global-batch", "8", "--data", "shards", "--dry-run"]
    for args, says in (([*flags, "--space", str(binary)], f"{binary}: not UTF-8 text"),
                       ([*flags, "--space", str(broken)], f"{broken}: not valid YAML"),
                       ([*flags, "--space", str(words)], f"{words}: base.nproc must be a whole number >= 1"),
                       ([*flags, "--nproc", "0"], "--nproc must be a whole number >= 1, got 0")):
        result = tune(*args, "--out", str(tmp_path / "tune"))
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "tune").exists()


def test_a_tune_of_another_space_is_refused_before_it_writes_anything(tiny_shards, tmp_path):
    """The directory's space.yaml stays the one its tune.json was made with, and --write-grid writes nothing."""
    space = ["--model", "t5-tiny", "--nproc", "1", "--global-batch", "8", "--data", str(tiny_shards),
             "--set", "offload=none", "--set", "loader_workers=0", "--set", "activation_checkpointing=false",
             "--dry-run", "--out", str(tmp_path / "tune")]
    first = tune(*space, "--set", "zero=2")
    assert first.returncode == 0, first.stderr
    kept = (tmp_path / "tune" / "space.yaml").read_bytes()
    other = tune(*space, "--set", "zero=0", "--write-grid", str(tmp_path / "full.yaml"))
    assert other.returncode == 2 and "holds a tune of another space" in other.stderr, other.stderr
    assert (tmp_path / "tune" / "space.yaml").read_bytes() == kept and not (tmp_path / "full.yaml").exists()
    (tmp_path / "tune" / "tune.json").write_text("{not json")
    broken = tune(*space, "--set", "zero=2")
    assert broken.returncode == 2 and "tune.json: cannot be read as a tune's state" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_cuda_graphs_are_searched_only_where_pretrain_takes_them(tiny_shards, tmp_path):
    """--set cudagraphs=false,true: graphed points only where the blocks are compiled, ZeRO 0-2, without activation
    checkpointing (exclude rules in space.yaml, which the study's grid code validates point by point); asked for
    where no point can take it, one line. On a GPU machine the default space holds the axis once compile is on."""
    space = ["--model", "t5-tiny", "--nproc", "1", "--global-batch", "16", "--data", str(tiny_shards),
             "--set", "zero=2,3", "--set", "offload=none", "--set", "loader_workers=0", "--set", "micro_batch=4,16",
             "--set", "cudagraphs=false,true", "--dry-run"]
    result = tune(*space, "--set", "compile=true", "--out", str(tmp_path / "tune"),
                  "--write-grid", str(tmp_path / "full.yaml"))
    assert result.returncode == 0, result.stderr
    ids = [c["point_id"] for c in tune_state(tmp_path / "tune")["candidates"]]
    graphed = [i for i in ids if "cudagraphs1" in i]
    assert sorted(graphed) == ["t5-tiny-z2-none-mb16-w0-n1-cudagraphs1", "t5-tiny-z2-none-mb4-w0-n1-cudagraphs1"]
    assert len(ids) == 2 * 2 * 2 + 2 + 1                # zero x micro x ckpt without graphs, 2 graphed, the default
    assert len(load_grid(tmp_path / "full.yaml").points()) == len(ids)

    refused = tune(*space, "--out", str(tmp_path / "refused"))        # compile left off: no graph can be made
    assert refused.returncode == 2 and "cudagraphs (--set or the space file): no point of this space" in refused.stderr
    assert "compile=False everywhere" in refused.stderr and "add --set compile=true" in refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert not (tmp_path / "refused").exists()

    def axes(*sets: str) -> tuple[dict, list]:
        options = TuneOptions(out=tmp_path / "x", data="shards", model="t5-tiny", nproc=1, global_batch=16,
                              sets=["zero=2,3", *sets])
        grid = space_grid(options, cores=8, steps=6, gpus=True)
        return {**{k: [v] for k, v in grid["base"].items()}, **grid["grid"]}, grid["exclude"]

    on, rules = axes("compile=true")                                 # a GPU machine, compiled: searched
    assert on["cudagraphs"] == [False, True] and {"zero": 3, "cudagraphs": True} in rules
    assert axes()[0]["cudagraphs"] == [False]                         # not compiled: left off, no error
    assert axes("compile=true", "precision=fp8")[0]["cudagraphs"] == [False, True]    # FP8 too (its parity holds)
    assert {"offload": ["cpu"], "cudagraphs": True} in rules                # the default space's offload points
    assert axes("compile=true", "offload=cpu")[0].get("cudagraphs", [False]) == [False]
    # pretrain's default point is measured as pretrain resolves it there: auto, i.e. graphs for a compiled ZeRO 2
    options = TuneOptions(out=tmp_path / "x", data="shards", model="t5-tiny", nproc=1, global_batch=16,
                          sets=["zero=2,3", "compile=true"])
    assert space_grid(options, cores=8, steps=6, gpus=True)["include"][0]["cudagraphs"] is True
    options.sets = ["zero=2,3", "compile=false,true"]
    assert space_grid(options, cores=8, steps=6, gpus=True)["include"][0]["cudagraphs"] is False


def test_each_candidate_resolves_auto_graphs_against_its_memory_estimate():
    """On a GPU a candidate left at auto gets graphs where its estimate leaves a quarter of the GPU free, as pretrain
    would run it; the default point (auto resolved without the estimate by space_grid) marks the graph-free candidate
    where its estimate is above that share, and explicit values stay as they are."""
    from pretrain.config import TrainConfig
    from pretrain.study.tune import resolve_graphs

    def config(micro: int, graphs: bool | None) -> TrainConfig:
        return TrainConfig(model="t5-tiny", data="-", out="-", zero=2, compile=True, micro_batch=micro,
                           cudagraphs=graphs)

    gpu, cpu = {"kind": "cuda", "per_device_gib": 100.0}, {"kind": "cpu", "per_device_gib": 20.0}
    points = [config(8, None), config(8, True), config(32, None), config(32, False), config(32, True)]
    figures = [40.0, 40.0, 90.0, 90.0, 90.0]          # GiB: micro 32 fills 90% of the GPU
    configs, default = resolve_graphs(points, figures, gpu, {"micro_batch": 32, "cudagraphs": True})
    assert [c.cudagraphs for c in configs] == [True, True, False, False, True]
    assert default == {"micro_batch": 32, "cudagraphs": False}
    configs, default = resolve_graphs(points, figures, gpu, {"micro_batch": 8, "cudagraphs": True})
    assert default == {"micro_batch": 8, "cudagraphs": True}
    configs, default = resolve_graphs(points, figures, cpu, {"micro_batch": 32, "cudagraphs": False})
    assert [c.cudagraphs for c in configs] == [False, True, False, False, True] and default["cudagraphs"] is False


@pytest.mark.slow   # two compiled launches (~65 s here); the ratio's arithmetic is in test_tune_model.py
def test_a_tune_measures_a_graphed_twin_and_carries_its_ratio(tiny_shards, tmp_path):
    """Real compiled launches on CPU (where --cudagraphs runs the same code without graphs): the default and its
    graphed twin are measured, the model records their ratio, tune.md and tune.json say so."""
    out = tmp_path / "tune"
    result = tune("--model", "t5-tiny", "--nproc", "1", "--global-batch", "8", "--data", str(tiny_shards),
                  "--set", "zero=2", "--set", "offload=none", "--set", "loader_workers=0", "--set", "micro_batch=8",
                  "--set", "activation_checkpointing=false", "--set", "compile=true", "--set", "cudagraphs=false,true",
                  "--rung-steps", "4", "--skip-steps", "2", "--min-measured", "2", "--best-steps", "2",
                  "--out", str(out), timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    state = tune_state(out)
    assert [launch["status"] for launch in state["launches"]] == ["ok", "ok"]
    assert [launch["point_id"] for launch in state["launches"]] == ["t5-tiny-z2-none-mb8-w0-n1-cudagraphs0-s4",
                                                                   "t5-tiny-z2-none-mb8-w0-n1-cudagraphs1-s4"]
    assert 0.5 < state["model"]["graph_ratio"] < 2.0                # the same code on CPU: about 1
    assert {setting for _, setting, *_ in state["calibration"]} == {"none", "none+cudagraphs"}
    assert "graphed / graph-free ratio of measured pairs" in (out / "tune.md").read_text()


def test_a_grid_that_did_not_vary_an_axis_of_the_tune_counts_at_pretrains_default():
    """The one-H200 grids have no cudagraphs column; a tune of their space on a GPU adds the axis: its graphed
    candidates are not in the grid, and a graphed best is not judged by the graph-free point's figure."""
    from types import SimpleNamespace

    from pretrain.config import TrainConfig
    from pretrain.study.tune import Candidate
    from pretrain.study.tune_compare import compare_with_grid

    def candidate(zero, graphs, tokens):
        config = TrainConfig(model="t5-tiny", data="-", out=f"runs/z{zero}-cg{int(graphs)}", zero=zero,
                             compile=True, cudagraphs=graphs)
        row = {"status": "ok", "tokens_per_s": tokens}
        return Candidate(config=config, point_id=f"z{zero}-cg{int(graphs)}", default=False, results={0: row})

    candidates = [candidate(0, False, 100.0), candidate(2, False, 90.0), candidate(2, True, 130.0)]
    tune = SimpleNamespace(grid=SimpleNamespace(axes={"zero": [0, 2], "cudagraphs": [False, True]}), spent_s=10.0,
                           candidates=candidates, best=lambda: candidates[2])
    rows = [{"point_id": f"grid-z{zero}", "status": "ok", "tokens_per_s": tokens, "wall_s": 50.0, "zero": zero,
             "offload": "none", "micro_batch": 8, "loader_workers": 0, "nproc": 1, "model": "t5-tiny",
             "activation_checkpointing": False} for zero, tokens in ((0, 101.0), (2, 91.0))]
    # the rows as a grid's run directories give them (no cudagraphs key) and as an older results.csv reads back
    # (the column is there, empty: None)
    for grid in (rows, [dict(row, cudagraphs=None) for row in rows]):
        against = compare_with_grid(tune, Path("grid"), grid)
        assert "cudagraphs" in against["axes"] and against["tune_candidates_not_in_grid"] == ["z2-cg1"]
        assert against["grid_points_not_in_tune"] == []
        assert against["tune_best"]["in_grid"] is None and against["gap"] is None and not against["goal_met"]
