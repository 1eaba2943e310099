"""The ZeRO x data-loading study: expand a grid, launch one real `pretrain` per point, collect the results.

    study run configs/study/cpu-tiny.yaml --out studies/cpu-tiny

A grid file (YAML) holds the shared shard set (`data`: a path, or a `prep corpus` spec the study prepares once),
the base pretrain settings every point shares (`base`), the grid axes (`grid`) and `exclude` / `include` rules.
Each point is one `pretrain` subprocess writing studies/NAME/runs/<point-id>/; when it ends, the study writes
runs/<point-id>/study_point.json (status, reason, command) last, which is what marks the point finished.
"""

from __future__ import annotations

import itertools
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
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import UserError, atomic_write_json
from pipeline.shard_format import read_manifest
from pretrain import launch, report, storage
from pretrain.metrics import read_metrics, steady_state_figures

AXES = ("model", "zero", "offload", "micro_batch", "loader_workers", "nproc", "activation_checkpointing")
AXIS_DEFAULTS: dict[str, list[Any]] = {"offload": ["none"], "loader_workers": [0], "nproc": [1],
                                       "activation_checkpointing": [False]}
OFFLOADS = ("none", "cpu", "nvme")
STUDY_FILE = "study.json"
POINT_FILE = "study_point.json"
RUNS_DIR = "runs"
LOGS_DIR = "logs"
FINISHED_STATUSES = ("ok", "failed", "oom", "timeout")


@dataclass
class BaseSettings:
    """Pretrain settings every point of a study shares (the `base` section of a grid file)."""

    steps: int = 20
    skip_steps: int = 5
    """Steps at the start excluded from the medians (allocator, loader and kernel warm-up)."""
    global_batch: int = 8
    lr: float | None = None
    warmup_steps: int | None = None
    """Learning-rate warm-up steps passed to pretrain (not the measurement warm-up: that is `skip_steps`)."""
    schedule: str | None = None
    precision: str | None = None
    """bf16 or fp32; None leaves the pretrain default."""
    seed: int = 0
    timeout_s: float = 1800.0
    """Wall-clock limit per point; a point past it is killed and recorded as a timeout."""
    nvme_path: str | None = None
    overlap_startup: bool = False
    """Launch the next point while the current one trains: its host-side start-up (imports, preflight, model
    build) runs ahead and it waits at a start gate until the devices are free. Saves much of each launch's fixed
    cost on GPU grids; measured steps never overlap. Off by default: on a few-core host (the CPU grids) the early
    start-up would compete with the measured steps for the cores. Never used beside an offload point."""
    extra_args: list[str] = field(default_factory=list)
    """Further pretrain flags, passed as given to every point."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.global_batch < 1:
            raise ValueError(f"steps and global_batch must be >= 1, got {self.steps} and {self.global_batch}")
        if not 0 <= self.skip_steps < self.steps:
            raise ValueError(f"skip_steps must be in [0, steps={self.steps}) so some steps are measured, "
                             f"got {self.skip_steps}")
        if self.precision not in (None, "bf16", "fp32"):
            raise ValueError(f"precision must be bf16 or fp32, got {self.precision!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not isinstance(self.overlap_startup, bool):
            raise ValueError(f"overlap_startup must be true or false, got {self.overlap_startup!r}")
        if not isinstance(self.extra_args, list) or not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError("extra_args must be a list of strings")


@dataclass(frozen=True)
class Point:
    """One grid point: the values of every axis."""

    model: str
    zero: int
    offload: str
    micro_batch: int
    loader_workers: int
    nproc: int
    activation_checkpointing: bool

    @property
    def point_id(self) -> str:
        """Directory-safe id, e.g. mt5-base-z2-cpu-mb8-w4-n2 (+ -ac with activation checkpointing)."""
        model = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model)
        ident = (f"{model}-z{self.zero}-{self.offload}-mb{self.micro_batch}-w{self.loader_workers}"
                 f"-n{self.nproc}")
        return ident + ("-ac" if self.activation_checkpointing else "")

    @property
    def label(self) -> str:
        """Progress label, e.g. "mt5-base zero=2 offload=cpu mb=8 w=4 n=2"."""
        text = (f"{self.model} zero={self.zero} offload={self.offload} mb={self.micro_batch} "
                f"w={self.loader_workers} n={self.nproc}")
        return text + (" ckpt" if self.activation_checkpointing else "")


@dataclass
class StudyGrid:
    """A parsed grid file."""

    name: str
    source: Path
    data: str | dict[str, Any] | None
    base: BaseSettings
    axes: dict[str, list[Any]]
    exclude: list[dict[str, Any]]
    include: list[dict[str, Any]]
    pretrain_command: list[str] | None = None

    def points(self) -> list[Point]:
        """The grid's points: the product of the axes, minus `exclude` matches, plus `include` entries.

        An `exclude` rule removes every point whose values match all its keys (a list value matches any of
        its items). An `include` entry is a small grid of its own (scalars or lists); axes it does not name
        take their first grid value. Order: product order, then includes; duplicates are dropped.
        """
        product = [dict(zip(AXES, values)) for values in itertools.product(*(self.axes[a] for a in AXES))]
        chosen = [p for p in product if not any(_matches(p, rule) for rule in self.exclude)]
        for entry in self.include:
            sub_axes = {a: _as_list(entry.get(a, self.axes[a][0])) for a in AXES}
            chosen += [dict(zip(AXES, values)) for values in itertools.product(*(sub_axes[a] for a in AXES))]
        unique: dict[str, Point] = {}
        for values in chosen:
            point = _make_point(values, self.source)
            unique.setdefault(point.point_id, point)
        return list(unique.values())


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _matches(values: dict[str, Any], rule: dict[str, Any]) -> bool:
    return all(values[key] in _as_list(allowed) for key, allowed in rule.items())


def _make_point(values: dict[str, Any], source: Path) -> Point:
    try:
        point = Point(model=str(values["model"]), zero=int(values["zero"]), offload=str(values["offload"]),
                      micro_batch=int(values["micro_batch"]), loader_workers=int(values["loader_workers"]),
                      nproc=int(values["nproc"]),
                      activation_checkpointing=bool(values["activation_checkpointing"]))
    except (TypeError, ValueError) as err:
        raise UserError(f"{source}: bad grid value in {values} ({err}); axes take ints, strings and booleans")
    if point.zero not in (0, 1, 2, 3):
        raise UserError(f"{source}: zero must be 0-3, got {point.zero}")
    if point.offload not in OFFLOADS:
        raise UserError(f"{source}: offload must be one of {OFFLOADS}, got {point.offload!r}")
    return point


def load_grid(path: str | os.PathLike) -> StudyGrid:
    """Read and check a grid file; any problem raises `UserError` naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such grid file; see configs/study/ for examples")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML ({str(err).splitlines()[0]}); fix the syntax")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping with name, data, base, grid; see configs/study/cpu-tiny.yaml")
    known = {"name", "description", "data", "base", "grid", "exclude", "include", "pretrain_command"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"{path}: unknown keys {unknown}; allowed: {sorted(known)}")

    base_raw = raw.get("base") or {}
    base_fields = {f.name for f in fields(BaseSettings)}
    bad = sorted(set(base_raw) - base_fields)
    if bad:
        raise UserError(f"{path}: unknown base settings {bad}; allowed: {sorted(base_fields)}")
    try:
        base = BaseSettings(**base_raw)
    except (TypeError, ValueError) as err:
        raise UserError(f"{path}: base: {err}")

    grid_raw = raw.get("grid") or {}
    bad = sorted(set(grid_raw) - set(AXES))
    if bad:
        raise UserError(f"{path}: unknown grid axes {bad}; axes are {list(AXES)}")
    axes: dict[str, list[Any]] = {}
    for axis in AXES:
        values = _as_list(grid_raw.get(axis, AXIS_DEFAULTS.get(axis, [])))
        if not values:
            raise UserError(f"{path}: grid.{axis} is required (a value or a list of values)")
        axes[axis] = values

    rules: dict[str, list[dict[str, Any]]] = {}
    for key in ("exclude", "include"):
        entries = raw.get(key) or []
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise UserError(f"{path}: {key} must be a list of mappings like {{zero: [0, 1], offload: cpu}}")
        for entry in entries:
            if set(entry) - set(AXES):
                raise UserError(f"{path}: {key} entry {entry} names unknown axes {sorted(set(entry) - set(AXES))}")
        rules[key] = entries

    data = raw.get("data")
    if data is not None and not isinstance(data, (str, dict)):
        raise UserError(f"{path}: data must be a shard-set path or a prep spec {{input: ..., tokenizer: ...}}")
    if isinstance(data, dict) and ("input" not in data or "tokenizer" not in data):
        raise UserError(f"{path}: a data prep spec needs input and tokenizer (it is passed to `prep corpus`)")
    command = raw.get("pretrain_command")
    if command is not None and (not isinstance(command, list) or not all(isinstance(c, str) for c in command)):
        raise UserError(f"{path}: pretrain_command must be a list of strings, e.g. [deepspeed, -m, pretrain.cli]")
    grid = StudyGrid(name=str(raw.get("name") or path.stem), source=path, data=data, base=base, axes=axes,
                     exclude=rules["exclude"], include=rules["include"], pretrain_command=command)
    if not grid.points():
        raise UserError(f"{path}: the grid has no points left after exclude; loosen the exclude rules")
    return grid


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


def pretrain_command(grid: StudyGrid, point: Point, shards: str | Path, run_dir: Path) -> list[str]:
    """The `pretrain` command line of one point (interface 5)."""
    base = grid.base
    command = list(grid.pretrain_command or console_script("pretrain"))
    command += ["--zero", str(point.zero), "--offload", point.offload, "--model", point.model,
                "--data", str(shards), "--out", str(run_dir), "--steps", str(base.steps),
                "--micro-batch", str(point.micro_batch), "--global-batch", str(base.global_batch),
                "--loader-workers", str(point.loader_workers), "--nproc", str(point.nproc),
                "--seed", str(base.seed), "--steady-skip", str(base.skip_steps)]
    for flag, value in (("--lr", base.lr), ("--warmup-steps", base.warmup_steps), ("--schedule", base.schedule)):
        if value is not None:
            command += [flag, str(value)]
    if base.precision:
        command.append(f"--{base.precision}")
    if point.activation_checkpointing:
        command.append("--activation-checkpointing")
    if point.offload == "nvme":
        if not base.nvme_path:
            raise UserError(f"{grid.source}: offload nvme needs base.nvme_path (a directory on a fast local disk)")
        command += ["--nvme-path", base.nvme_path]
    return command + base.extra_args


# ----------------------------------------------------------------------------------------------- shard set

def _prep_flags(spec: dict[str, Any]) -> list[str]:
    """{input_length: 128, input: [a, b], quiet: true} -> ["--input-length", "128", "--input", "a", "b", "--quiet"]."""
    flags: list[str] = []
    for key, value in spec.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value not in (False, None):
            flags += [flag, *map(str, _as_list(value))]
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


def prepare_shards(grid: StudyGrid, study_dir: Path, data_override: str | None) -> str:
    """The study's shard set: --data, else the grid's path or URL, else `prep corpus` run once into STUDY/shards.

    In a prep spec, `tokenizer` is a tokenizer.json path, or a mapping of `prep tokenizer` flags
    ({input: sample, vocab_size: 1024}) that is trained once into STUDY/tokenizer. Other keys are
    `prep corpus` flags (input_length: 128 -> --input-length 128).
    """
    if data_override:
        return data_override
    if grid.data is None:
        raise UserError(f"{grid.source}: no data; add `data: shards/NAME` (or a prep spec) or pass --data SHARDS")
    if isinstance(grid.data, str):
        return grid.data
    spec = dict(grid.data)
    out = Path(spec.pop("out", study_dir / "shards"))
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


def record_study_start(grid: StudyGrid, study_dir: Path, shards: str, manifest: dict[str, Any],
                       argv: list[str]) -> None:
    """Write STUDY/study.json: shard set, machine, grid, base settings, and this command appended."""
    state = check_study_dir(study_dir, shards, manifest)
    machine = machine_info()
    earlier = state.get("machine")
    if earlier and (earlier.get("gpus"), earlier.get("cpus")) != (machine["gpus"], machine["cpus"]):
        print(f"note: earlier points of {study_dir} ran on another machine ({earlier.get('cpus')} CPUs, GPUs "
              f"{earlier.get('gpus') or 'none'}); their rows are not comparable with new ones", flush=True)
        state["earlier_machines"] = (state.get("earlier_machines") or []) + [earlier]
    state.update(study=grid.name, grid_file=str(grid.source), grid=yaml.safe_load(grid.source.read_text()),
                 shard_set=shard_summary(shards, manifest), machine=machine, base=asdict(grid.base))
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
    reason = launch.last_error_line(err_path)[:400] if returncode != 0 else ""
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


def _stop(process: subprocess.Popen) -> None:
    """Stop a launched point (its own process group, by id): SIGINT first, which pretrain turns into stopping
    the ranks it spawned (they run in their own sessions), then SIGTERM, then SIGKILL."""
    if process.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


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
            env[launch.START_GATE_ENV] = str(gate)
        self.launched = time.monotonic()
        self.started = self.launched if gate is None else None
        with open(log_dir / f"{run_dir.name}.out", "wb") as out_log, open(self.err_path, "wb") as err_log:
            self.process = subprocess.Popen(command, stdout=out_log, stderr=err_log, start_new_session=True,
                                            env=env)

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
        try:
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
        finally:
            self.stop()
        status, reason = classify(self.process.returncode, timed_out, self.err_path, self.run_dir, timeout_s)
        return PointOutcome(status, reason, self.process.returncode, time.monotonic() - self.started)

    def stop(self) -> None:
        _stop(self.process)
        if self.gate is not None:
            self.gate.unlink(missing_ok=True)


def read_point_record(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / POINT_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return record if record.get("status") in FINISHED_STATUSES else None


# ------------------------------------------------------------------------------------------------- results

def summarize_metrics(metrics: list[dict[str, Any]], skip_steps: int) -> dict[str, Any]:
    """Steady-state figures of one run's metrics (steps after `skip_steps`; pretrain.metrics.steady_state_figures);
    peak memory is the max of all steps."""
    steady = [m for m in metrics if int(m.get("step", 0)) > skip_steps]
    out: dict[str, Any] = {"steps_done": len(metrics), "steps_measured": len(steady)}
    if not steady:
        return out
    out.update(steady_state_figures(steady))
    peaks = [float(m["peak_mem_gib"]) for m in metrics if m.get("peak_mem_gib") is not None]
    out["peak_mem_gib"] = max(peaks) if peaks else None
    out["grad_accum"] = steady[-1].get("grad_accum")
    return out


def result_row(record: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One results.csv row from a finished point's record and its run dir."""
    row: dict[str, Any] = dict(record["point"])
    row.update(point_id=record["point_id"], status=record["status"], reason=record.get("reason", ""),
               steps=record["base"]["steps"], global_batch=record["base"]["global_batch"],
               wall_s=record.get("wall_s"))
    row.update(summarize_metrics(read_metrics(run_dir / "metrics.jsonl"), record["base"]["skip_steps"]))
    config_path = run_dir / "config.json"
    if config_path.is_file():
        try:
            estimate = json.loads(config_path.read_text()).get("memory_estimate") or {}
        except json.JSONDecodeError:
            estimate = {}
        row.update(est_gpu_gib=estimate.get("per_gpu_gib"), est_cpu_gib=estimate.get("per_cpu_gib"),
                   est_method=estimate.get("method"))
    return row


def finished_points(study_dir: Path) -> list[tuple[dict[str, Any], Path]]:
    """(record, run dir) of every finished point under STUDY/runs, in grid order where known, else by id."""
    runs = study_dir / RUNS_DIR
    found = []
    for run_dir in sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []:
        record = read_point_record(run_dir)
        if record is not None:
            found.append((record.get("order", 1 << 30), run_dir.name, record, run_dir))
    return [(record, run_dir) for _, _, record, run_dir in sorted(found, key=lambda r: r[:2])]


def collect_rows(study_dir: Path) -> list[dict[str, Any]]:
    """One results.csv row per finished point."""
    return [result_row(record, run_dir) for record, run_dir in finished_points(study_dir)]


def rebuild_report(study_dir: Path) -> dict[str, Path]:
    """results.csv, report.md and the plots from the run dirs (or from results.csv if there are none)."""
    study_dir = Path(study_dir)
    state_path = study_dir / STUDY_FILE
    setup = json.loads(state_path.read_text()) if state_path.is_file() else {}
    points = finished_points(study_dir)
    rows = [result_row(record, run_dir) for record, run_dir in points]
    if points:  # one point's exact command, to reproduce it by hand
        setup["point_command"] = shlex.join(points[0][0]["command"])
    if not rows and (study_dir / report.RESULTS_CSV).is_file():
        rows = report.read_results_csv(study_dir / report.RESULTS_CSV)
    if not rows:
        raise UserError(f"{study_dir}: no finished points under {RUNS_DIR}/ and no {report.RESULTS_CSV}; "
                        f"run `study run GRID.yaml --out {study_dir}` first")
    return report.write_report(rows, study_dir, setup)


# ----------------------------------------------------------------------------------------------- the sweep

def run_study(grid_path: str | os.PathLike, study_dir: str | os.PathLike, *, data: str | None = None,
              dry_run: bool = False, retry_failed: bool = False, argv: list[str] | None = None) -> dict[str, Any]:
    """Run every unfinished point of a grid, then rebuild results.csv, report.md and the plots.

    Returns counts {points, ok, failed, oom, timeout, skipped, launched}.
    """
    grid = load_grid(grid_path)
    study_dir = Path(study_dir)
    points = grid.points()
    runs = study_dir / RUNS_DIR
    if dry_run:  # no prep, no launches: show what would run
        shards = data or (grid.data if isinstance(grid.data, str) else str(study_dir / "shards"))
        for index, point in enumerate(points, 1):
            record = read_point_record(runs / point.point_id)
            state = f"  [done: {record['status']}]" if record else ""
            print(f"[{index}/{len(points)}] {point.label}{state}\n    "
                  f"{shlex.join(pretrain_command(grid, point, shards, runs / point.point_id))}")
        print(f"dry run: {len(points)} points, nothing launched")
        return {"points": len(points), "launched": 0}

    shards = prepare_shards(grid, study_dir, data)
    # A URL (s3://...) is fetched once into the shared cache, which every launch then reuses.
    manifest = read_manifest(storage.resolve_shard_dir(shards))
    record_study_start(grid, study_dir, shards, manifest,
                       argv or ["study", "run", str(grid_path), "--out", str(study_dir)])

    counts = {status: 0 for status in FINISHED_STATUSES} | {"points": len(points), "skipped": 0, "launched": 0}
    sweep_start = time.monotonic()
    todo: list[tuple[int, Point]] = []
    for index, point in enumerate(points, 1):
        previous = read_point_record(runs / point.point_id)
        if previous and (previous["status"] == "ok" or not retry_failed):
            counts["skipped"] += 1
            counts[previous["status"]] += 1
            print(f"[{index}/{len(points)}] {point.label} ... skipped ({previous['status']} earlier)", flush=True)
        else:
            todo.append((index, point))

    def start(point: Point, gated: bool) -> PointLaunch:
        run_dir = runs / point.point_id
        if run_dir.exists():  # a failed or interrupted earlier attempt of this point: start it afresh
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        gate = study_dir / LOGS_DIR / f"{point.point_id}.gate" if gated else None
        return PointLaunch(pretrain_command(grid, point, shards, run_dir), run_dir, study_dir / LOGS_DIR, gate)

    ahead: PointLaunch | None = None     # the next point, launched early and waiting at its start gate
    try:
        for position, (index, point) in enumerate(todo):
            run_dir = runs / point.point_id
            prefix = f"[{index}/{len(points)}] {point.label}"
            current = ahead if ahead is not None else start(point, gated=False)   # ahead was launched for this point
            ahead = None
            hidden_s = current.open_gate()
            if grid.base.overlap_startup and point.offload == "none" and position + 1 < len(todo):
                # offload points keep the host's cores to themselves (CPU Adam): nothing starts beside them
                ahead = start(todo[position + 1][1], gated=True)
            if not sys.stdout.isatty():
                print(f"{prefix} ...", end="", flush=True)
            outcome = current.wait(grid.base.timeout_s, grid.base.steps, prefix)
            record = {"point_id": point.point_id, "point": asdict(point), "order": index, "status": outcome.status,
                      "reason": outcome.reason, "returncode": outcome.returncode, "wall_s": round(outcome.wall_s, 2),
                      "startup_ahead_s": round(hidden_s, 2), "command": current.process.args,
                      "base": asdict(grid.base), "fingerprint": manifest["fingerprint"]}
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_dir / POINT_FILE, record)
            counts[outcome.status] += 1
            counts["launched"] += 1
            ahead_note = f", {hidden_s:.0f}s of start-up ahead" if hidden_s >= 0.5 else ""
            if outcome.status == "ok":
                medians = summarize_metrics(read_metrics(run_dir / "metrics.jsonl"), grid.base.skip_steps)
                result = f"{report.format_rate(medians.get('tokens_per_s'))} ({outcome.wall_s:.0f}s{ahead_note})"
            else:
                result = f"{outcome.status.upper()}: {outcome.reason} ({outcome.wall_s:.0f}s{ahead_note})"
            print(f"\r{prefix} ... {result}" if sys.stdout.isatty() else f" {result}", flush=True)
    finally:     # interrupted (Ctrl-C, a timeout around the study): the early launch must not outlive the sweep
        if ahead is not None:
            ahead.stop()

    written = rebuild_report(study_dir)
    elapsed = time.monotonic() - sweep_start
    print(f"study {grid.name}: {counts['points']} points: {counts['ok']} ok, {counts['oom']} oom, "
          f"{counts['failed']} failed, {counts['timeout']} timeout ({counts['skipped']} skipped as finished, "
          f"{counts['launched']} launched) in {elapsed / 60:.1f} min")
    print(f"results: {written['csv']}\nreport:  {written['md']}\nplots:   "
          + ", ".join(str(p) for p in written["plots"]))
    return counts
