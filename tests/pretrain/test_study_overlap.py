"""`overlap_startup`: the next point's host-side start-up runs while the current point trains, and its ranks
wait at the start gate until the current point has ended, so measured steps never overlap.

    .venv/bin/python -m pytest tests/pretrain/test_study_overlap.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import yaml

from pretrain import ranks


def test_the_gate_blocks_until_its_file_exists(tmp_path, monkeypatch):
    monkeypatch.delenv(ranks.START_GATE_ENV, raising=False)
    assert ranks.wait_for_start_gate() is None                 # no gate: no wait
    gate = tmp_path / "point.gate"
    monkeypatch.setenv(ranks.START_GATE_ENV, str(gate))
    opener = threading.Timer(0.3, gate.touch)
    opener.start()
    waited = ranks.wait_for_start_gate(poll_s=0.01)
    opener.join()
    assert gate.exists() and waited >= 0.25


def test_a_start_up_ahead_of_its_gate_builds_on_a_share_of_the_cores(tmp_path, monkeypatch):
    """The model build of a point started ahead runs beside another point's measured steps: it takes at most a
    quarter of the cores (per local rank) and gives them back before training."""
    import torch
    before = torch.get_num_threads()
    monkeypatch.delenv(ranks.START_GATE_ENV, raising=False)
    with ranks.startup_threads(1, torch.get_num_threads, torch.set_num_threads) as threads:
        assert threads is None and torch.get_num_threads() == before       # not started ahead: untouched
    gate = tmp_path / "point.gate"
    monkeypatch.setenv(ranks.START_GATE_ENV, str(gate))
    share = max(1, len(os.sched_getaffinity(0)) // ranks.STARTUP_SHARE)
    with ranks.startup_threads(1, torch.get_num_threads, torch.set_num_threads) as threads:
        assert threads == min(before, share) == torch.get_num_threads()
    assert torch.get_num_threads() == before                               # restored for training
    gate.touch()                                                           # the gate already open: untouched
    with ranks.startup_threads(1, torch.get_num_threads, torch.set_num_threads) as threads:
        assert threads is None


@pytest.mark.slow   # ./scripts/test.sh -m slow (the default suite stays under CI's 20 minutes)
def test_points_start_up_ahead_but_never_train_together(tiny_shards, tmp_path):
    grid = {"name": "overlap", "base": {"steps": 3, "skip_steps": 1, "global_batch": 4, "timeout_s": 240,
                                        "overlap_startup": True},
            # ZeRO 3 waits at the gate before its (partitioned) build, the other stages after the host build
            "grid": {"model": "t5-tiny", "zero": [1, 2, 3], "micro_batch": 2, "nproc": 2}}
    grid_path = tmp_path / "g.yaml"
    grid_path.write_text(yaml.safe_dump(grid))
    out = tmp_path / "study"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, "-m", "pretrain.study.cli", "run", str(grid_path), "--out", str(out),
                             "--data", str(tiny_shards)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 ok" in result.stdout

    ids = ["t5-tiny-z1-none-mb2-w0-n2", "t5-tiny-z2-none-mb2-w0-n2", "t5-tiny-z3-none-mb2-w0-n2"]
    records = [json.loads((out / "runs" / i / "study_point.json").read_text()) for i in ids]
    summaries = [json.loads((out / "runs" / i / "summary.json").read_text()) for i in ids]
    assert [r["status"] for r in records] == ["ok"] * 3
    inits = [json.loads((out / "runs" / i / "config.json").read_text())["model_init"] for i in ids]
    assert inits[0]["startup_threads"] is None                   # the first point: not started ahead
    # ZeRO 2, launched with the first point, built while that one still had its engine and steps ahead of it: on a
    # share of the cores; ZeRO 3 builds after its gate, with every core
    assert inits[1]["startup_threads"] >= 1 and inits[2]["startup_threads"] is None
    for init, summary in zip(inits, summaries):                  # waited at the gate after the build: built ahead
        marks = summary["timeline_s"]
        if summary["zero_stage"] < 3 and marks.get("start_gate", 0) - marks["model_built"] > 0.2:
            assert init["startup_threads"] is not None
    assert records[0]["startup_ahead_s"] < 0.5                   # the first point had nothing to run beside
    assert "start_gate" not in summaries[0]["timeline_s"]
    for before, record, summary in zip(summaries, records[1:], summaries[1:]):
        assert record["startup_ahead_s"] > 0.5
        marks = summary["timeline_s"]
        gate_opened = summary["launch_t0"] + marks["start_gate"]
        previous_trained = before["launch_t0"] + before["timeline_s"]["trained"]
        assert summary["launch_t0"] < previous_trained           # launched while the previous point trained
        assert gate_opened > previous_trained                    # and went on only once it had finished
        if summary["zero_stage"] < 3:
            assert marks["model_built"] <= marks["start_gate"] < marks["engine"]
        else:
            assert marks["start_gate"] <= marks["model_built"]
    assert not list((out / "logs").glob("*.gate"))               # no gate file is left behind
