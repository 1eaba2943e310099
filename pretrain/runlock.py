"""One launch per run directory: an exclusive lock on RUN_DIR/.pretrain.lock, and the output directory's checks.

    lock = acquire_run_lock(Path("runs/demo"))     # held until this process (and the ranks it hands it to) ends

The launching process (`pretrain`'s parent under `--nproc`, global rank 0 under torchrun / deepspeed / Slurm) takes
an `fcntl.flock` on the lock file for the run's life and passes the descriptor on to the ranks it spawns, so the
lock is held while any of them lives and the OS releases it when the last one dies (kill -9 included). A second
launch into the same --out (a fresh run, or a concurrent `--resume`) is refused in one line naming the holder's
pid and host. `study run` probes the lock before it clears a point's directory (`wait_until_unlocked`).
No torch here: the study imports it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.common import UserError, describe_os_error

LOCK_NAME = ".pretrain.lock"
TUNE_LOCK_NAME = ".tune.lock"
BYTES_PER_PARAMETER_SAVED = 16     # a checkpoint: weights (4 fp32 / 2 bf16) + fp32 master (4) + Adam moments (8)
# what transformers' save_pretrained writes for a T5 (one file, or shards and their index past its shard size)
HF_EXPORT_FILE = re.compile(r"(config|generation_config)\.json|model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def output_dir(path: str | os.PathLike, *, what: str, flag: str = "--out") -> Path:
    """Create `path` (and parents) as a directory this process can write, or raise one UserError saying why:
    an existing file, a read-only or full filesystem, no permission."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{path}: {flag} is an existing file, not a directory; pick a directory for the {what}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        raise UserError(f"{path}: cannot write the {what} there ({describe_os_error(err)}); pick another "
                        f"{flag}") from None
    return path


def export_may_replace(path: Path) -> bool:
    """Whether an export may replace the existing directory `path`: an empty one, or one `pretrain --export-hf`
    wrote (config.json and only the files HF's save_pretrained writes)."""
    names = [child.name for child in path.iterdir()]
    return not names or ("config.json" in names and all(HF_EXPORT_FILE.fullmatch(name) for name in names))


def check_export_dir(export: str | os.PathLike, *, keep: dict[str, str]) -> None:
    """--export-hf EXPORT before anything trains: refuse, in one line, a path whose replacement at the end would
    destroy something, i.e. `keep`'s paths ({flag: path}, e.g. the run directory and the shard set) or a directory
    around them, the inside of the shard set, an existing file, or a non-empty directory that is not an earlier
    export; and a place this process cannot write. An empty or missing directory, or an earlier export, is fine."""
    path = Path(export).resolve()
    for flag, kept in keep.items():
        if not kept or "://" in kept:
            continue
        kept_path = Path(kept).resolve()
        if path == kept_path or path in kept_path.parents or (flag == "--data" and kept_path in path.parents):
            raise UserError(f"{export}: --export-hf would replace or write into {flag} {kept}; pick a directory of "
                            f"its own, e.g. {Path(kept).parent / 'hf-export'} (nothing was changed)")
    if path.exists() and not path.is_dir():
        raise UserError(f"{export}: --export-hf is an existing file; pick a directory (nothing was changed)")
    if path.is_dir() and not export_may_replace(path):
        raise UserError(f"{export}: --export-hf is a directory holding other files than an HF export, which the "
                        f"export would replace; pick an empty or new directory (nothing was changed)")
    parent = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{export}: --export-hf cannot be written ({parent} is not writable here); pick another "
                        f"directory")


def check_free_space(path: Path, need_bytes: int, *, what: str, flag: str = "--out") -> None:
    """Refuse, before anything trains, a directory whose filesystem cannot hold `need_bytes` (one checkpoint)."""
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise UserError(f"{path}: {free / 2**20:.1f} MiB free on its filesystem, but {what} needs ~"
                        f"{need_bytes / 2**20:.1f} MiB; free space there or pick another {flag}")


class RunLock:
    """An exclusive flock on RUN_DIR/.pretrain.lock; `fd` is the descriptor to hand to spawned ranks."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)      # closes this process's reference; ranks holding a copy keep the lock
            self.fd = -1


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding the lock on `path`, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock_holder(run_dir: str | os.PathLike, name: str = LOCK_NAME) -> dict[str, Any] | None:
    """Who holds `run_dir`'s lock ({pid, host, since, command}), or None when nobody does (nothing is taken)."""
    path = Path(run_dir) / name
    if not path.is_file():
        return None
    try:
        fd = _try_lock(path)
    except OSError:               # unreadable: treat as free, the launch itself will say what is wrong
        return None
    if fd is not None:
        os.close(fd)
        return None
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


def describe_holder(holder: dict[str, Any]) -> str:
    since = holder.get("since")
    age = f", for {time.time() - since:.0f} s" if isinstance(since, (int, float)) else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{age}"


def acquire_run_lock(run_dir: str | os.PathLike, *, name: str = LOCK_NAME, what: str = "run directory",
                     holder_kind: str = "pretrain launch", flag: str = "--out") -> RunLock:
    """Take RUN_DIR's lock (creating the directory), or raise one UserError naming the launch that holds it.
    (`study tune` takes its directory's with name=TUNE_LOCK_NAME.)"""
    run_dir = output_dir(run_dir, what=what, flag=flag)
    path = run_dir / name
    try:
        fd = _try_lock(path)
    except OSError as err:
        raise UserError(f"{path}: cannot take the {what}'s lock ({describe_os_error(err)}); pick another "
                        f"{flag}") from None
    if fd is None:
        holder = lock_holder(run_dir, name) or {}
        raise UserError(f"{run_dir}: another {holder_kind} is using this {what} ({describe_holder(holder)}"
                        f"); wait for it to end, stop it, or pick another {flag}")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return RunLock(path, fd)


def wait_until_unlocked(run_dir: str | os.PathLike, timeout_s: float, *, say=print) -> None:
    """Wait up to `timeout_s` for the launch holding `run_dir` to end (a stopped study's point shutting down), then
    refuse in one line naming it."""
    holder = lock_holder(run_dir)
    if holder is None:
        return
    say(f"waiting up to {timeout_s:.0f} s for the launch holding {run_dir} ({describe_holder(holder)}) to end")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        holder = lock_holder(run_dir)
        if holder is None:
            return
    raise UserError(f"{run_dir}: still in use by a pretrain launch ({describe_holder(holder)}) after "
                    f"{timeout_s:.0f} s; stop it (kill {holder.get('pid', 'PID')}) and run the study again")
