"""`pretrain --resume` against what a long run leaves behind: a final checkpoint by default, a truncated newest
checkpoint (fall back to the one before, one line), a run without checkpoints (refused, nothing changed),
settings that differ from the saved run's (refused naming them, or applied with --resume-allow), retention.

    .venv/bin/python -m pytest tests/pretrain/test_resume_fallback.py -q

Real DeepSpeed on CPU (gloo), t5-tiny on the `tiny_shards` set; 6 launches of 3-6 steps, ~2 min on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launching import COMMON, ok, pretrain
from pretrain.checkpoint import MARKER, complete_tags, tag_for
from pretrain.metrics import read_metrics


def launch(shards: Path, out: Path, *args: str):
    return pretrain(*COMMON, "--data", str(shards), "--out", str(out), *args)


def one_line_error(result) -> str:
    assert result.returncode == 2, f"{result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def base(tiny_shards, tmp_path_factory) -> Path:
    """ZeRO 2, 2 ranks: --stop-after 5 with --save-every 3 and --keep-checkpoints 2: checkpoints at 3 and 5."""
    out = tmp_path_factory.mktemp("resume") / "base"
    ok(launch(tiny_shards, out, "--zero", "2", "--nproc", "2", "--stop-after", "5", "--save-every", "3",
              "--keep-checkpoints", "2"))
    return out


def test_default_launch_leaves_a_final_checkpoint_and_a_run_without_one_is_not_restarted(tiny_shards, tmp_path):
    out = tmp_path / "plain"
    ok(launch(tiny_shards, out, "--zero", "0", "--nproc", "1", "--steps", "2"))
    assert complete_tags(out / "checkpoints") == [tag_for(2)]
    again = ok(launch(tiny_shards, out, "--zero", "0", "--nproc", "1", "--steps", "2", "--resume"))
    assert f"[resume] {tag_for(2)}" in again.stdout and len(read_metrics(out / "metrics.jsonl")) == 2
    bare = tmp_path / "bare"
    ok(launch(tiny_shards, bare, "--zero", "0", "--nproc", "1", "--steps", "2", "--no-save-final"))
    before = (bare / "metrics.jsonl").read_bytes()
    line = one_line_error(launch(tiny_shards, bare, "--zero", "0", "--nproc", "1", "--steps", "2", "--resume"))
    assert "no complete checkpoint" in line and str(bare) in line
    assert (bare / "metrics.jsonl").read_bytes() == before


def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(base, tiny_shards):
    first = read_metrics(base / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    marker = json.loads((base / "checkpoints" / tag_for(5) / MARKER).read_text())
    assert marker["files"] and marker["shard_fingerprint"] and marker["train"]["zero"] == 2
    victim = base / "checkpoints" / tag_for(5) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])        # torn after it was marked complete
    result = ok(launch(tiny_shards, base, "--zero", "2", "--nproc", "2", "--resume", "--save-every", "3",
                       "--keep-checkpoints", "1"))
    notes = [line for line in result.stdout.splitlines() if "cannot be loaded" in line]
    assert len(notes) == 1 and str(victim) in notes[0] and "truncated" in notes[0], result.stdout[-3000:]
    assert f"falling back to {tag_for(3)}" in notes[0]
    after = read_metrics(base / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(1, 7))
    # the steps after the fallback point are the same steps again: same batches, same losses (bit for bit)
    assert [r["loss"] for r in after[:5]] == [r["loss"] for r in first]
    assert [r["batch_checksum"] for r in after[:5]] == [r["batch_checksum"] for r in first]
    # --keep-checkpoints 1: only the newest is kept, besides the one this launch resumed from
    assert complete_tags(base / "checkpoints") == [tag_for(6), tag_for(3)]


def test_resume_refuses_other_settings_naming_them(base, tiny_shards):
    before = (base / "metrics.jsonl").read_bytes()
    line = one_line_error(launch(tiny_shards, base, "--zero", "3", "--nproc", "2", "--resume", "--steps", "9"))
    assert "zero 2 -> 3" in line and "steps 6 -> 9" in line and "never" in line
    line = one_line_error(launch(tiny_shards, base, "--zero", "2", "--nproc", "1", "--resume", "--lr", "1e-3"))
    assert "lr 0.003 -> 0.001" in line and "--resume-allow" in line
    line = one_line_error(launch(tiny_shards, base, "--zero", "2", "--nproc", "1", "--resume", "--steps", "4",
                                 "--resume-allow", "steps"))
    assert "--steps 4 is below step 6" in line and "cannot go back" in line
    assert (base / "metrics.jsonl").read_bytes() == before


def test_resume_allow_applies_a_longer_schedule(base, tiny_shards):
    # steps 6 -> 8 allowed by name: lr follows the new schedule
    result = ok(launch(tiny_shards, base, "--zero", "2", "--nproc", "2", "--resume", "--steps", "8",
                       "--resume-allow", "steps"))
    assert "--resume-allow: steps 6 -> 8" in result.stdout
    records = read_metrics(base / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    from pretrain.trainer import LRSchedule
    schedule = LRSchedule("cosine", 1, 8, 0.1)
    assert [r["lr"] for r in records[6:]] == pytest.approx([3e-3 * schedule(s - 1) for s in (7, 8)], rel=1e-9)
