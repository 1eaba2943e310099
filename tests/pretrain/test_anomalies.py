"""Bad steps on CPU (gloo, 2 ranks, t5-tiny, the `tiny_shards` set): a NaN loss forced on a global batch and a
planted loss spike are skipped alike at ZeRO 0, 2 and 3 (each stage skips through another DeepSpeed path); a
streak of skips rolls back to the last checkpoint and skips every global batch since it.

    .venv/bin/python -m pytest tests/pretrain/test_anomalies.py -q

4 launches of 6 steps (~2-3 min on 2 cores).
"""

from __future__ import annotations

import json
import math

import pytest

from launching import COMMON, ok, pretrain
from pretrain.checkpoint import complete_tags, tag_for
from pretrain.metrics import read_metrics

# batch 3 NaN; batch 5 x1000 (a loss spike: the window of 3 accepted steps 1, 2, 4 is full by then)
BAD = ["--debug-nan-batches", "3", "--debug-spike-batches", "5", "--spike-window", "3", "--spike-sigmas", "20",
       "--rollback-after", "0"]


@pytest.fixture(scope="module")
def skipped(tiny_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("anomalies")
    for stage in (0, 2, 3):
        ok(pretrain(*COMMON, "--data", str(tiny_shards), "--out", str(root / f"z{stage}"), "--zero", str(stage),
                    "--nproc", "2", *BAD))
    return root


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nan_and_spike_are_skipped_and_listed(skipped, stage):
    records = read_metrics(skipped / f"z{stage}" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["skipped"] for r in records] == [None, None, "nonfinite_loss", None, "loss_spike", None]
    assert [r["global_batch"] for r in records] == list(range(1, 7))
    assert records[2]["loss"] is None and records[4]["loss"] > 1000
    assert all(math.isfinite(r["loss"]) for r in records if not r["skipped"])
    summary = json.loads((skipped / f"z{stage}" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["anomalies"]["skipped_steps"] == 2
    assert summary["anomalies"]["skipped_batches"] == [3, 5]
    assert [s["reason"] for s in summary["anomalies"]["skipped"]] == ["nonfinite_loss", "loss_spike"]


def test_a_skipped_update_changes_nothing_at_any_stage(skipped):
    """The same skips at ZeRO 0, 2 and 3 give the same losses after them (a NaN or x1000 update applied at any
    stage would show), and the lr follows the step number through the skips."""
    runs = {stage: read_metrics(skipped / f"z{stage}" / "metrics.jsonl") for stage in (0, 2, 3)}
    for stage in (2, 3):
        for mine, theirs in zip(runs[stage], runs[0]):
            assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-12)
            if not mine["skipped"]:
                assert mine["loss"] == pytest.approx(theirs["loss"], rel=2e-5, abs=2e-5), (stage, mine["step"])
    # the step after a skipped one starts from the weights before it: its loss is still near the step before's
    losses = [r["loss"] for r in runs[0]]
    assert abs(losses[3] - losses[1]) < 1.0 and abs(losses[5] - losses[3]) < 1.0


def test_a_streak_of_skips_rolls_back_and_skips_the_batches_since_the_checkpoint(tiny_shards, tmp_path):
    out = tmp_path / "rollback"
    result = ok(pretrain(*COMMON, "--data", str(tiny_shards), "--out", str(out), "--zero", "2", "--nproc", "2",
                         "--save-every", "2", "--debug-nan-batches", "4", "5", "--rollback-after", "2"))
    assert "[rollback] steps 4-5 skipped in a row (nonfinite_loss): reloaded step-00000002, skipping global " \
           "batches 3-5" in result.stdout, result.stdout[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["global_batch"] for r in records] == [1, 2, 6, 7, 8, 9]
    assert not any(r["skipped"] for r in records)
    events = [r for r in read_metrics(out / "metrics.jsonl", events=True) if r.get("event")]
    assert events == [{"event": "rollback", "step": 2, "from_step": 5, "to_step": 2, "skipped_batches": [3, 4, 5],
                       "reasons": ["nonfinite_loss", "nonfinite_loss"]}]
    anomalies = json.loads((out / "summary.json").read_text())["anomalies"]
    assert anomalies["rollbacks"] == 1 and anomalies["skipped_batches"] == [3, 4, 5]
    assert [s["step"] for s in anomalies["skipped"]] == [4, 5]
    assert complete_tags(out / "checkpoints") == [tag_for(6), tag_for(4), tag_for(2)]
