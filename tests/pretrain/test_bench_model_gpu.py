"""scripts/bench_model_gpu.py's batch search (issue 19): each timed step on its own (the table's min-max), a
larger batch whose peak memory, extrapolated from the batches that fit, exceeds the device's recorded as not fitting
without being run (on the GPU an HF whole-model compile takes ~150 s before it would run out of memory), and an
interrupted run that still writes its tables. Real runs: t5-tiny, eager, on the CPU."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_model_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_model_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_memory_is_extrapolated_from_the_batches_that_fit():
    predict = load_script().predicted_peak_gib
    assert predict([], 96) is None
    assert predict([{"batch": 64, "peak_mem_gib": 82.4}], 96) == pytest.approx(123.6)    # proportional: an upper bound
    # the line through the two largest (the H200's mt5-large flex figures: 66.9 GiB at 96, 84.3 at 128; 119.4 at 192)
    fits = [{"batch": 64, "peak_mem_gib": 48.8}, {"batch": 96, "peak_mem_gib": 66.9},
            {"batch": 128, "peak_mem_gib": 84.3}]
    assert predict(fits, 192) == pytest.approx(119.1, abs=0.1)


def test_cpu_smoke_run_reports_each_batch_with_its_spread(tmp_path):
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "t5-tiny", "--variants", "ours",
               "--batch", "2", "--batches", "4", "--steps", "3", "--warmup", "1", "--input-length", "32",
               "--target-length", "8", "--matmul-size", "256", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    for row in rows:
        assert row["ms_min"] <= row["ms_per_step"] <= row["ms_max"]
    table = (tmp_path / "results.md").read_text()
    assert "At each variant's fastest fitting batch" in table and "ms/step (min-max)" in table


@pytest.mark.slow   # a benchmark tool's bookkeeping: ./scripts/test.sh -m slow
def test_an_interrupted_run_still_writes_the_tables_of_what_it_measured(tmp_path):
    """SIGINT after the first measurement (a device call's time limit): exit 130, the tables of the rows finished."""
    # batch 64 takes ~30x batch 2's time per step: 200 of them cannot finish before the signal, on any machine
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "t5-tiny", "--variants", "ours",
               "--batch", "2", "--batches", "64", "--steps", "200", "--warmup", "1", "--input-length", "32",
               "--target-length", "8", "--matmul-size", "256", "--out", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in iter(process.stdout.readline, ""):   # the first row is printed as JSON once measured; 64 then runs
        seen.append(line)
        if line.startswith('{"variant": "ours", "batch": 2'):
            time.sleep(1.0)
            process.send_signal(signal.SIGINT)
            break
    output = "".join(seen) + process.stdout.read()
    assert process.wait(timeout=120) == 130, output[-2000:]
    assert "interrupted: the tables below hold the 1 measurement(s) finished" in output
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["interrupted"] and [(r["variant"], r["batch"]) for r in result["rows"]] == [("ours", 2)]
    assert "INTERRUPTED" in (tmp_path / "results.md").read_text()


def test_a_round_line_names_a_slow_step_and_the_allocator_retries_only_when_there_are_some():
    detail = load_script().round_detail
    assert detail([0.200, 0.201, 0.202], 0) == ""
    assert detail([0.200, 0.201, 0.260], 0) == " (slowest 260.0)"
    assert detail([0.200, 0.201, 0.202], 3) == " (3 allocator retries)"
    assert detail([0.200, 0.201, 0.260], 1) == " (slowest 260.0, 1 allocator retry)"


def test_rounds_time_the_variants_in_turn_and_report_the_spread_over_rounds(tmp_path):
    """--rounds: each variant built once, timed once per round in turn; ms/step is the median of its round medians."""
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "t5-tiny", "--variants", "ours", "hf",
               "--batch", "2", "--steps", "2", "--warmup", "1", "--rounds", "3", "--input-length", "32",
               "--target-length", "8", "--matmul-size", "256", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("round ")] == \
        ["round 1/3", "round 2/3", "round 3/3"]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("ours", 2), ("hf", 2)]
    for row in rows:
        rounds = row["rounds_ms"]
        assert len(rounds) == 3
        assert row["ms_min"] == pytest.approx(min(rounds), abs=0.01)
        assert row["ms_max"] == pytest.approx(max(rounds), abs=0.01)
        assert row["ms_per_step"] == pytest.approx(sorted(rounds)[1], abs=0.01)
        assert row["rounds_alloc_retries"] == [0, 0, 0]   # the CPU has no caching allocator
    assert rows[1]["speedup_vs_hf"] == pytest.approx(1.0)
    assert "3 rounds of 2 timed steps" in (tmp_path / "results.md").read_text()
