"""Where this process sits in a `pretrain` job: the rank environment, the start gate, preemption and heartbeats.

    env = rank_env()      # RANK / LOCAL_RANK / WORLD_SIZE as torchrun, the deepspeed launcher or `--nproc` set them

Every rank runs one code path whatever started it. `pretrain.launch` spawns local ranks with the variables of
`local_rank_environ`; under `srun` (one task per rank) the ranks come from SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID (`adopt_slurm_ranks`). A rank turns SIGTERM, SIGUSR1 and SIGINT into a preemption request
(`preemption`): the trainer saves at the next step boundary all ranks agree on and exits RESUMABLE_EXIT. Each
rank touches a heartbeat file the local launcher's watchdog reads (`heartbeat`). No torch or DeepSpeed here: the
study and the spawner read these without them (`pretrain.trainer.init_rank` makes the rank's process group).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipeline.common import REPO_ROOT, usable_cores

SPAWNED_ENV = "T5ZERO_SPAWNED"   # set in ranks started by `--nproc`: the parent already ran the preflight
LAUNCH_T0_ENV = "T5ZERO_LAUNCH_T0"  # time.time() when the spawning `pretrain` started: the start-up timeline's zero
START_GATE_ENV = "T5ZERO_START_GATE"  # a file path: ranks do their host-side start-up, then wait for the file
HEARTBEAT_DIR_ENV = "T5ZERO_HEARTBEAT_DIR"   # set by the local launcher: ranks touch heartbeat-rank-R files there
RESUMABLE_EXIT = 75     # EX_TEMPFAIL: preempted with a checkpoint saved; run the same command with --resume
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)   # SIGUSR1: Slurm's --signal=USR1@SECONDS


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
    """Read RANK, LOCAL_RANK, WORLD_SIZE (and LOCAL_WORLD_SIZE) as torchrun and deepspeed set them, else the ranks
    of an srun step (`slurm_rank_environ`)."""
    env = os.environ if environ is None else environ
    env = {**slurm_rank_environ(env), **env}
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launched=False)
    world_size = int(env["WORLD_SIZE"])
    return RankEnv(rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", 0)), world_size=world_size,
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)), launched=True)


def slurm_rank_environ(environ: dict[str, str]) -> dict[str, str]:
    """RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE of a task of an `srun` step that runs one task per rank
    (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE), when no
    launcher set RANK and MASTER_ADDR names the rendezvous host (scripts/slurm/pretrain.sbatch sets it); else {}.
    The batch script itself (SLURM_STEP_ID "batch" or absent) is no rank: `pretrain --nproc N` there spawns."""
    if "RANK" in environ or "MASTER_ADDR" not in environ or "SLURM_PROCID" not in environ \
            or "SLURM_NTASKS" not in environ or environ.get("SLURM_STEP_ID", "batch") in ("batch", "4294967294"):
        return {}
    world_size = int(environ["SLURM_NTASKS"])
    per_node = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_STEP_TASKS_PER_NODE", str(world_size))
    local_world_size = int(per_node.split(",")[0].split("(")[0])   # "2(x3),1" -> 2: this template's nodes are alike
    return {"RANK": environ["SLURM_PROCID"], "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(local_world_size),
            "MASTER_PORT": environ.get("MASTER_PORT", "29500")}


def adopt_slurm_ranks() -> None:
    """Put an srun task's ranks into os.environ, where torch.distributed's env:// rendezvous reads them."""
    for name, value in slurm_rank_environ(dict(os.environ)).items():
        os.environ.setdefault(name, value)


class Preemption:
    """A rank's preemption request: the first SIGTERM / SIGUSR1 / SIGINT sets `signum`, and the trainer saves a
    checkpoint at the next step boundary (all ranks agree on it) and exits RESUMABLE_EXIT; another one at least
    REPEAT_S later stops the rank at once (KeyboardInterrupt). Closer repeats are one request delivered twice: a
    PR_SET_PDEATHSIG fires once when the parent's thread that spawned us exits and again when its last one does."""

    REPEAT_S = 2.0

    def __init__(self) -> None:
        self.signum = 0
        self.received_at = 0.0

    def install(self) -> None:
        for signum in PREEMPT_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signum:
            if time.monotonic() - self.received_at >= self.REPEAT_S:
                raise KeyboardInterrupt
            return
        self.signum, self.received_at = signum, time.monotonic()
        print(f"[preempt] {signal_name(signum)} received: saving a checkpoint at the next step boundary, then "
              f"exiting with status {RESUMABLE_EXIT} (resumable); send it again to stop at once", file=sys.stderr,
              flush=True)


preemption = Preemption()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def heartbeat(what: object) -> None:
    """Touch RUN_DIR/logs/heartbeat-rank-R (R = $RANK; what: the step or start-up phase) for the local launcher's
    watchdog; nothing when no launcher watches."""
    directory = os.environ.get(HEARTBEAT_DIR_ENV)
    if directory:
        try:
            Path(directory, f"heartbeat-rank-{os.environ.get('RANK', '0')}").write_text(f"{what}\n")
        except OSError:            # a full disk must not stop training here; the write that matters will say so
            pass


def die_with_parent(signum: int = signal.SIGTERM):
    """A `preexec_fn` for a child process: the kernel sends the child `signum` when this process dies
    (PR_SET_PDEATHSIG), so a kill -9 of the launcher or of `study run` leaves no rank behind (for a rank the signal
    is a preemption request: it saves and exits)."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl     # looked up here, not between fork and exec

    def arm() -> None:
        prctl(1, signum, 0, 0, 0)             # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:            # the parent died before the prctl
            os.kill(os.getpid(), signum)
    return arm


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


STARTUP_SHARE = 4   # a start-up ahead of its gate uses at most 1/STARTUP_SHARE of the host's cores per local rank


def gate_closed() -> bool:
    """Whether this rank was started ahead of its devices (study overlap_startup) and its gate is still closed."""
    gate = os.environ.get(START_GATE_ENV)
    return bool(gate) and not os.path.exists(gate)


@contextlib.contextmanager
def startup_threads(local_world_size: int, get_num_threads, set_num_threads) -> Iterator[int | None]:
    """While the gate is closed, build with torch intra-op threads limited to 1/STARTUP_SHARE of the cores (per
    local rank), then restore them: a start-up ahead runs beside another point's measured steps, whose host side
    (the launch thread, DeepSpeed's gradient hooks, the loader) must keep its cores. Yields the threads used
    (None: not ahead of a gate, nothing changed). torch's functions are passed in: no torch here."""
    if not gate_closed():
        yield None
        return
    before = get_num_threads()
    threads = max(1, usable_cores() // (STARTUP_SHARE * max(1, local_world_size)))
    set_num_threads(min(before, threads))
    try:
        yield min(before, threads)
    finally:
        set_num_threads(before)


def free_port() -> int:
    """A TCP port free on the loopback interface right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_rank_environ(rank: int, nproc: int, port: int, **extra: str) -> dict[str, str]:
    """This process's environment for local rank `rank` of `nproc` on this machine: the variables torchrun and the
    deepspeed launcher set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT),
    this checkout first on PYTHONPATH, and `extra`."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env
