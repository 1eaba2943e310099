"""One launch per run directory, and `pretrain` / `study run` against outputs they cannot use.

    .venv/bin/python -m pytest tests/pretrain/test_run_lock.py -q

- the lock: a second launch into a running run's --out (fresh, or --resume) is refused in one line naming the
  holder's pid and host; a kill -9 of the launcher leaves no rank behind (they get SIGTERM, save and exit) and
  frees the lock when the last one ends.
- --out an existing file, on a read-only filesystem, on a full one (a 2 MiB tmpfs): one line, exit 2, no traceback,
  nothing in the way removed; the same for `study run --out`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launching import TRAIN as LAUNCH_TRAIN
from launching import Launch, child_env, no_process_left
from pipeline.common import REPO_ROOT, UserError
from pretrain.runlock import (LOCK_NAME, acquire_run_lock, check_export_dir, lock_holder, output_dir,
                              wait_until_unlocked)

TRAIN = ["--model", "t5-tiny", "--steps", "4", "--micro-batch", "2", "--global-batch", "4"]


def run(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = child_env(RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO_ROOT)


def lock_file_holders(out: Path) -> list[str]:
    """Processes with the run's lock file open (for a failure message)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(str(out / LOCK_NAME) in os.readlink(fd) for fd in (proc / "fd").iterdir()):
                found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes().replace(bytes(1), b' ')[:200]!r}")
        except OSError:
            continue
    return found


def one_line_refusal(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 2, f"{result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_the_lock_refuses_a_second_holder_and_frees_itself_when_the_holder_dies(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from pretrain.runlock import acquire_run_lock; acquire_run_lock(sys.argv[2]); "
                               "print('held', flush=True); time.sleep(60)", str(REPO_ROOT), str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"pid {holder.pid} on host {socket.gethostname()}"):
            acquire_run_lock(run_dir)
        assert lock_holder(run_dir)["pid"] == holder.pid
        with pytest.raises(UserError, match="still in use by a pretrain launch"):
            wait_until_unlocked(run_dir, 0.6, say=lambda _: None)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock_holder(run_dir) is None                # the OS released it
    lock = acquire_run_lock(run_dir)
    assert (run_dir / LOCK_NAME).is_file()
    lock.release()


def test_a_second_launch_into_a_running_run_is_refused_and_the_launchers_death_ends_its_ranks(tiny_shards, tmp_path):
    out = tmp_path / "busy"
    first = Launch(tiny_shards, out, "--steps", "400", "--save-every", "1")
    first.wait_for_step(2)                               # a complete checkpoint exists: a --resume would start
    # a fresh launch is refused by the run it finds (the lock covers two launches that both start fresh);
    # a concurrent --resume is refused by the lock, naming the holder
    fresh = run("pretrain.cli", *TRAIN, "--data", str(tiny_shards), "--out", str(out))
    one_line_refusal(fresh, "already holds a run")
    resume = run("pretrain.cli", *LAUNCH_TRAIN, "--steps", "400", "--data", str(tiny_shards), "--out", str(out),
                 "--resume")
    one_line_refusal(resume, "another pretrain launch is using this run directory",
                     f"pid {first.process.pid} on host {socket.gethostname()}")
    first.process.send_signal(signal.SIGKILL)           # the launcher dies; its ranks get SIGTERM (PDEATHSIG)
    first.process.wait()
    no_process_left(out, within_s=60)
    deadline = time.monotonic() + 30
    while lock_holder(out) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lock_holder(out) is None, f"{lock_holder(out)}; holders: {lock_file_holders(out)}"
    assert "preempted" in (out / "summary.json").read_text()     # they saved a checkpoint on the way out


def test_outputs_that_cannot_be_used_are_refused_in_one_line(tiny_shards, tmp_path, tmpfs):
    a_file = tmp_path / "a-file"
    a_file.write_text("precious\n")
    read_only = tmpfs("ro", "ro,size=1m")
    full = tmpfs("full", "size=2m")
    (full / "filler").write_bytes(b"\0" * (1 << 20))
    cases = [(a_file, "is an existing file"), (read_only / "run", "Read-only file system"),
             (full / "run", "free on its filesystem, but one checkpoint needs")]
    for out, needle in cases:
        one_line_refusal(run("pretrain.cli", *TRAIN, "--data", str(tiny_shards), "--out", str(out)), str(out), needle)
    assert a_file.read_text() == "precious\n" and (full / "filler").stat().st_size == 1 << 20
    grid = tmp_path / "grid.yaml"
    grid.write_text("name: t\nbase: {steps: 4, skip_steps: 1, global_batch: 4}\ngrid: {model: t5-tiny, micro_batch: 2}\n")
    cases[2] = (full / "study", "failed for lack of space")
    for out, needle in cases:
        one_line_refusal(run("pretrain.study.cli", "run", str(grid), "--data", str(tiny_shards), "--out", str(out)),
                         str(out), needle)
    assert a_file.read_text() == "precious\n"
    with pytest.raises(UserError, match="is an existing file"):
        output_dir(a_file, what="run directory")


def test_an_export_that_would_replace_what_the_user_has_is_refused_before_anything_trains(tiny_shards, tmp_path,
                                                                                         tmpfs):
    """--export-hf replaces its directory at the end of the run: the shard set, the run directory or a directory
    around it, the inside of the shard set, a file, a directory of other files, or a read-only place are refused
    in one line before the launch, and each is left as it was."""
    before = sorted(p.name for p in tiny_shards.iterdir())
    out = tmp_path / "runs" / "run"
    a_file = tmp_path / "a-file"
    a_file.write_text("precious\n")
    mywork = tmp_path / "mywork"
    mywork.mkdir()
    (mywork / "notes.txt").write_text("precious\n")
    cases = [(tiny_shards, "--data"), (tiny_shards / "hf", "--data"), (out, "--out"), (out.parent, "--out"),
             (a_file, "is an existing file"), (mywork, "holding other files"),
             (tmpfs("ro", "ro,size=1m") / "hf", "cannot be written")]
    for export, needle in cases:
        one_line_refusal(run("pretrain.cli", *TRAIN, "--data", str(tiny_shards), "--out", str(out), "--export-hf",
                             str(export)), str(export), needle)
        assert not (out / "metrics.jsonl").exists()
    assert sorted(p.name for p in tiny_shards.iterdir()) == before
    assert a_file.read_text() == (mywork / "notes.txt").read_text() == "precious\n"
    check_export_dir(out / "hf", keep={"--out": str(out), "--data": str(tiny_shards)})   # its own directory: fine
