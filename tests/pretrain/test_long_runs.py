"""Long runs on CPU (real DeepSpeed, 2 gloo ranks, t5-tiny, ZeRO 2): preemption, restarts, the watchdog, signals.

    .venv/bin/python -m pytest tests/pretrain/test_long_runs.py -q

Launches (each a real `python -m pretrain.cli --nproc 2` run of 8 steps of 16 examples):
  ref      uninterrupted
  preempt  SIGUSR1 to the launcher mid-run -> checkpoint, exit 75, summary "preempted"; --resume with SIGTERM sent
           to rank 1 itself mid-run -> exit 75 again; --resume to the end: the losses equal ref's
  restart  kill -9 of rank 1 at a random step, --max-restarts 1: restarts by itself, losses equal ref's
  stopped  SIGSTOP of rank 1 with --rank-timeout 6, no restarts: the watchdog names rank 1 and ends the job (one
           line, exit 2, summary failed)
After each, no process of the run is left (psutil).
"""

from __future__ import annotations

import os
import random
import signal
import time

import psutil
import pytest

from launching import STEPS, Launch, no_process_left
from pretrain.metrics import read_metrics
from pretrain.ranks import RESUMABLE_EXIT

@pytest.fixture(scope="module")
def ref_losses(tiny_shards, tmp_path_factory) -> list[float]:
    launch = Launch(tiny_shards, tmp_path_factory.mktemp("long_runs") / "ref")
    assert launch.wait() == 0, launch.stderr()
    return [r["loss"] for r in read_metrics(launch.out / "metrics.jsonl")]


def test_preemption_saves_exits_resumable_and_resume_continues_exactly(tiny_shards, tmp_path, ref_losses):
    out = tmp_path / "preempt"
    first = Launch(tiny_shards, out)
    first.wait_for_step(2)
    first.process.send_signal(signal.SIGUSR1)           # Slurm's --signal=USR1@120, sent to the launcher
    assert first.wait() == RESUMABLE_EXIT, first.stderr()
    no_process_left(out)
    summary = first.summary()
    stopped_at = summary["steps"]
    assert summary["status"] == "preempted" and 2 <= stopped_at < STEPS
    assert (out / "checkpoints" / f"step-{stopped_at:08d}" / "COMPLETE.json").is_file()
    assert "SIGUSR1: forwarded to 2 rank(s)" in first.stderr()
    assert f"exit status {RESUMABLE_EXIT} (resumable)" in first.stdout_path.read_text()

    second = Launch(tiny_shards, out, "--resume")
    second.wait_for_step(stopped_at + 1)
    os.kill(second.rank_pid(1), signal.SIGTERM)         # one rank alone asked to stop: all agree on the step
    assert second.wait() == RESUMABLE_EXIT, second.stderr()
    no_process_left(out)
    assert second.summary()["status"] == "preempted"
    assert stopped_at < second.summary()["steps"] < STEPS

    third = Launch(tiny_shards, out, "--resume")
    assert third.wait() == 0, third.stderr()
    assert third.summary()["status"] == "ok"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == ref_losses               # bit for bit, as an uninterrupted run
    no_process_left(out)


def test_a_rank_killed_at_a_random_step_restarts_the_job_by_itself(tiny_shards, tmp_path, ref_losses):
    out = tmp_path / "restart"
    kill_after = random.Random().randint(2, STEPS - 3)
    launch = Launch(tiny_shards, out, "--max-restarts", "1", "--save-every", "2")
    launch.wait_for_step(kill_after)
    os.kill(launch.rank_pid(1), signal.SIGKILL)
    assert launch.wait() == 0, f"killed after step {kill_after}:\n{launch.stderr()}"
    assert "[restart 1/1] rank 1 killed by SIGKILL" in launch.stderr()
    summary = launch.summary()
    assert summary["status"] == "ok" and len(summary["restarts"]) == 1, summary
    restart = summary["restarts"][0]
    assert restart["reason"].startswith("rank 1 killed by SIGKILL")
    assert restart["resumed_at_step"] % 2 == 0 and restart["resumed_at_step"] <= restart["last_logged_step"]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == ref_losses, f"killed after step {kill_after}"
    no_process_left(out)


def test_the_watchdog_names_a_stopped_rank_and_ends_the_job(tiny_shards, tmp_path):
    out = tmp_path / "stopped"
    launch = Launch(tiny_shards, out, "--rank-timeout", "6")
    launch.wait_for_step(1)
    stopped = launch.rank_pid(1)
    os.kill(stopped, signal.SIGSTOP)
    started = time.monotonic()
    assert launch.wait(timeout=90) == 2
    assert time.monotonic() - started < 40
    lines = launch.stderr().strip().splitlines()
    last = lines[-1]
    assert len([line for line in lines if ": error: " in line]) == 1 and "Traceback" not in launch.stderr()
    assert ": error: rank 1 made no progress for" in last and "process stopped, e.g. by SIGSTOP" in last, last
    assert "--rank-timeout 6" in last
    assert launch.summary()["status"] == "failed" and "rank 1 made no progress" in launch.summary()["reason"]
    assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == psutil.STATUS_ZOMBIE
    no_process_left(out)
