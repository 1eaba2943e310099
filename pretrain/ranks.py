"""Where this process sits in a `pretrain` job: the rank environment and the start gate.

    env = rank_env()      # RANK / LOCAL_RANK / WORLD_SIZE as torchrun, the deepspeed launcher or `--nproc` set them

Every rank runs one code path whatever started it. `pretrain.launch` spawns local ranks with the variables of
`local_rank_environ`. No torch or DeepSpeed here: the study and the spawner read these without them
(`pretrain.trainer.init_rank` makes the rank's process group).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from pipeline.common import REPO_ROOT

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


def local_rank_environ(rank: int, nproc: int, port: int, **extra: str) -> dict[str, str]:
    """This process's environment for local rank `rank` of `nproc` on this machine: the variables torchrun and the
    deepspeed launcher set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT),
    this checkout first on PYTHONPATH, and `extra`."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env
