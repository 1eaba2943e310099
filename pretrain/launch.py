"""Local spawning: `pretrain --nproc N` starts N rank processes on this machine and waits for all of them.

    code = spawn_local(argv, nproc=2, run_dir=Path("runs/demo"))

Each rank is `python -m pretrain.cli ARGV` with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR=127.0.0.1 /
MASTER_PORT=<free port>, the variables torchrun and the deepspeed launcher set (`pretrain.ranks`), so every
rank runs one code path (`pretrain.trainer.run_rank`); N = 1 is spawned too, which keeps the console to rank 0's
stdout and the one-line errors. Every rank's stderr goes to RUN_DIR/logs/rank-R.log. When a rank fails, the
others are stopped, the failure's last line becomes the one-line reason on stderr, and RUN_DIR/summary.json
says {"status": "failed", "reason"}.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.common import UserError
from pretrain.ranks import LAUNCH_T0_ENV, SPAWNED_ENV, free_port, launch_t0, local_rank_environ


def spawn_local(argv: list[str], nproc: int, run_dir: Path) -> int:
    """Start `nproc` ranks of `python -m pretrain.cli ARGV` on this machine and wait for all of them."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    spawned = {SPAWNED_ENV: "1", LAUNCH_T0_ENV: str(launch_t0())}   # the parent's start, or its own launcher's
    ranks: list[tuple[subprocess.Popen, Path]] = []
    for rank in range(nproc):
        env = local_rank_environ(rank, nproc, port, **spawned)
        log_path = log_dir / f"rank-{rank}.log"
        log = open(log_path, "w")
        stdout = None if rank == 0 else log
        process = subprocess.Popen([sys.executable, "-m", "pretrain.cli", *argv], env=env, stdout=stdout,
                                   stderr=log, start_new_session=True)
        log.close()
        ranks.append((process, log_path))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _wait_all(ranks)
    except UserError as failure:       # a rank failed: leave the reason where a study looks for results
        from pretrain.metrics import write_summary
        write_summary(run_dir, {"status": "failed", "reason": str(failure)})
        raise
    finally:             # normal exit: all done; failure, Ctrl-C or SIGTERM: stop the ranks still running
        _stop_all(ranks)
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _wait_all(ranks: list[tuple[subprocess.Popen, Path]]) -> int:
    """Wait for every rank; on the first failure stop the others and raise its reason as a UserError."""
    while True:
        codes = [process.poll() for process, _ in ranks]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank = failed[0]
            time.sleep(1.0)      # let a collective failure surface in the other logs first
            _stop_all(ranks)
            process, log_path = ranks[rank]
            raise UserError(f"rank {rank} failed (exit {process.returncode}): {last_error_line(log_path)} "
                            f"(full log: {log_path})")
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


def _stop_all(ranks: list[tuple[subprocess.Popen, Path]]) -> None:
    for process, _ in ranks:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for process, _ in ranks:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def last_error_line(log_path: Path) -> str:
    """The line of a rank's log that says why it stopped: our one-line error, else the exception's last line."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        match = re.match(r"^\S+: error: (.*)$", line)
        if match:
            return match.group(1)
    for line in reversed(lines):
        if "Error" in line.split(":")[0] or line.startswith(("RuntimeError", "torch.OutOfMemoryError")):
            return line
    return lines[-1] if lines else "no output"
