"""scripts/bench_parity.py's bookkeeping (issue 15): a `--jobs` pool keeps each finished run with its settings, a rerun
reads them, and `--report` writes the table again from them without running anything (how a GPU benchmark's
archive is read back on a machine without the GPU). Real runs: t5-tiny, eager, 4 steps on the tiny shard set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_parity.py"


def bench(shards: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--data", str(shards), "--model", "t5-tiny", "--batch", "4",
               "--steps", "4", "--window", "2", "--seeds", "0", "--variants", "ours", "hf", "--device", "cpu",
               "--jobs", "2", "--out", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.slow   # ./scripts/test.sh -m slow (the default suite stays under CI's 20 minutes)
def test_runs_are_kept_reused_and_reported(tiny_shards, tmp_path):
    out = tmp_path / "parity"
    first = bench(tiny_shards, out)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    table = (out / "parity.md").read_text()
    assert "| loss, mean of steps | ours | hf |" in table and "| 2-3 |" in table
    assert (out / "parity.png").stat().st_size > 0
    kept = json.loads((out / "runs" / "ours-seed0.json").read_text())
    assert len(kept["losses"]) == 4 and kept["settings"]["variant"] == "ours"

    again = bench(tiny_shards, out)                 # the same flags: both runs read, none run again
    assert again.returncode == 0
    assert again.stdout.count("finished earlier") == 2
    assert (out / "parity.md").read_text() == table

    (out / "parity.md").unlink()
    report = bench(tiny_shards, out, "--report")
    assert report.returncode == 0 and (out / "parity.md").read_text() == table

    other = bench(tiny_shards, out, "--report", "--lr", "1e-3")   # runs made with other settings are not reused
    assert other.returncode != 0
    assert "ours-seed0.json is missing or was made with other settings" in other.stderr
    assert "Traceback" not in other.stderr


@pytest.mark.slow   # a benchmark tool's bookkeeping: ./scripts/test.sh -m slow
def test_pretrain_mode_replaces_an_unfinished_run_and_turns_the_spike_guard_off(tiny_shards, tmp_path):
    """--pretrain runs `pretrain` itself: what an earlier, cut attempt left in the run's directory is removed (pretrain
    refuses a used --out, which once stopped the GPU benchmark's retry), and every run has the spike guard off, so
    that a spike skipped in one variant only does not move its curve."""
    out = tmp_path / "parity"
    stale = out / "runs" / "pretrain-seed0"
    stale.mkdir(parents=True)
    (stale / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    command = [sys.executable, str(SCRIPT), "--pretrain", "--data", str(tiny_shards), "--model", "t5-tiny",
               "--batch", "4", "--steps", "3", "--window", "3", "--seeds", "0", "--variants", "pretrain",
               "--device", "cpu", "--jobs", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in (stale / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert json.loads((stale / "config.json").read_text())["train"]["spike_sigmas"] == 0
    assert json.loads((out / "runs" / "pretrain-seed0.json").read_text())["settings"]["spike_sigmas"] == 0


def test_repeats_measure_the_same_code_spread(tiny_shards, tmp_path):
    """--repeats 2: each variant runs twice per seed (its own process under --jobs, its own result file), the second
    as a column of its own, and the table gives the spread between the two. Eager on the CPU is deterministic, so
    the two runs of `ours` agree exactly and the spread is 0."""
    out = tmp_path / "parity"
    command = [sys.executable, str(SCRIPT), "--data", str(tiny_shards), "--model", "t5-tiny", "--batch", "4",
               "--steps", "4", "--window", "2", "--seeds", "0", "--variants", "ours", "--repeats", "2",
               "--device", "cpu", "--jobs", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "| loss, mean of steps | ours | ours#2 |" in (out / "parity.md").read_text()
    summary = json.loads((out / "parity.json").read_text())["summary"]
    assert summary["same_code_spread"] == {"ours": 0.0}
    assert summary["windows_outside_same_code_spread"] == {"ours#2": 0}
    first, second = (json.loads((out / "runs" / f"{name}-seed0.json").read_text()) for name in ("ours", "ours-run2"))
    assert first["losses"] == second["losses"] and second["settings"]["variant"] == "ours#2"


def test_a_pretrain_variant_is_a_flag_per_part_of_its_name():
    """--pretrain's variant names become pretrain's flags, as pretrain itself reads them: fp8's --precision wins over
    the shared one."""
    import importlib.util
    from pretrain.cli import resolve_config
    spec = importlib.util.spec_from_file_location("bench_parity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.argparse.Namespace(model="t5-tiny", data="SHARDS", steps=3, batch=4, lr=5e-4, warmup=1, clip=1.0,
                                     precision="bf16", window=1)
    for variant, precision, compiled, graphs, step in (
            ("pretrain", "bf16", False, False, "auto"),
            ("pretrain-compile-fp8-cudagraphs#2", "fp8", True, True, "auto"),
            ("pretrain-compile-fused", "bf16", True, False, "fused")):
        command = module.pretrain_command(variant, 0, Path("RUN"), args)
        config = resolve_config(command[3:])             # after python -m pretrain.cli
        assert (config.precision, config.compile, config.cudagraphs, config.optimizer_step) == (
            precision, compiled, graphs, step), variant
