"""`pretrain` end to end on CPU: real DeepSpeed, 2 gloo ranks, t5-tiny, the real `tiny_shards` set.

    .venv/bin/python -m pytest tests/pretrain/test_trainer.py -q

Launches (each a real `python -m pretrain.cli` run, 6 steps of 16 examples, grad accumulation 2):
  ref    ZeRO 2, 2 ranks, uninterrupted, checkpoints at 3 and 6
  stop2  ZeRO 2, 2 ranks, 1 loader worker each, --stop-after 3  ->  resume2: --resume to step 6 (a half-written step-5 checkpoint and a
         stale metrics line are planted in between: neither may be used)
  stop0 / stop1 / stop3  ZeRO 0 / 1 / 3, --stop-after 3 (the stage comparison); 0 and 3 also --export-hf,
         1 with --activation-checkpointing --offload cpu
  one    --nproc 1 --resume from stop0's checkpoint (ZeRO 0: 2 ranks -> 1, grad accumulation 2 -> 4)
  wrong  --nproc 1 --resume from stop2's ZeRO 2 checkpoint: must fail with one line
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.common import REPO_ROOT
from pretrain.checkpoint import MARKER, latest_complete, tag_for
from pretrain.metrics import STEP_KEYS, read_metrics

STEPS, HALF = 6, 3
COMMON = ["--model", "t5-tiny", "--steps", str(STEPS), "--micro-batch", "4", "--global-batch", "16", "--lr", "3e-3",
          "--warmup-steps", "1", "--schedule", "cosine", "--seed", "0", "--steady-skip", "1"]


def pretrain(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pretrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO_ROOT)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"pretrain failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


class Runs:
    """Launches shared by the tests of this module, each run once, on first use."""

    def __init__(self, root: Path, shards: Path):
        self.root, self.shards, self.done = root, shards, {}

    def dir(self, name: str) -> Path:
        return self.root / name

    def run(self, name: str, *args: str, out: str | None = None) -> subprocess.CompletedProcess:
        if name not in self.done:
            self.done[name] = ok(pretrain(*COMMON, "--data", str(self.shards), "--out", str(self.dir(out or name)),
                                          *args))
        return self.done[name]

    def metrics(self, name: str) -> list[dict]:
        return read_metrics(self.dir(name) / "metrics.jsonl")

    def ref(self):
        self.run("ref", "--zero", "2", "--nproc", "2", "--save-every", "3")
        return self.metrics("ref")

    def stopped(self, stage: int):
        export = ["--export-hf", str(self.dir(f"stop{stage}") / "hf")] if stage in (0, 3) else []
        workers = ["--loader-workers", "1"] if stage == 2 else []     # the resumed pair reads through a worker
        # recomputation and optimizer offload must not change the math
        recompute = ["--activation-checkpointing", "--offload", "cpu"] if stage == 1 else []
        self.run(f"stop{stage}", "--zero", str(stage), "--nproc", "2", "--stop-after", str(HALF), *export, *workers,
                 *recompute)
        return self.metrics(f"stop{stage}")


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("pretrain_runs"), Path(tiny_shards))


def losses(records):
    return [r["loss"] for r in records]


def test_every_zero_stage_gives_the_same_losses_and_the_loss_falls(runs):
    ref = runs.ref()
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.1, losses(ref)
    assert all(math.isfinite(x) for x in losses(ref))
    for stage in (0, 1, 3):
        stopped = runs.stopped(stage)
        assert [r["zero_stage"] for r in stopped] == [stage] * HALF
        assert losses(stopped) == pytest.approx(losses(ref[:HALF]), rel=2e-5, abs=2e-5), f"ZeRO {stage}"
        assert [r["batch_checksum"] for r in stopped] == [r["batch_checksum"] for r in ref[:HALF]]
    stop1 = json.loads((runs.dir("stop1") / "config.json").read_text())
    assert stop1["model"]["activation_checkpointing"] is True
    assert stop1["deepspeed"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_metrics_config_summary_and_checkpoints(runs):
    ref = runs.ref()
    run_dir = runs.dir("ref")
    for record in ref:
        assert set(STEP_KEYS) <= set(record)
        assert record["step_time_s"] == pytest.approx(record["data_wait_s"] + record["compute_s"], rel=1e-9)
        assert 0 <= record["data_wait_s"] <= record["step_time_s"]
        assert record["world_size"] == 2 and record["grad_accum"] == 2 and record["micro_batch"] == 4
        assert record["tokens"] == 16 * (128 + 29)
        assert record["tokens_per_s"] == pytest.approx(record["tokens"] / record["step_time_s"])
        assert record["tflops_per_gpu"] > 0 and record["mfu"] is None and record["peak_mem_gib"] > 0
    assert [r["consumed_samples"] for r in ref] == [16 * s for s in range(1, STEPS + 1)]
    lrs = [r["lr"] for r in ref]
    assert lrs[0] == pytest.approx(3e-3) and lrs == sorted(lrs, reverse=True) and lrs[-1] < lrs[0]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["deepspeed"]["zero_optimization"]["stage"] == 2
    assert config["deepspeed"]["optimizer"]["params"]["torch_adam"] is True
    assert config["deepspeed"]["gradient_accumulation_steps"] == 2
    assert config["memory_estimate"]["per_gpu_gib"] > 0 and "estimate_zero2" in config["memory_estimate"]["method"]
    assert len(config["shard_fingerprint"]) == 64 and config["git_revision"]
    assert config["train"]["zero"] == 2 and config["model"]["vocab_size"] == 1024
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    assert summary["median"]["tokens_per_s"] > 0 and summary["final_loss"] == ref[-1]["loss"]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    for step in (3, 6):
        assert (run_dir / "checkpoints" / tag_for(step) / MARKER).is_file()
    assert (run_dir / "checkpoints" / "latest").read_text() == tag_for(STEPS)
    assert "[done] ok" in runs.done["ref"].stdout and "tok/s" in runs.done["ref"].stdout


def test_stop_and_resume_gives_identical_losses_and_ignores_half_written_checkpoints(runs):
    ref = runs.ref()
    stopped = runs.stopped(2)
    run_dir = runs.dir("stop2")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"
    assert latest_complete(run_dir / "checkpoints") == tag_for(HALF)
    # what a kill during a later save and after some unsaved steps leaves behind: a tag without its marker and
    # metrics lines past the last checkpoint
    half = run_dir / "checkpoints" / tag_for(5)
    shutil.copytree(run_dir / "checkpoints" / tag_for(HALF), half)
    (half / MARKER).unlink()
    assert latest_complete(run_dir / "checkpoints") == tag_for(HALF)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(dict(stopped[-1], step=HALF + 1, loss=123.0)) + "\n")
    resumed = runs.run("resume2", "--zero", "2", "--nproc", "2", "--resume", "--save-every", "3", "--loader-workers",
                       "1", out="stop2")
    assert f"[resume] {tag_for(HALF)}" in resumed.stdout
    after = runs.metrics("stop2")
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    assert losses(after) == losses(ref)                     # bit for bit
    assert [r["batch_checksum"] for r in after] == [r["batch_checksum"] for r in ref]
    assert [r["lr"] for r in after] == [r["lr"] for r in ref]


def test_resume_at_another_rank_count_continues_the_data_order(runs):
    ref = runs.ref()
    runs.stopped(0)
    one = runs.dir("one")
    shutil.copytree(runs.dir("stop0"), one)
    result = runs.run("one", "--zero", "0", "--nproc", "1", "--resume")
    assert f"[resume] {tag_for(HALF)}" in result.stdout
    after = runs.metrics("one")[HALF:]
    assert [r["world_size"] for r in after] == [1] * (STEPS - HALF)
    assert [r["grad_accum"] for r in after] == [4] * (STEPS - HALF)
    assert [r["batch_checksum"] for r in after] == [r["batch_checksum"] for r in ref[HALF:]]
    assert [r["consumed_samples"] for r in after] == [r["consumed_samples"] for r in ref[HALF:]]
    assert losses(after) == pytest.approx(losses(ref[HALF:]), rel=2e-5, abs=2e-5)


def test_resuming_zero2_partitions_at_another_rank_count_fails_with_one_line(runs):
    runs.stopped(2)
    wrong = runs.dir("wrong")
    shutil.copytree(runs.dir("stop2") / "checkpoints", wrong / "checkpoints")
    result = pretrain(*COMMON, "--data", str(runs.shards), "--out", str(wrong), "--zero", "2", "--nproc", "1",
                      "--resume")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "saved by 2 ranks at ZeRO 2" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    summary = json.loads((wrong / "summary.json").read_text())
    assert summary["status"] == "failed" and "saved by 2 ranks" in summary["reason"]


def test_export_hf_gathers_zero3_partitions(runs):
    from transformers import T5ForConditionalGeneration

    runs.stopped(0)
    runs.stopped(3)
    zero0 = T5ForConditionalGeneration.from_pretrained(runs.dir("stop0") / "hf").state_dict()
    zero3 = T5ForConditionalGeneration.from_pretrained(runs.dir("stop3") / "hf").state_dict()
    assert zero0.keys() == zero3.keys() and len(zero0) > 10
    for name, tensor in zero0.items():
        assert tensor.shape == zero3[name].shape, name
        assert float((tensor - zero3[name]).abs().max()) < 1e-4, name
