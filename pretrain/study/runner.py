"""The sweep: one real `pretrain --config STUDY/runs/<point-id>/point.yaml` launch per grid point, in order,
each classified when it ends (ok, failed, oom, timeout) and recorded, then the report rebuilt.

    counts = run_study("configs/study/cpu-tiny.yaml", "studies/cpu-tiny")     # or: study run GRID --out DIR

The shard set is prepared once (`prep tokenizer` / `prep corpus`) when the grid gives a prep spec. Each point's
settings are written as runs/<point-id>/point.yaml (every TrainConfig field, data and out filled in) and its
launch's stdout/stderr go to logs/<point-id>.{out,err}; when it ends, runs/<point-id>/study_point.json (status,
reason, command, the point's settings) is written last, which is what marks the point finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import yaml

from pipeline.common import UserError, atomic_write_bytes, atomic_write_json
from pipeline.settings import to_yaml_values
from pretrain.config import TrainConfig
from pretrain.data import storage
from pretrain.launch import last_error_line
from pretrain.metrics import read_metrics
from pretrain.ranks import RESUMABLE_EXIT, START_GATE_ENV, die_with_parent, signal_name
from pretrain.runlock import output_dir, wait_until_unlocked
from pretrain.study.grid import SET_BY_STUDY, SKIP_STEPS_KEY, StudyGrid, StudySettings, as_list, load_grid
from pretrain.study.report import format_rate
from pretrain.study.results import (FINISHED_STATUSES, POINT_CONFIG, POINT_FILE, RUNS_DIR, STUDY_FILE,
                                    read_point_record, rebuild_report, summarize_metrics)

LOGS_DIR = "logs"
OUT_OF_SPACE = re.compile(r"no space left|filesystem is full|MiB free on its filesystem", re.IGNORECASE)
LOCKED_POINT_WAIT_S = 90.0   # a point dir still locked by a launch of an interrupted study: wait this long for it
CONSOLE_SCRIPT_MODULES = {"pretrain": "pretrain.cli", "prep": "pipeline.cli"}


def console_script(name: str) -> list[str]:
    """The command that runs one of this toolkit's console scripts: the one beside this Python first, then
    the one on PATH, else this Python running its module (a checkout on PYTHONPATH, as on GPU machines
    where the project is not pip-installed)."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file():
        return [str(beside)]
    found = shutil.which(name)
    if found:
        return [found]
    return [sys.executable, "-m", CONSOLE_SCRIPT_MODULES[name]]


def write_point_config(config: TrainConfig, header: str = "study point") -> Path:
    """runs/<point-id>/point.yaml: every TrainConfig field of the point (the file its launch reads)."""
    path = Path(config.out) / POINT_CONFIG
    text = (f"# {header}: point {path.parent.name}; launched as `pretrain --config {path}`\n"
            + yaml.safe_dump(to_yaml_values(config), sort_keys=False))
    atomic_write_bytes(path, text.encode())
    return path


def shared_settings(grid: StudyGrid, points: list[TrainConfig]) -> dict[str, Any]:
    """What every point shares, as study.json records it: the study's settings, skip_steps, and each pretrain
    setting that is no axis (its value in the first point)."""
    first = dataclasses.asdict(points[0])
    shared = {name: value for name, value in first.items() if name not in grid.axes and name not in SET_BY_STUDY}
    if "steady_skip" not in grid.axes:
        shared[SKIP_STEPS_KEY] = shared["steady_skip"]
    return {**shared, **dataclasses.asdict(grid.settings)}


# ----------------------------------------------------------------------------------------------- shard set

def _prep_flags(spec: dict[str, Any]) -> list[str]:
    """{input_length: 128, input: [a, b], quiet: true} -> ["--input-length", "128", "--input", "a", "b", "--quiet"]."""
    flags: list[str] = []
    for key, value in spec.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value not in (False, None):
            flags += [flag, *map(str, as_list(value))]
    return flags


def _run_prep(source: Path, subcommand: str, spec: dict[str, Any], out: Path) -> None:
    command = console_script("prep") + [subcommand, *_prep_flags(spec), "--out", str(out)]
    print(f"preparing once: {shlex.join(command)}", flush=True)
    # A local Ray cluster of its own unless the user points elsewhere (ray_address in the spec, or RAY_ADDRESS):
    # without this, ray.init() joins whatever cluster /tmp/ray/ray_current_cluster names on this machine.
    env = {**os.environ, "RAY_ADDRESS": os.environ.get("RAY_ADDRESS") or "local", "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run(command, stderr=subprocess.PIPE, text=True, env=env)
    if result.returncode != 0:
        why = ([line for line in result.stderr.splitlines() if line.strip()] or ["no output"])[-1].strip()
        raise UserError(f"{source}: `prep {subcommand}` failed ({why}); fix the data spec, or prepare the "
                        f"shards yourself and pass --data")


def shard_location(grid: StudyGrid, study_dir: Path, data_override: str | None) -> str | None:
    """Where the study's shard set is, or will be once prepared: --data, else the grid's path or URL, else the
    prep spec's `out` (default STUDY/shards); None when the grid has no data and none was passed."""
    if data_override:
        return data_override
    if grid.data is None or isinstance(grid.data, str):
        return grid.data
    return str(grid.data.get("out", study_dir / "shards"))


def prepare_shards(grid: StudyGrid, study_dir: Path, data_override: str | None) -> str:
    """The study's shard set: --data, else the grid's path or URL, else `prep corpus` run once into STUDY/shards.

    In a prep spec, `tokenizer` is a tokenizer.json path, or a mapping of `prep tokenizer` flags
    ({input: sample, vocab_size: 1024}) that is trained once into STUDY/tokenizer. Other keys are
    `prep corpus` flags (input_length: 128 -> --input-length 128).
    """
    shards = shard_location(grid, study_dir, data_override)
    if shards is None:
        raise UserError(f"{grid.source}: no data; add `data: shards/NAME` (or a prep spec) or pass --data SHARDS")
    if data_override or isinstance(grid.data, str):
        return shards
    spec = dict(grid.data)
    spec.pop("out", None)
    out = Path(shards)
    if (out / "manifest.json").is_file():
        return str(out)
    if isinstance(spec["tokenizer"], dict):
        tokenizer_dir = study_dir / "tokenizer"
        if not (tokenizer_dir / "tokenizer.json").is_file():
            _run_prep(grid.source, "tokenizer", spec["tokenizer"], tokenizer_dir)
        spec["tokenizer"] = str(tokenizer_dir / "tokenizer.json")
    _run_prep(grid.source, "corpus", spec, out)
    return str(out)


def check_study_dir(study_dir: Path, shards: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Load (or start) STUDY/study.json; refuse a second shard set in one study directory."""
    path = study_dir / STUDY_FILE
    if path.is_file():
        state = json.loads(path.read_text())
        if state["fingerprint"] != manifest["fingerprint"]:
            raise UserError(f"{path}: this study ran on shard set {state['fingerprint'][:12]} ({state['shards']}), "
                            f"not {manifest['fingerprint'][:12]} ({shards}); use another --out for other data")
        return state
    return {"fingerprint": manifest["fingerprint"], "shards": str(shards), "commands": []}


def record_study_start(grid: StudyGrid, points: list[TrainConfig], study_dir: Path, shards: str,
                       manifest: dict[str, Any], argv: list[str]) -> None:
    """Write STUDY/study.json: shard set, machine, grid, axes, shared settings, and this command appended (under a
    lock on logs/study.lock: two `study run`s started together each keep their command line)."""
    (study_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    with open(study_dir / LOGS_DIR / "study.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # released when the file closes
        _record_study_start(grid, points, study_dir, shards, manifest, argv)


def _record_study_start(grid: StudyGrid, points: list[TrainConfig], study_dir: Path, shards: str,
                        manifest: dict[str, Any], argv: list[str]) -> None:
    state = check_study_dir(study_dir, shards, manifest)
    machine = machine_info()
    earlier = state.get("machine")
    if earlier and (earlier.get("gpus"), earlier.get("cpus")) != (machine["gpus"], machine["cpus"]):
        print(f"note: earlier points of {study_dir} ran on another machine ({earlier.get('cpus')} CPUs, GPUs "
              f"{earlier.get('gpus') or 'none'}); their rows are not comparable with new ones", flush=True)
        state["earlier_machines"] = (state.get("earlier_machines") or []) + [earlier]
    state.update(study=grid.name, grid_file=str(grid.source), grid=yaml.safe_load(grid.source.read_text()),
                 shard_set=shard_summary(shards, manifest), machine=machine, axes=list(grid.axes),
                 base=shared_settings(grid, points))
    state["commands"] = (state.get("commands") or []) + [shlex.join(argv)]
    atomic_write_json(study_dir / STUDY_FILE, state)


def shard_summary(shards: str, manifest: dict[str, Any]) -> dict[str, Any]:
    config, totals = manifest.get("config", {}), manifest.get("totals", {})
    return {"path": str(shards), "fingerprint": manifest["fingerprint"],
            "examples": totals.get("examples"), "shards": totals.get("shards", len(manifest.get("shards", []))),
            "input_length": config.get("input_length"), "target_length": config.get("target_length"),
            "tokenizer_sha256": manifest.get("tokenizer", {}).get("sha256"),
            "vocab_size": manifest.get("tokenizer", {}).get("vocab_size")}


def machine_info() -> dict[str, Any]:
    """What the study ran on: OS, CPUs, RAM, GPUs (nvidia-smi when present), key package versions."""
    import psutil

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
                            "gpus": []}
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60)
        info["gpus"] = [line.strip() for line in query.stdout.splitlines() if line.strip()]
    for package in ("torch", "deepspeed"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    return info


# ------------------------------------------------------------------------------------------------ one point

@dataclass
class PointOutcome:
    status: str
    reason: str
    returncode: int | None
    wall_s: float


def classify(returncode: int | None, timed_out: bool, err_path: Path, run_dir: Path,
             timeout_s: float) -> tuple[str, str]:
    """(status, reason) of a finished launch: ok, oom (measured, or refused by the memory preflight),
    timeout or failed. The reason is pretrain's one-line error (its last stderr line that says why)."""
    if timed_out:
        return "timeout", f"no result within timeout_s={timeout_s:g}"
    if returncode is not None and returncode < 0:
        return "failed", f"pretrain killed by {signal_name(-returncode)}"
    if returncode == RESUMABLE_EXIT:
        return "failed", f"preempted (exit {RESUMABLE_EXIT}, a checkpoint saved): rerun with --retry-failed"
    reason = last_error_line(err_path)[:400] if returncode != 0 else ""
    if returncode == 0:
        summary = run_dir / "summary.json"
        if not summary.is_file() or not (run_dir / "metrics.jsonl").is_file():
            return "failed", "exited 0 but wrote no summary.json / metrics.jsonl"
        status = json.loads(summary.read_text()).get("status")
        return ("ok", "") if status == "ok" else ("failed", f"summary.json status {status!r}")
    if re.search(r"out of memory|outofmemory|\boom\b|cannot allocate memory|will not fit", reason, re.IGNORECASE):
        return "oom", reason or "out of memory"
    return "failed", reason or f"exit status {returncode}"


def _steps_done(metrics_path: Path) -> int:
    try:
        with open(metrics_path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _stop(*processes: subprocess.Popen) -> None:
    """Stop launched points (each its own process group, by id), all at once: SIGINT first, which pretrain turns
    into stopping the ranks it spawned (they run in their own sessions), then SIGTERM, then SIGKILL. Together, so
    that an interrupted study with a point running and the next one starting ahead is gone within one escalation
    (20 + 10 + 10 s at most), not one per launch: a `timeout -k` around the study must not kill it first."""
    for sig, wait_s in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        live = [process for process in processes if process.poll() is None]
        if not live:
            return
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait_s
        for process in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))


class PointLaunch:
    """One running `pretrain` launch of a point; stdout/stderr go to log_dir/<id>.{out,err}.

    With `gate` (overlap_startup), the launch starts early: its ranks do their host-side start-up (imports,
    preflight, the model build) and wait for the gate file, which `open_gate()` creates once the devices are
    free. The wall time and the timeout count from the gate's opening."""

    def __init__(self, command: list[str], run_dir: Path, log_dir: Path, gate: Path | None = None):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.gate = run_dir, gate
        self.err_path = log_dir / f"{run_dir.name}.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if gate is not None:
            gate.unlink(missing_ok=True)
            env[START_GATE_ENV] = str(gate)
        self.launched = time.monotonic()
        self.started = self.launched if gate is None else None
        with open(log_dir / f"{run_dir.name}.out", "wb") as out_log, open(self.err_path, "wb") as err_log:
            # its own session (stopped as a group), and it dies with the study: a kill -9 of `study run` sends it
            # SIGTERM, which pretrain forwards to its ranks (they save and exit)
            self.process = subprocess.Popen(command, stdout=out_log, stderr=err_log, start_new_session=True,
                                            env=env, preexec_fn=die_with_parent(signal.SIGTERM))

    def open_gate(self) -> float:
        """Let the launch use the devices; returns the seconds of its start-up that ran ahead of the gate."""
        self.started = time.monotonic()
        if self.gate is not None:
            self.gate.parent.mkdir(parents=True, exist_ok=True)
            self.gate.touch()
        return self.started - self.launched

    def wait(self, timeout_s: float, steps: int, prefix: str) -> PointOutcome:
        """Wait for the launch to end (stopping it past timeout_s) and classify how it ended."""
        if self.started is None:
            self.open_gate()
        live = sys.stdout.isatty()
        timed_out = False
        while True:
            try:
                self.process.wait(timeout=2.0)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - self.started
                if elapsed > timeout_s:
                    timed_out = True
                    _stop(self.process)
                    break
                if live:
                    done = _steps_done(self.run_dir / "metrics.jsonl")
                    print(f"\r{prefix} ... step {done}/{steps} {elapsed:.0f}s", end="", flush=True)
        self.stop()     # (interrupted, the sweep stops this launch together with the one started ahead)
        status, reason = classify(self.process.returncode, timed_out, self.err_path, self.run_dir, timeout_s)
        return PointOutcome(status, reason, self.process.returncode, time.monotonic() - self.started)

    def stop(self, *others: "PointLaunch") -> None:
        """Stop this launch and `others` together (_stop); remove their start gates."""
        launches = (self, *others)
        _stop(*(launch.process for launch in launches))
        for launch in launches:
            if launch.gate is not None:
                launch.gate.unlink(missing_ok=True)




# ----------------------------------------------------------------------------------------------- the sweep

def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _json_values(config: TrainConfig) -> dict[str, Any]:
    """A config's settings as a point record keeps them (JSON: lists, not tuples)."""
    return json.loads(json.dumps(to_yaml_values(config)))


@functools.cache
def _default_values() -> dict[str, Any]:
    """Every TrainConfig setting's default, as JSON values (a point record lacking a setting ran with it)."""
    return _json_values(TrainConfig(data="-", out="-"))


def changed_settings(record: dict[str, Any], config: TrainConfig) -> list[str]:
    """The settings a finished point ran with that its grid now sets otherwise, as `steps: 3 -> 4`. data and out
    are left aside (the shard set is checked by its fingerprint, and a study directory may move); a setting the
    record lacks (one pretrain gained since) counts as its default."""
    before, now = record.get("config") or {}, _json_values(config)
    defaults = _default_values()
    return [f"{name}: {json.dumps(before.get(name, defaults[name]))} -> {json.dumps(value)}"
            for name, value in now.items()
            if name not in SET_BY_STUDY and before.get(name, defaults[name]) != value]


def refuse_changed_points(sweep_dir: Path, points: list[TrainConfig], retry_failed: bool) -> None:
    """A rerun skips the points that finished; one that finished with other settings than it has now (an edited
    grid) would have its old result reported as the new one's, and relaunching it would delete that result: refuse,
    naming the point and the settings, before anything launches."""
    changed = []
    for config in points:
        record = read_point_record(Path(config.out))
        if record and (record["status"] == "ok" or not retry_failed):
            diff = changed_settings(record, config)
            if diff:
                changed.append((Path(config.out).name, diff))
    if changed:
        (point_id, diff), others = changed[0], len(changed) - 1
        remove = (f"remove their run dirs under {sweep_dir / RUNS_DIR} to run them" if others else
                  f"remove {sweep_dir / RUNS_DIR / point_id} to run it")
        raise UserError(f"{sweep_dir}: point {point_id} finished with other settings than it has now "
                        f"({', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''})"
                        + (f", and so did {others} other point{'s' if others > 1 else ''}" if others else "")
                        + f"; use another --out for the new settings, or {remove} again here")


class PointClaims:
    """This sweep's holds on its points: an flock on logs/<point-id>.lock, from before a point's run dir is cleared
    until its record is written. A second `study run` on the same directory waits for the point, then finds it
    finished and skips it, instead of clearing its run dir and launching it again."""

    def __init__(self, study_dir: Path):
        self.dir = study_dir / LOGS_DIR
        self.held: dict[str, int] = {}

    def take(self, point_id: str, *, wait: bool) -> bool:
        """Hold the point; without `wait`, False when another sweep holds it."""
        if point_id in self.held:
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / f"{point_id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    os.close(fd)
                    return False
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid ?"
                print(f"waiting for another study run ({holder}) that is running point {point_id}", flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {platform.node()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.held[point_id] = fd
        return True

    def release(self, point_id: str) -> None:
        fd = self.held.pop(point_id, None)
        if fd is not None:
            os.close(fd)

    def release_all(self) -> None:
        for point_id in list(self.held):
            self.release(point_id)


def _dry_run(grid: StudyGrid, points: list[TrainConfig], runs: Path, retry_failed: bool) -> dict[str, Any]:
    """List the points, their launches and the settings each sets off its default; prepare and launch nothing."""
    refuse_changed_points(runs.parent, points, retry_failed)
    defaults = to_yaml_values(TrainConfig(data="-", out="-"))
    sweep = grid_sweep(grid, runs.parent, fingerprint="")
    for index, config in enumerate(points, 1):
        record = read_point_record(Path(config.out))
        state = f"  [done: {record['status']}]" if record else ""
        settings = " ".join(f"{name}={value}" for name, value in to_yaml_values(config).items()
                            if value != defaults[name] and name not in SET_BY_STUDY)
        print(f"[{index}/{len(points)}] {sweep.label(config)}{state}\n    {shlex.join(sweep.command(config))}"
              f"\n    point.yaml: {settings}")
    print(f"dry run: {len(points)} points, nothing launched")
    return {"points": len(points), "launched": 0}


@dataclass
class Sweep:
    """How the points of one study directory are launched: everything `run_points` needs beside the points.

    `label(config)` is the progress label and `values(config)` the axis values a record keeps; a point's id is its
    run directory's name (config.out = STUDY/runs/<id>)."""

    study_dir: Path
    settings: StudySettings
    fingerprint: str
    label: Callable[[TrainConfig], str]
    values: Callable[[TrainConfig], dict[str, Any]]
    pretrain_command: list[str] | None = None
    repeat_of: Callable[[TrainConfig], tuple[str, int]] = StudyGrid.repeat_of
    """(the point's id, which run of it): repeats of one point share the id, their results are grouped."""
    header: str = "study point"
    """The first line of each point.yaml (a comment): which study and file the point comes from."""

    def command(self, config: TrainConfig) -> list[str]:
        """The launch of one point: the pretrain command and `--config` its point.yaml, nothing else."""
        return [*(self.pretrain_command or console_script("pretrain")), "--config",
                str(Path(config.out) / POINT_CONFIG)]


def new_counts(points: int = 0) -> dict[str, int]:
    return {status: 0 for status in FINISHED_STATUSES} | {"points": points, "skipped": 0, "launched": 0}


def run_points(sweep: Sweep, points: list[TrainConfig], *, retry_failed: bool = False,
               counts: dict[str, int] | None = None, numbering: tuple[int, int] | None = None,
               ) -> list[dict[str, Any]]:
    """Launch each unfinished point (one real `pretrain --config runs/<id>/point.yaml` each) in order, classify
    and record it (runs/<id>/study_point.json, written last), and return every point's record, finished earlier
    or now, in the order given. A point finished earlier (ok, or failed and not `retry_failed`) is skipped.
    `counts` (see new_counts) is updated in place; `numbering` = (first index, total) for the progress lines.
    With settings.overlap_startup the next point's launch starts while the current one trains (not beside an
    offload point). Ctrl-C / SIGTERM stop the current launch; a lack of space stops the sweep (UserError)."""
    counts = counts if counts is not None else new_counts(len(points))
    first, total = numbering or (1, len(points))
    refuse_changed_points(sweep.study_dir, points, retry_failed)
    records: dict[int, dict[str, Any]] = {}
    todo: list[tuple[int, TrainConfig, dict[str, Any] | None]] = []     # with the record read now, if any
    for position, config in enumerate(points):
        index = first + position
        previous = read_point_record(Path(config.out))
        if previous and (previous["status"] == "ok" or not retry_failed):
            counts["skipped"] += 1
            counts[previous["status"]] += 1
            records[position] = previous
            print(f"[{index}/{total}] {sweep.label(config)} ... skipped ({previous['status']} earlier)", flush=True)
        else:
            todo.append((position, config, previous))
    claims = PointClaims(sweep.study_dir)

    def finished_meanwhile(config: TrainConfig, previous: dict[str, Any] | None) -> dict[str, Any] | None:
        """The point's record if another sweep on this directory finished it since it was read above."""
        now = read_point_record(Path(config.out))
        if now is None or now == previous:
            return None
        diff = changed_settings(now, config)
        if diff:
            raise UserError(f"{sweep.study_dir}: another study run finished point {Path(config.out).name} meanwhile, "
                            f"with other settings ({', '.join(diff[:4])}); use another --out for these")
        return now

    def start(config: TrainConfig, gated: bool) -> PointLaunch:
        run_dir = Path(config.out)
        if run_dir.exists():  # a failed or interrupted earlier attempt of this point: start it afresh
            # ... once no launch of it is left (an interrupted study's point may still be saving and exiting)
            wait_until_unlocked(run_dir, LOCKED_POINT_WAIT_S)
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        write_point_config(config, sweep.header)
        gate = sweep.study_dir / LOGS_DIR / f"{run_dir.name}.gate" if gated else None
        return PointLaunch(sweep.command(config), run_dir, sweep.study_dir / LOGS_DIR, gate)

    ahead: PointLaunch | None = None     # the next point, launched early and waiting at its start gate
    current: PointLaunch | None = None
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)   # SIGTERM stops the point as Ctrl-C does
    try:
        for place, (position, config, previous) in enumerate(todo):
            index = first + position
            run_dir = Path(config.out)
            prefix = f"[{index}/{total}] {sweep.label(config)}"
            if ahead is None:
                # held from here until its record is written; another study run launching it is waited for
                claims.take(run_dir.name, wait=True)
                done = finished_meanwhile(config, previous)
                if done is not None:
                    claims.release(run_dir.name)
                    counts["skipped"] += 1
                    counts[done["status"]] += 1
                    records[position] = done
                    print(f"{prefix} ... skipped ({done['status']}: another study run finished it meanwhile)",
                          flush=True)
                    continue
                current = start(config, gated=False)
            else:
                current = ahead     # launched early for this point (and held since)
            ahead = None
            hidden_s = current.open_gate()
            if sweep.settings.overlap_startup and config.offload == "none" and place + 1 < len(todo):
                # offload points keep the host's cores to themselves (CPU Adam): nothing starts beside them; nor
                # beside a point another study run holds (it is waited for in its turn)
                _, following, following_previous = todo[place + 1]
                if claims.take(Path(following.out).name, wait=False):
                    if finished_meanwhile(following, following_previous) is None:
                        ahead = start(following, gated=True)
                    else:
                        claims.release(Path(following.out).name)
            if not sys.stdout.isatty():
                print(f"{prefix} ...", end="", flush=True)
            outcome = current.wait(sweep.settings.timeout_s, config.steps, prefix)
            config_id, run = sweep.repeat_of(config)
            record = {"point_id": run_dir.name, "point": sweep.values(config), "order": index,
                      "config_id": config_id, "repeat": run,
                      "status": outcome.status, "reason": outcome.reason, "returncode": outcome.returncode,
                      "wall_s": round(outcome.wall_s, 2), "startup_ahead_s": round(hidden_s, 2),
                      "command": current.process.args, "config": to_yaml_values(config),
                      "study": dataclasses.asdict(sweep.settings), "fingerprint": sweep.fingerprint}
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_dir / POINT_FILE, record)
            claims.release(run_dir.name)
            records[position] = record
            counts[outcome.status] += 1
            counts["launched"] += 1
            if outcome.status == "failed" and OUT_OF_SPACE.search(outcome.reason):
                # every later point would fail the same way: stop the sweep, keep what is finished
                raise UserError(f"{sweep.study_dir}: point {run_dir.name} failed for lack of space "
                                f"({outcome.reason}); free space there and run the study again (finished points "
                                f"are kept)")
            ahead_note = f", {hidden_s:.0f}s of start-up ahead" if hidden_s >= 0.5 else ""
            if outcome.status == "ok":
                medians = summarize_metrics(read_metrics(run_dir / "metrics.jsonl"), config.steady_skip)
                result = f"{format_rate(medians.get('tokens_per_s'))} ({outcome.wall_s:.0f}s{ahead_note})"
            else:
                result = f"{outcome.status.upper()}: {outcome.reason} ({outcome.wall_s:.0f}s{ahead_note})"
            print(f"\r{prefix} ... {result}" if sys.stdout.isatty() else f" {result}", flush=True)
    finally:     # interrupted (Ctrl-C, SIGTERM, a timeout around the study): no launch outlives the sweep
        signal.signal(signal.SIGTERM, previous_sigterm)
        launches = [launch for launch in (current, ahead) if launch is not None]
        if launches:
            launches[0].stop(*launches[1:])
        claims.release_all()
    return [records[position] for position in sorted(records)]


def _run_label(run: int) -> str:
    return f" (run {run})" if run > 1 else ""


def grid_sweep(grid: StudyGrid, study_dir: Path, fingerprint: str) -> Sweep:
    """The Sweep of a grid file's points."""
    return Sweep(study_dir=study_dir, settings=grid.settings, fingerprint=fingerprint,
                 label=lambda config: grid.label(config) + _run_label(grid.repeat_of(config)[1]),
                 values=grid.point_values, pretrain_command=grid.pretrain_command,
                 header=f"study {grid.name}, from {grid.source}")


def run_study(grid_path: str | os.PathLike, study_dir: str | os.PathLike, *, data: str | None = None,
              dry_run: bool = False, retry_failed: bool = False, argv: list[str] | None = None) -> dict[str, Any]:
    """Run every unfinished point of a grid, then rebuild results.csv, report.md and the plots.

    Returns counts {points, ok, failed, oom, timeout, skipped, launched}.
    """
    grid = load_grid(grid_path)
    study_dir = Path(study_dir)
    runs = study_dir / RUNS_DIR
    if dry_run:
        return _dry_run(grid, grid.points(shard_location(grid, study_dir, data) or "SHARDS", runs), runs,
                        retry_failed)

    output_dir(study_dir, what="study", flag="study run --out")
    shards = prepare_shards(grid, study_dir, data)
    points = grid.points(shards, runs)
    # For a URL (s3://...) only the manifest is read here: each point's loader mode decides how the shards come
    # (`shards` copies the set into the cache once and later launches reuse it; `remote` streams it from cold).
    manifest = storage.read_shard_set_manifest(shards)
    refuse_changed_points(study_dir, points, retry_failed)      # before study.json takes the edited grid
    record_study_start(grid, points, study_dir, shards, manifest,
                       argv or ["study", "run", str(grid_path), "--out", str(study_dir)])

    counts = new_counts(len(points))
    sweep_start = time.monotonic()
    run_points(grid_sweep(grid, study_dir, manifest["fingerprint"]), points, retry_failed=retry_failed,
               counts=counts)

    written = rebuild_report(study_dir)
    elapsed = time.monotonic() - sweep_start
    print(f"study {grid.name}: {counts['points']} points: {counts['ok']} ok, {counts['oom']} oom, "
          f"{counts['failed']} failed, {counts['timeout']} timeout ({counts['skipped']} skipped as finished, "
          f"{counts['launched']} launched) in {elapsed / 60:.1f} min")
    print(f"results: {written['csv']}\nreport:  {written['md']}\nplots:   "
          + ", ".join(str(p) for p in written["plots"]))
    return counts
