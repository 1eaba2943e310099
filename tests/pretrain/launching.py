"""How the tests start `pretrain` and the other commands as child processes: to the end (`pretrain`, `ok`), in the
background for tests that signal, kill or stop them (`Launch`), and the check that nothing of a run is left running
afterwards (psutil).

    ok(pretrain(*COMMON, "--data", str(shards), "--out", str(out)))
    launch = Launch(shards, out, "--steps", "8"); launch.wait_for_step(2); os.kill(launch.rank_pid(1), 9)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pipeline.common import REPO_ROOT
from pretrain.metrics import read_metrics

# t5-tiny, 6 steps of 16 sequences (micro batch 4): the runs of test_trainer and the tests that compare against them
RUN_STEPS = 6
COMMON = ["--model", "t5-tiny", "--steps", str(RUN_STEPS), "--micro-batch", "4", "--global-batch", "16", "--lr", "3e-3",
          "--warmup-steps", "1", "--schedule", "cosine", "--seed", "0", "--steady-skip", "1"]
STEPS = 8
TRAIN = ["--model", "t5-tiny", "--steps", str(STEPS), "--micro-batch", "4", "--global-batch", "16", "--lr", "3e-3",
          "--warmup-steps", "1", "--seed", "0", "--steady-skip", "1", "--zero", "2", "--nproc", "2"]


def child_env(**extra: str) -> dict[str, str]:
    """A child's environment: this checkout importable, its output unbuffered, one OpenMP thread (2-core CI)."""
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


def pretrain(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`python -m pretrain.cli ARGS` to its end, its console captured."""
    return subprocess.run([sys.executable, "-m", "pretrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), cwd=REPO_ROOT)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (f"pretrain failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-3000:]}")
    return result


class Launch:
    """A `pretrain` launch in the background; its console goes to OUT.console.{out,err}."""

    def __init__(self, shards: Path, out: Path, *args: str):
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = out.with_suffix(".console.out"), out.with_suffix(".console.err")
        env = child_env()
        with open(self.stdout_path, "a") as stdout, open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen([sys.executable, "-m", "pretrain.cli", *TRAIN, "--data", str(shards),
                                             "--out", str(out), *args], stdout=stdout, stderr=stderr, env=env,
                                            cwd=REPO_ROOT)

    def steps_logged(self) -> int:
        records = read_metrics(self.out / "metrics.jsonl")
        return records[-1]["step"] if records else 0

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while self.steps_logged() < step:
            assert self.process.poll() is None, f"ended before step {step}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
            time.sleep(0.05)

    def rank_pid(self, rank: int) -> int:
        for child in psutil.Process(self.process.pid).children():
            if child.environ().get("RANK") == str(rank):
                return child.pid
        raise AssertionError(f"no rank {rank} under {self.process.pid}")

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())


def leftovers(out: Path) -> list[str]:
    """Live processes whose command line names the run directory (ranks, loader workers, launchers)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if str(out) in " ".join(process.info["cmdline"] or []) and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{process.pid} {' '.join(process.info['cmdline'])[:120]}")
        except psutil.Error:
            continue
    return found


def no_process_left(out: Path, within_s: float = 15) -> None:
    deadline = time.monotonic() + within_s
    while leftovers(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(out), leftovers(out)
