"""Local spawning: `pretrain --nproc N` starts N rank processes on this machine, watches them, and restarts them.

    code = spawn_local(argv, nproc=2, run_dir=Path("runs/demo"), max_restarts=2, rank_timeout_s=1800)

Each rank is `python -m pretrain.cli ARGV` with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR=127.0.0.1 /
MASTER_PORT=<free port>, the variables torchrun and the deepspeed launcher set (`pretrain.ranks`), so every
rank runs one code path (`pretrain.trainer.run_rank`); N = 1 is spawned too, which keeps the console to rank 0's
stdout and the one-line errors. Every rank's stderr goes to RUN_DIR/logs/rank-R.log. The ranks inherit the run
directory's lock (`pretrain.runlock`) and die with this process (PR_SET_PDEATHSIG).

- A rank fails (non-zero exit, killed by a signal: "rank 1 killed by SIGKILL") or hangs (no heartbeat for
  `rank_timeout_s`, the watchdog): the others are stopped. With restarts left, all ranks start again with
  `--resume` (the newest complete checkpoint); otherwise the reason is the one line on stderr and
  RUN_DIR/summary.json says {"status": "failed", "reason"}. A user error in a rank (exit 2) is never retried.
- SIGTERM, SIGUSR1 or SIGINT here is forwarded to every rank (a preemption: they save at the next step boundary
  and exit RESUMABLE_EXIT, 75), and this launcher exits 75 too. A second signal is forwarded as well: the ranks
  then stop at once.
- Restarts are listed in summary.json["restarts"].
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.common import UserError
from pretrain.metrics import SUMMARY_NAME, read_metrics, write_summary
from pretrain.ranks import (HEARTBEAT_DIR_ENV, LAUNCH_T0_ENV, PREEMPT_SIGNALS, RESUMABLE_EXIT, SPAWNED_ENV,
                            die_with_parent, free_port, launch_t0, local_rank_environ, signal_name)

USER_ERROR_EXIT = 2          # pipeline.common.run_cli: a mistake the user must fix; restarting cannot help


@dataclass
class Attempt:
    """How one start of the ranks ended: code 0 / RESUMABLE_EXIT, or a failure with its one-line reason."""

    code: int
    reason: str = ""
    retryable: bool = False


class _Ranks:
    """The rank processes of one attempt, with their logs and heartbeat files."""

    def __init__(self, argv: list[str], nproc: int, run_dir: Path, lock_fd: int | None):
        self.log_dir = run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.log_dir.glob("heartbeat-rank-*"):
            stale.unlink()
        port = free_port()
        extra = {SPAWNED_ENV: "1", LAUNCH_T0_ENV: str(launch_t0()),   # the parent's start, or its own launcher's
                 HEARTBEAT_DIR_ENV: str(self.log_dir)}
        self.processes: list[subprocess.Popen] = []
        self.log_paths: list[Path] = []
        for rank in range(nproc):
            log_path = self.log_dir / f"rank-{rank}.log"
            with open(log_path, "w") as log:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "pretrain.cli", *argv], env=local_rank_environ(rank, nproc, port, **extra),
                    stdout=None if rank == 0 else log, stderr=log, start_new_session=True,
                    pass_fds=() if lock_fd is None else (lock_fd,), preexec_fn=die_with_parent(signal.SIGTERM)))
            self.log_paths.append(log_path)

    def forward(self, signum: int) -> None:
        """Send `signum` to each live rank's main process only (its loader workers would die of it)."""
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """Stop every rank at once with its loader workers (SIGKILL to each rank's session), and reap them."""
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            process.wait()

    def heartbeat_age(self, rank: int, now: float) -> float | None:
        """Seconds since `rank` last finished a step; None before its first step (start-up, with model builds,
        compiles and checkpoint conversions of unknown length, is not watched)."""
        path = self.log_dir / f"heartbeat-rank-{rank}"
        try:
            if not path.read_text().strip().isdigit():
                return None
            return now - path.stat().st_mtime
        except OSError:
            return None


def spawn_local(argv: list[str], nproc: int, run_dir: Path, *, max_restarts: int = 0, rank_timeout_s: float = 0,
                lock_fd: int | None = None) -> int:
    """Start `nproc` ranks of `python -m pretrain.cli ARGV` on this machine, wait for all of them, and restart them
    with --resume after a failure, up to `max_restarts` times. Returns 0, or RESUMABLE_EXIT after a preemption;
    raises UserError with the reason when the ranks failed for good."""
    restarts: list[dict[str, Any]] = []
    attempt_argv = list(argv)
    while True:
        attempt = _run_attempt(attempt_argv, nproc, run_dir, rank_timeout_s, lock_fd)
        if restarts:
            restarts[-1]["resumed_at_step"] = _start_step(run_dir)
        if attempt.code in (0, RESUMABLE_EXIT):
            _record_restarts(run_dir, restarts)
            return attempt.code
        if not attempt.retryable or len(restarts) >= max_restarts:
            _record_restarts(run_dir, restarts, failure=attempt.reason)
            raise UserError(attempt.reason + (f" (after {len(restarts)} restart(s))" if restarts else ""))
        restarts.append({"restart": len(restarts) + 1, "reason": attempt.reason, "time": time.time(),
                         "last_logged_step": _last_logged_step(run_dir)})
        print(f"[restart {len(restarts)}/{max_restarts}] {attempt.reason}; starting all {nproc} rank(s) again with "
              f"--resume (the newest complete checkpoint)", file=sys.stderr, flush=True)
        if "--resume" not in attempt_argv:
            attempt_argv.append("--resume")


def archive_previous_launch(run_dir: Path) -> Path | None:
    """Move the rank logs and summary.json an earlier launch (or attempt) left in RUN_DIR into
    RUN_DIR/logs/history/NNN/, so that a new attempt, failed or not, never overwrites what explained the last one.
    Returns the folder, or None when there was nothing to keep."""
    log_dir = run_dir / "logs"
    previous = sorted(log_dir.glob("rank-*.log")) + [p for p in (run_dir / SUMMARY_NAME,) if p.is_file()]
    if not previous:
        return None
    history = log_dir / "history"
    number = 1 + max((int(p.name) for p in history.glob("[0-9]*") if p.name.isdigit()), default=0)
    target = history / f"{number:03d}"
    target.mkdir(parents=True)
    for path in previous:
        path.rename(target / path.name)
    return target


def _run_attempt(argv: list[str], nproc: int, run_dir: Path, rank_timeout_s: float, lock_fd: int | None) -> Attempt:
    archive_previous_launch(run_dir)
    ranks = _Ranks(argv, nproc, run_dir, lock_fd)
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        print(f"[preempt] {signal_name(signum)}: forwarded to {nproc} rank(s); they save a checkpoint at the next "
              f"step boundary and exit {RESUMABLE_EXIT}", file=sys.stderr, flush=True)
        ranks.forward(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in PREEMPT_SIGNALS}
    try:
        attempt = _wait_all(ranks, rank_timeout_s)
        if received:             # stopped on purpose (a second signal makes ranks exit at once): never restarted
            attempt.retryable = False
        return attempt
    finally:       # normal exit: all done; a failure, a hang or an exception here: no rank outlives the attempt
        ranks.kill()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _wait_all(ranks: _Ranks, rank_timeout_s: float) -> Attempt:
    """Wait for every rank; on the first failure or hang stop the others and say which rank and why."""
    while True:
        codes = [process.poll() for process in ranks.processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0, RESUMABLE_EXIT)]
        if failed:
            time.sleep(1.0)      # let a collective failure surface in the other logs first
            codes = [process.poll() for process in ranks.processes]
            # the root cause first: a rank killed by a signal, else the lowest failed rank
            rank = min(failed, key=lambda r: (codes[r] is None or codes[r] >= 0, r))
            ranks.kill()
            return _failure(rank, ranks.processes[rank].returncode, ranks.log_paths[rank])
        if all(code is not None for code in codes):
            return Attempt(RESUMABLE_EXIT if RESUMABLE_EXIT in codes else 0)
        if rank_timeout_s:
            hung = _hung_rank(ranks, codes, rank_timeout_s)
            if hung is not None:
                ranks.kill()
                return Attempt(1, hung, retryable=True)
        time.sleep(0.2)


def _failure(rank: int, returncode: int, log_path: Path) -> Attempt:
    if returncode < 0:
        return Attempt(1, f"rank {rank} killed by {signal_name(-returncode)} (full log: {log_path})", retryable=True)
    return Attempt(1, f"rank {rank} failed (exit {returncode}): {last_error_line(log_path)} (full log: {log_path})",
                   retryable=returncode != USER_ERROR_EXIT)


def _hung_rank(ranks: _Ranks, codes: list[int | None], rank_timeout_s: float) -> str | None:
    """The watchdog: the reason to stop when a live rank has not touched its heartbeat for rank_timeout_s (a stopped
    process is named first: its peers wait for it in a collective and look just as idle)."""
    import psutil

    now = time.time()
    ages = {rank: ranks.heartbeat_age(rank, now) for rank, code in enumerate(codes) if code is None}
    ages = {rank: age for rank, age in ages.items() if age is not None}
    late = [rank for rank, age in ages.items() if age > rank_timeout_s]
    if not late:
        return None

    def state(rank: int) -> str:
        try:
            return psutil.Process(ranks.processes[rank].pid).status()
        except psutil.Error:
            return "gone"

    states = {rank: state(rank) for rank in ages}
    stopped = [rank for rank in ages if states[rank] == psutil.STATUS_STOPPED]
    rank = stopped[0] if stopped else max(late, key=lambda r: (ages[r], -r))
    return (f"rank {rank} made no progress for {ages[rank]:.0f} s (process {states[rank]}"
            f"{', e.g. by SIGSTOP' if states[rank] == psutil.STATUS_STOPPED else ''}); stopped the job "
            f"(--rank-timeout {rank_timeout_s:g}; full log: {ranks.log_paths[rank]})")


def _last_logged_step(run_dir: Path) -> int | None:
    records = read_metrics(run_dir / "metrics.jsonl")
    return records[-1]["step"] if records else None


def _start_step(run_dir: Path) -> int | None:
    """The step the latest attempt resumed at (rank 0 records it in config.json)."""
    try:
        return json.loads((run_dir / "config.json").read_text()).get("start_step")
    except (OSError, json.JSONDecodeError):
        return None


def _record_restarts(run_dir: Path, restarts: list[dict[str, Any]], failure: str | None = None) -> None:
    """summary.json gets `restarts` (the ranks' own summary kept); a failure for good sets status failed."""
    path = run_dir / SUMMARY_NAME
    if failure is None and not restarts:
        return
    summary: dict[str, Any] = {}
    if failure is None and path.is_file():
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            summary = {}
    if failure is not None:
        summary = {"status": "failed", "reason": failure}
    summary["restarts"] = restarts
    write_summary(run_dir, summary)


def last_error_line(log_path: Path) -> str:
    """The line of a rank's log that says why it stopped: our one-line error, else the exception's last line
    (torchrun's `[rankN]:` prefixes dropped; pydantic's closing "For further information visit URL" skipped)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "no log"
    lines = [re.sub(r"^\[rank\d+\]:", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("For further information visit")]
    for line in reversed(lines):
        match = re.match(r"^\S+: error: (.*)$", line)
        if match:
            return match.group(1)
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line):
            return line
    return lines[-1] if lines else "no output"
