"""Launch shapes: `--nproc N` spawns N local ranks; under torchrun or the `deepspeed` launcher each process is one rank.

    launch(config, argv)   # preflight, then run this process as a rank or spawn config.nproc local ranks

Local spawning (also for N = 1, which keeps the console to rank 0's stdout and the one-line errors) starts
`python -m pretrain.cli ARGV` N times with RANK / LOCAL_RANK / WORLD_SIZE /
MASTER_ADDR=127.0.0.1 / MASTER_PORT=<free port>, the same variables torchrun and the deepspeed launcher set,
so every rank runs one code path (`pretrain.trainer.run_rank`). Rank 0's stdout is the console; every
rank's stderr goes to RUN_DIR/logs/rank-R.log. When a rank fails, the others are stopped, the failure's
last line becomes the one-line reason on stderr, and RUN_DIR/summary.json says {"status": "failed", "reason"}.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.common import REPO_ROOT, UserError

SPAWNED_ENV = "T5ZERO_SPAWNED"   # set in ranks started by `--nproc`: the parent already ran the preflight
LAUNCH_T0_ENV = "T5ZERO_LAUNCH_T0"  # time.time() when the spawning `pretrain` started: the start-up timeline's zero
START_GATE_ENV = "T5ZERO_START_GATE"  # a file path: ranks do their host-side start-up, then wait for the file


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job, read from the launcher's environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launched: bool      # True under torchrun / deepspeed / our own spawner

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_env(environ: dict[str, str] | None = None) -> RankEnv:
    """Read RANK, LOCAL_RANK, WORLD_SIZE (and LOCAL_WORLD_SIZE) as torchrun and deepspeed set them."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launched=False)
    world_size = int(env["WORLD_SIZE"])
    return RankEnv(rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", 0)), world_size=world_size,
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)), launched=True)


def launch_t0() -> float:
    """When this launch began: the spawning parent's start (passed down), else this process's own start."""
    if LAUNCH_T0_ENV in os.environ:
        return float(os.environ[LAUNCH_T0_ENV])
    try:
        import psutil
        return psutil.Process().create_time()
    except Exception:                                  # psutil missing or /proc unreadable: close enough
        return time.time()


def wait_for_start_gate(poll_s: float = 0.05) -> float | None:
    """Block until the file named by T5ZERO_START_GATE exists (no variable: return at once, None).

    `study run` with overlap_startup launches the next point while the current one trains: its ranks import,
    run the preflight and build the model on the host, then wait here, before their first use of the devices,
    until the study opens the gate (creates the file) when the devices are free. Returns the seconds waited."""
    gate = os.environ.get(START_GATE_ENV)
    if not gate:
        return None
    start = time.monotonic()
    while not os.path.exists(gate):
        time.sleep(poll_s)
    return time.monotonic() - start


def free_port() -> int:
    """A TCP port free on the loopback interface right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config, argv: list[str]) -> int:
    """Run the preflight once, then train in this process (launched / nproc 1) or spawn local ranks."""
    from pretrain import preflight

    env = rank_env()
    world_size = env.world_size if env.launched else config.nproc
    spawned = os.environ.get(SPAWNED_ENV) == "1"
    if not spawned:
        preflight.check_run_dir(config)
    plan = preflight.run_preflight(config, world_size=world_size, local_world_size=(
        env.local_world_size if env.launched else config.nproc), announce=env.is_main and not spawned)
    if env.launched:
        from pretrain import trainer
        return trainer.run_rank(config, plan, env)
    return spawn_local(argv, config.nproc, Path(config.out))


def local_rank_environ(rank: int, nproc: int, port: int, **extra: str) -> dict[str, str]:
    """This process's environment for local rank `rank` of `nproc` on this machine: the variables torchrun and the
    deepspeed launcher set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT),
    this checkout first on PYTHONPATH, and `extra`."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_script_ranks(argv: list[str], logs: list[Path], timeout: float, name: str, report: Path) -> None:
    """Run `argv` (a script and its flags) as len(logs) gloo ranks on this machine, each rank's output to its log,
    and wait up to `timeout` seconds; a rank still running then (or left waiting in a collective by one that
    failed) is killed. Raises RuntimeError naming the first failed rank (or rank 0, if it wrote no `report`) and
    ending with its log's tail. For the measuring scripts (scripts/zero3_trace.py, scripts/zero3_overhead.py);
    pretrain itself uses `spawn_local`."""
    port = free_port()
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    ranks = []
    for rank, log_path in enumerate(logs):
        with open(log_path, "w") as log:
            ranks.append(subprocess.Popen(argv, env=local_rank_environ(rank, len(logs), port, OMP_NUM_THREADS=threads),
                                          stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for process in ranks:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    failed = [rank for rank, process in enumerate(ranks) if process.returncode != 0]
    if failed or not report.is_file():
        log = logs[failed[0] if failed else 0]
        raise RuntimeError(f"{name}: rank(s) {failed or [0]} failed; {log} ends with:\n{log.read_text()[-4000:]}")


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
