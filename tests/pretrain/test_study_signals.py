"""`study run` stopped by kill -9 or SIGTERM leaves no launch of its point behind (a rerun waits for a point
directory an earlier launch still holds: `pretrain.runlock.wait_until_unlocked`, tested in test_run_lock.py), and a point whose rank died by a signal is recorded with that
signal as its reason (real `pretrain` launches, CPU, gloo, 2 ranks).

    .venv/bin/python -m pytest tests/pretrain/test_study_signals.py -q
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from launching import child_env, no_process_left
from pipeline.common import REPO_ROOT
from pretrain.metrics import read_metrics
from pretrain.study.runner import classify


def start_study(grid: Path, out: Path, shards: Path, log: Path) -> subprocess.Popen:
    env = child_env()
    with open(log, "w") as console:
        return subprocess.Popen([sys.executable, "-m", "pretrain.study.cli", "run", str(grid), "--out", str(out),
                                 "--data", str(shards)], stdout=console, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT)


def wait_for_first_step(run_dir: Path, study: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not read_metrics(run_dir / "metrics.jsonl"):
        assert study.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


@pytest.mark.slow   # ./scripts/test.sh -m slow (the default suite stays under CI's 20 minutes)
def test_killing_the_study_kills_its_point_and_sigterm_stops_a_rerun(tiny_shards, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "sig", "base": {"steps": 2000, "global_batch": 8, "timeout_s": 600},
                                    "grid": {"model": "t5-tiny", "zero": 2, "micro_batch": 2, "nproc": 2}}))
    out = tmp_path / "study"
    run_dir = out / "runs" / "t5-tiny-z2-none-mb2-w0-n2"
    first = start_study(grid, out, tiny_shards, tmp_path / "first.log")
    wait_for_first_step(run_dir, first, tmp_path / "first.log")
    launches = psutil.Process(first.pid).children(recursive=True)      # the point's launcher and its 2 ranks
    assert len(launches) >= 3, launches
    first.send_signal(signal.SIGKILL)
    first.wait()

    # the killed study's point dies with it: its launcher gets SIGTERM, its ranks save and exit
    deadline = time.monotonic() + 60
    while [p for p in launches if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in launches if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], launches

    second = start_study(grid, out, tiny_shards, tmp_path / "second.log")
    deadline = time.monotonic() + 180
    while not [p for p in psutil.Process(second.pid).children(recursive=True) if "pretrain.cli" in " ".join(p.cmdline())]:
        assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "second.log").read_text()
        time.sleep(0.2)
    time.sleep(3)
    second.send_signal(signal.SIGTERM)                  # stops the point (its ranks save and exit), then the study
    assert second.wait(timeout=90) != 0
    no_process_left(out, within_s=30)


def test_a_point_whose_rank_died_by_a_signal_records_the_signal(tmp_path):
    err = tmp_path / "p.err"
    err.write_text("/x/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: ...\n"
                   "  return func(*args, **kwargs)\n"
                   "pretrain: error: rank 1 killed by SIGKILL (full log: runs/p/logs/rank-1.log)\n")
    assert classify(2, False, err, tmp_path, 60) == ("failed", "rank 1 killed by SIGKILL (full log: "
                                                               "runs/p/logs/rank-1.log)")
    err.write_text("  return func(*args, **kwargs)\n")
    assert classify(-9, False, err, tmp_path, 60) == ("failed", "pretrain killed by SIGKILL")
