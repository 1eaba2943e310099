"""`study tune`: the fastest `pretrain` configuration for one model, machine and global batch, found by measuring
few candidates of a space (ZeRO stage, offload, micro batch, activation checkpointing, loader, CPU-Adam threads;
on GPUs, with the blocks compiled, CUDA graphs).

    study tune --model t5-tiny --data shards/demo --nproc 1 --global-batch 16 --budget-s 600 --out tunes/tiny

1. The space: axes are TrainConfig fields, by default from its value lists (narrowed by `--space FILE`, a grid
   file, and `--set axis=v1,v2`), written as DIR/space.yaml and read by the study's own grid code.
2. Pruning: the preflight's memory estimate, scaled by every measured peak (tune_model.Calibration).
3. Ranking: the cost model (tune_model.CostModel), refitted after every measurement.
4. Measuring: in rank order, short real launches through the study runner (`run_points`), successive halving.
5. Stopping: at the budget, or once no unmeasured candidate's optimistic prediction beats the best by the noise.
A rerun of the same command skips the finished launches and continues. docs/tune.md has the details.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import UserError, atomic_write_bytes, atomic_write_json, describe_os_error, need, writing
from pipeline.settings import read_yaml
from pretrain.config import STAGE3_TUNABLES, ZERO_STAGES, TrainConfig, memory_share
from pretrain.data import storage
from pretrain.metrics import needed_peak
from pretrain.runlock import TUNE_LOCK_NAME, RunLock, acquire_run_lock
from pretrain.study import tune_report
from pretrain.study.grid import AXIS_NAMES, GRID_KEYS, SKIP_STEPS_KEY, StudyGrid, as_list, load_grid
from pretrain.study.results import result_row
from pretrain.study.runner import Sweep, machine_info, new_counts, run_points
from pretrain.study.tune_compare import compare_with_grid, grid_rows
from pretrain.study.tune_model import Calibration, CostModel, Shape, memory_setting

TUNE_FILE = "tune.json"
SPACE_FILE = "space.yaml"
WORKER_CHOICES = (0, 1, 2, 4, 8)
FIXED_BY_FLAGS = ("model", "nproc", "global_batch")
GRAPH_BLOCKERS = {"compile": False, "zero": 3, "activation_checkpointing": True}
"""The values at which pretrain refuses --cudagraphs (TrainConfig): the blocks must be compiled to be graphs, ZeRO 3
gathers each block's weights to new addresses every step, and a recomputed forward would run outside the graphs."""
FULL_GRID_HEADER = "# the full grid of a `study tune`"
"""How every --write-grid file begins: a file that begins so is a tune's, and a tune may write it again (a rerun
of the same command); any other file is the user's, and is never replaced."""


@dataclass
class TuneOptions:
    """What `study tune` was asked (its flags)."""

    out: Path
    data: str | None = None
    model: str | None = None
    nproc: int | None = None
    global_batch: int | None = None
    space: str | None = None
    sets: list[str] = field(default_factory=list)
    budget_s: float | None = None
    rung_steps: tuple[int, ...] = (6, 12)
    skip_steps: int = 2
    keep: float = 0.34
    min_measured: int = 3
    model_margin: float = 0.15
    sibling_margin: float = 0.06
    noise_floor: float = 0.02
    memory_margin: float = 0.1
    device_memory_gib: float | None = None
    calibrate_from: list[str] = field(default_factory=list)
    best_steps: int = 100
    dry_run: bool = False
    write_grid: str | None = None
    compare_grid: str | None = None
    argv: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Refuse a value the search cannot use, naming its flag, before anything is read or written."""
        need(self.budget_s is None or self.budget_s > 0, f"--budget-s must be > 0 seconds, got {self.budget_s}")
        need(all(later > earlier for earlier, later in zip(self.rung_steps, self.rung_steps[1:])),
             f"--rung-steps must grow from rung to rung (each rung measures longer), e.g. 6,12; got "
             f"{','.join(map(str, self.rung_steps))}")
        need(self.skip_steps >= 0, f"--skip-steps must be >= 0, got {self.skip_steps}")
        need(self.skip_steps < min(self.rung_steps),
             f"--skip-steps {self.skip_steps} leaves no measured step at rung steps {self.rung_steps}; use fewer "
             f"skip steps or longer rungs")
        need(0 < self.keep <= 1, f"--keep is the share of a rung kept for the next, in (0, 1] (0.34 keeps a third); "
                                 f"got {self.keep}")
        need(self.min_measured >= 1, f"--min-measured must be >= 1, got {self.min_measured}")
        for name in ("model_margin", "sibling_margin"):
            need(getattr(self, name) >= 0, f"--{name.replace('_', '-')} is a relative error, >= 0 (0.15 is 15%); "
                                           f"got {getattr(self, name)}")
        need(self.device_memory_gib is None or self.device_memory_gib > 0,
             f"--device-memory-gib must be > 0, got {self.device_memory_gib}")
        need(self.best_steps >= 1, f"--best-steps must be >= 1 (the steps best.yaml sets), got {self.best_steps}")


@dataclass
class Candidate:
    """One point of the space: its settings (out = DIR/runs/<id>), what the models say of it, what was measured."""

    config: TrainConfig
    point_id: str
    default: bool
    estimate_gib: float = 0.0
    calibrated_gib: float = 0.0
    memory: str = "fits"              # fits | near (measured, not pruned) | pruned
    why: str = ""
    predicted: dict[str, float] = field(default_factory=dict)
    results: dict[int, dict[str, Any]] = field(default_factory=dict)     # rung index -> result row

    def best_result(self) -> tuple[int, dict[str, Any]] | None:
        """(rung, row) of its highest rung measured ok."""
        ok = [(rung, row) for rung, row in self.results.items() if row["status"] == "ok" and row.get("tokens_per_s")]
        return max(ok, key=lambda item: item[0]) if ok else None


# ------------------------------------------------------------------------------------------------ the space

def _parse_set(text: str) -> tuple[str, list[Any]]:
    """--set micro_batch=8,16 -> ("micro_batch", [8, 16]); values read as YAML (null, true, 8)."""
    axis, sep, values = text.partition("=")
    axis = axis.strip().replace("-", "_")
    if not sep or not values:
        raise UserError(f"--set {text}: write --set AXIS=V1,V2 (e.g. --set zero=2,3)")
    if axis not in AXIS_NAMES:
        raise UserError(f"--set {text}: no such setting {axis!r}; an axis is any pretrain setting (`pretrain --help`)")
    return axis, [yaml.safe_load(v) for v in values.split(",")]


def default_axes(per_rank_examples: int, cores_per_rank: int) -> dict[str, list[Any]]:
    """The whole space by default (every pretrain value list the tune searches, bounded by the host; on GPUs also
    --cudagraphs, `_default_graphs`)."""
    threads = sorted({max(1, cores_per_rank // 2), cores_per_rank})
    return {"zero": list(ZERO_STAGES), "offload": ["none", "cpu"],
            "micro_batch": [2 ** k for k in range(12) if per_rank_examples % 2 ** k == 0],
            "activation_checkpointing": [False, True],
            "loader_workers": [w for w in WORKER_CHOICES if w <= max(1, cores_per_rank - 1)],
            "loader": ["shards"], "omp_num_threads": [None, *threads]}


def _values(axes: dict[str, list[Any]], base: dict[str, Any], name: str, defaults: TrainConfig) -> list[Any]:
    """The values a setting takes in the space: its axis, else its fixed value, else pretrain's default."""
    return axes.get(name) or [base.get(name, getattr(defaults, name))]


def _default_graphs(axes: dict[str, list[Any]], base: dict[str, Any], defaults: TrainConfig
                    ) -> list[dict[str, Any]]:
    """On GPUs the space holds --cudagraphs off and on unless the user set it (`_graph_rules` then keeps it to the
    points that can take it), where it can pay: not under offload (the step waits on CPU-Adam there, not on kernel
    launches); `--set cudagraphs=false,true` asks for it everywhere pretrain takes it. Returns the rule that keeps it
    off there. (Graphs train as the same code without them, in bf16 and in FP8: docs/pretrain.md.)"""
    offloads = _values(axes, base, "offload", defaults)
    if "none" not in offloads:
        return []
    axes["cudagraphs"] = [False, True]
    offloaded = [o for o in offloads if o != "none"]
    return [{"offload": offloaded, "cudagraphs": True}] if offloaded else []


def _graph_rules(axes: dict[str, list[Any]], base: dict[str, Any], defaults: TrainConfig,
                 requested: bool) -> list[dict[str, Any]]:
    """Exclude rules that keep --cudagraphs to the points pretrain takes it at (GRAPH_BLOCKERS). Where no point can
    take it, the axis is left at its default, or, if the user asked for it (`requested`), refused in one line."""
    if True not in _values(axes, base, "cudagraphs", defaults):
        return []
    values = {name: _values(axes, base, name, defaults) for name in GRAPH_BLOCKERS}
    blocked = [f"{name}={bad}" for name, bad in GRAPH_BLOCKERS.items() if all(v == bad for v in values[name])]
    if blocked:
        if requested:
            raise UserError(f"cudagraphs (--set or the space file): no point of this space can replay its blocks as "
                            f"CUDA graphs ({', '.join(blocked)} everywhere; pretrain needs --compile, ZeRO 0-2 and no "
                            f"activation checkpointing for it); add --set compile=true, or drop cudagraphs")
        axes["cudagraphs"] = [False]
        return []
    where = {"cudagraphs": True} if "cudagraphs" in axes else {}
    return [{name: bad, **where} for name, bad in GRAPH_BLOCKERS.items() if bad in values[name]]


def _rules(axes: dict[str, list[Any]], base: dict[str, Any], requested: frozenset[str] = frozenset()
           ) -> list[dict[str, Any]]:
    """Exclude rules for what pretrain refuses (offload at stage 0, nvme below 3, stage-3 tunables elsewhere,
    --cudagraphs where its blocks cannot be graphs) and the tune's own policy (CPU-Adam threads only where there is
    CPU-Adam, i.e. offload). An axis whose setting applies nowhere in the space (threads without offload, tunables
    without stage 3) is left at its default; `requested`: the axes the user named (--set, the space file)."""
    defaults = TrainConfig(data="-", out="-")
    zeros, offloads = _values(axes, base, "zero", defaults), _values(axes, base, "offload", defaults)
    rules = []
    if 0 in zeros and any(o != "none" for o in offloads):
        rules.append({"zero": 0, "offload": [o for o in offloads if o != "none"]})
    if "nvme" in offloads and any(z != 3 for z in zeros):
        rules.append({"zero": [z for z in zeros if z != 3], "offload": "nvme"})
    conditional = [("omp_num_threads", {"offload": "none"}, any(o != "none" for o in offloads)),
                   *((name, {"zero": [z for z in ZERO_STAGES if z != 3]}, 3 in zeros) for name in STAGE3_TUNABLES)]
    for axis, where_not, applies in conditional:
        if axis not in axes or all(v is None for v in axes[axis]):
            continue
        if not applies:
            axes[axis] = [None]
            continue
        axes[axis] = list(dict.fromkeys([None, *axes[axis]]))
        rules.append({**where_not, axis: [v for v in axes[axis] if v is not None]})
    return rules + _graph_rules(axes, base, defaults, "cudagraphs" in requested)


def space_grid(options: TuneOptions, cores: int, steps: int, gpus: bool = False) -> dict[str, Any]:
    """The tune's space as a study grid file's content (`load_grid` reads it; `study run` runs it as a grid); `gpus`:
    the machine has GPUs (the default space then holds --cudagraphs)."""
    raw: dict[str, Any] = {}
    if options.space:
        path = Path(options.space)
        raw = read_yaml(path, "--space file", hint="see configs/tune/ for examples") or {}
        if not isinstance(raw, dict) or set(raw) - set(GRID_KEYS):
            raise UserError(f"{path}: a space file is a grid file (keys {sorted(GRID_KEYS)}); see configs/tune/")
    for key in ("base", "grid"):
        if not isinstance(raw.get(key) or {}, dict):
            raise UserError(f"{options.space}: {key} must be a mapping of settings, e.g. {{zero: [2, 3]}}")
    base, grid_axes = dict(raw.get("base") or {}), dict(raw.get("grid") or {})
    for name in FIXED_BY_FLAGS:
        if name in grid_axes and len(as_list(grid_axes[name])) == 1:   # a study grid's one-value axis fixes it too
            base.setdefault(name, as_list(grid_axes.pop(name))[0])
        value = getattr(options, name)
        if value is not None:
            base[name] = value
            grid_axes.pop(name, None)
        if name not in base:
            raise UserError(f"--{name.replace('_', '-')} is required (or base.{name} in the --space file)")
    for name in ("nproc", "global_batch"):
        value = base[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            where = (f"--{name.replace('_', '-')}" if getattr(options, name) is not None
                     else f"{options.space}: base.{name}")
            raise UserError(f"{where} must be a whole number >= 1, got {value!r}")
    nproc, global_batch = base["nproc"], base["global_batch"]
    if global_batch % nproc:
        raise UserError(f"--global-batch {global_batch} is not a multiple of --nproc {nproc}; pick one that is")
    axes = default_axes(global_batch // nproc, max(1, cores // nproc))
    axes.update({axis: as_list(values) for axis, values in grid_axes.items()})
    sets = list(map(_parse_set, options.sets))
    for axis, values in sets:
        axes[axis] = values
        base.pop(axis, None)
    axes = {axis: values for axis, values in axes.items() if axis not in base}
    requested = frozenset([*grid_axes, *(raw.get("base") or {}), *(axis for axis, _ in sets)])
    defaults = TrainConfig(data="-", out="-")
    graph_rules = _default_graphs(axes, base, defaults) if gpus and "cudagraphs" not in requested else []
    exclude = [*(raw.get("exclude") or []), *graph_rules, *_rules(axes, base, requested)]
    for axis in [a for a, values in axes.items() if len(values) == 1]:   # one value: a shared setting, not an axis
        base[axis] = axes.pop(axis)[0]
    default = {axis: getattr(defaults, axis) for axis in axes}
    if "cudagraphs" in default:     # pretrain's auto, as it resolves at the default point on this machine
        at = {name: default.get(name, base.get(name, getattr(defaults, name)))
              for name in ("compile", "zero", "activation_checkpointing", "offload")}
        default["cudagraphs"] = defaults.replace(**at).graphs_on(cuda=gpus)
    if "micro_batch" in default and (global_batch // nproc) % default["micro_batch"]:
        default["micro_batch"] = max(m for m in axes["micro_batch"] if m <= defaults.micro_batch)
    base.update(steps=steps, **{SKIP_STEPS_KEY: options.skip_steps})
    base.pop("steady_skip", None)
    grid = {"name": raw.get("name") or f"tune-{base['model']}", "data": options.data or raw.get("data"),
            "base": base, "grid": axes, "exclude": exclude, "include": [default, *(raw.get("include") or [])]}
    if raw.get("pretrain_command"):
        grid["pretrain_command"] = raw["pretrain_command"]
    return grid


def write_space(grid: dict[str, Any], path: Path, header: str, fix: str) -> StudyGrid:
    """Write a space as a grid file (`fix`: what to do if it cannot be written) and read it back as the study does."""
    with writing(path, fix):
        atomic_write_bytes(path, (header + yaml.safe_dump(grid, sort_keys=False)).encode())
    return load_grid(path)


def check_grid_file(path: Path, space: str | None) -> None:
    """--write-grid FILE must be a new file or one an earlier tune wrote (FULL_GRID_HEADER): not a directory, not
    the --space file, nor any other file, which the grid would silently replace."""
    if path.is_dir():
        raise UserError(f"{path}: --write-grid is a directory; give a file name, e.g. --write-grid "
                        f"{path / 'full.yaml'}")
    if not path.exists():
        return
    if space and path.resolve() == Path(space).resolve():
        raise UserError(f"{path}: --write-grid names the --space file, which it would replace; give another file name")
    try:
        with open(path, "rb") as f:
            first = f.read(len(FULL_GRID_HEADER))
    except OSError as err:
        raise UserError(f"{path}: --write-grid cannot read the file there ({describe_os_error(err)}); give another "
                        f"file name") from None
    if first != FULL_GRID_HEADER.encode():
        raise UserError(f"{path}: --write-grid would replace this file, which `study tune` did not write; give another "
                        f"file name, or remove it first")


# ------------------------------------------------------------------------------------------------ the machine

def device_info(options: TuneOptions, base: dict[str, Any]) -> dict[str, Any]:
    """The device a rank trains on (a GPU from nvidia-smi, else the CPU with its share of host RAM) and the
    memory capacity pruning compares against (`--device-memory-gib` states it)."""
    machine = machine_info()
    precision = base.get("precision", "auto")
    nproc = int(base["nproc"])
    if machine["gpus"]:
        name, _, memory = machine["gpus"][0].partition(",")
        per_device = float(memory.strip().split()[0]) / 1024
        device = {"kind": "cuda", "name": name.strip(), "per_device_gib": round(per_device, 1),
                  "precision": "bf16" if precision == "auto" else precision}
    else:
        per_device = machine["ram_gib"] / nproc
        device = {"kind": "cpu", "name": "cpu", "per_device_gib": round(per_device, 1),
                  "precision": "fp32" if precision == "auto" else precision}
    device.update(host_ram_gib=machine["ram_gib"], cpus=machine["cpus"],
                  capacity_gib=options.device_memory_gib or device["per_device_gib"])
    return device


def model_arithmetic(grid: StudyGrid, manifest: dict[str, Any], configs: list[TrainConfig],
                     device: dict[str, Any]) -> tuple[Shape, list[float]]:
    """The run's Shape and each config's memory figure (see device_figure) on the shard set of `manifest`; the model
    arithmetic runs in a child process (pretrain.study.tune_estimate), which imports torch and DeepSpeed."""
    base, lengths = grid.base, manifest["config"]
    nproc, global_batch = int(base["nproc"]), int(base["global_batch"])
    keys = ("zero", "offload", "micro_batch", "activation_checkpointing")
    request = {"model": base["model"], "model_overrides": base.get("model_overrides", {}),
               "vocab_size": base.get("vocab_size"), "tokenizer_vocab": int(manifest["tokenizer"]["vocab_size"]),
               "input_length": int(lengths["input_length"]), "target_length": int(lengths["target_length"]),
               "nproc": nproc, "per_rank_examples": global_batch // nproc, "precision": device["precision"],
               "fused_attention": device["kind"] == "cuda",
               "candidates": [{key: getattr(config, key) for key in keys} for config in configs]}
    done = subprocess.run([sys.executable, "-m", "pretrain.study.tune_estimate"], input=json.dumps(request),
                          capture_output=True, text=True)
    if done.returncode != 0:
        why = ([line for line in done.stderr.splitlines() if line.strip()] or ["no output"])[-1]
        raise UserError(f"{grid.source}: the memory estimate failed: {why.removeprefix('tune_estimate.py: error: ')}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    shape = Shape(parameters=answer["parameters"], flops_per_rank_step=answer["flops_per_rank_step"],
                  examples_per_rank_step=global_batch // nproc,
                  tokens_per_step=global_batch * (int(lengths["input_length"]) + int(lengths["target_length"])),
                  host_cores_per_rank=max(1, (device["cpus"] or 1) // nproc))
    device["fit_fraction"] = answer["fit_fraction"]      # the share of a device the preflight lets a run use
    figures = [device_figure(e["per_gpu_gib"], e["per_cpu_gib"], nproc, device) for e in answer["estimates"]]
    return shape, figures


def at_point(config: TrainConfig, point: dict[str, Any]) -> bool:
    """Whether `config` has every setting of `point` (e.g. the grid's default point)."""
    return all(getattr(config, axis) == value for axis, value in point.items())


def resolve_graphs(configs: list[TrainConfig], figures: list[float], device: dict[str, Any],
                   default: dict[str, Any]) -> tuple[list[TrainConfig], dict[str, Any]]:
    """Each candidate as pretrain runs it on this machine: --cudagraphs' auto resolved, against the share of a GPU
    its memory estimate fills (TrainConfig.graphs_on). `default` is pretrain's defaults on every axis (space_grid
    put it first in the grid's include, auto resolved there without the estimate): returned with graphs off where
    its point's estimate keeps auto from them, so the default marks the candidate pretrain would run."""
    cuda = device["kind"] == "cuda"
    shares = [memory_share(figure, device) for figure in figures]
    resolved = [c.replace(cudagraphs=c.graphs_on(cuda, share)) for c, share in zip(configs, shares)]
    if default.get("cudagraphs") is True:
        for c, share in zip(configs, shares):
            if at_point(c, default):
                if not c.replace(cudagraphs=None).graphs_on(cuda, share):
                    default = {**default, "cudagraphs": False}
                break
    return resolved, default


def device_figure(per_gpu: float, per_cpu: float, nproc: int, device: dict[str, Any]) -> float:
    """What pruning compares to the capacity: the estimate per GPU, or on CPU per rank (its device states and
    activations plus its share of the host states)."""
    return per_gpu if device["kind"] == "cuda" else per_gpu + per_cpu / nproc


def calibrate_from(dirs: list[str], calibration: Calibration, device: dict[str, Any]) -> None:
    """Every measured peak of earlier studies or tunes (their runs' records and config.json estimates)."""
    from pretrain.study.results import finished_points, read_results_csv

    for study in dirs:
        path = Path(study)
        records = finished_points(path)
        rows = [result_row(record, run_dir) for record, run_dir in records]
        if not rows and (path / "results.csv").is_file():
            rows = read_results_csv(path / "results.csv")
        if not rows:
            raise UserError(f"{path}: --calibrate-from needs a study or tune directory with finished runs or a "
                            f"results.csv")
        # the figure the peaks there were measured against: per GPU where they ran on GPUs (a GPU study read on
        # a CPU machine, say for a dry run), else this machine's
        ran_on = _ran_on(path) or device
        for row in rows:
            if row["status"] == "ok" and row.get("est_gpu_gib") is not None:
                graphs = bool(row.get("cudagraphs"))    # as the run resolved it (results.result_row)
                estimate = device_figure(row["est_gpu_gib"], row.get("est_cpu_gib") or 0.0, int(row.get("nproc") or 1),
                                         ran_on)
                calibration.observe(row["zero"], memory_setting(row["offload"], graphs), needed_peak(row, graphs),
                                    estimate, f"{path.name}/{row['point_id']}")


def _ran_on(path: Path) -> dict[str, Any] | None:
    """{"kind": "cuda" | "cpu"} of the machine a study (study.json) or tune (tune.json) directory ran on, if recorded."""
    for name, read in (("study.json", lambda s: bool((s.get("machine") or {}).get("gpus"))),
                       (TUNE_FILE, lambda s: (s.get("device") or {}).get("kind") == "cuda")):
        try:
            state = json.loads((path / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        return {"kind": "cuda" if read(state) else "cpu"}
    return None


# ------------------------------------------------------------------------------------------------ the search

def _anchor_note(candidate: Candidate) -> str:
    siblings, ratio = candidate.predicted.get("siblings", 0), candidate.predicted.get("graph_ratio")
    note = f"compute of {siblings} measured sibling launch{'es' if siblings > 1 else ''}" if siblings else ""
    if ratio:
        note = f"{note + ' of its graph-free twin, ' if note else ''}x the measured graph ratio {ratio:.3f}"
    return f" ({note})" if note else ""


@dataclass
class Tune:
    """One tune's state: the space, the models, every candidate, the launches so far."""

    options: TuneOptions
    grid: StudyGrid
    candidates: list[Candidate]
    shape: Shape
    device: dict[str, Any]
    model: CostModel
    calibration: Calibration
    sweep: Sweep
    state: dict[str, Any]
    lock: RunLock | None = None     # the directory's (held while the Tune lives)
    spent_s: float = 0.0
    counts: dict[str, int] = field(default_factory=new_counts)
    stops: list[str] = field(default_factory=list)

    def refresh(self) -> None:
        """Refit the cost model on every ok launch, then re-prune and re-predict every candidate."""
        measured = [(c.config, row) for c in self.candidates for row in c.results.values()
                    if row["status"] == "ok" and row.get("step_time_s")]
        self.model.refit(measured, self.shape)
        for c in self.candidates:
            setting = memory_setting(c.config.offload, c.config.cudagraphs)
            c.memory, c.calibrated_gib = self.calibration.verdict(c.config.zero, setting, c.estimate_gib)
            capacity = self.calibration.capacity_gib
            c.why = {"pruned": f"calibrated estimate {c.calibrated_gib:.3g} GiB > capacity {capacity:.3g} GiB "
                               f"x {1 + self.calibration.margin:g}",
                     "near": f"calibrated estimate {c.calibrated_gib:.3g} GiB is within "
                             f"{self.calibration.margin:.0%} of the capacity {capacity:.3g} GiB: measured, not pruned",
                     "fits": ""}[c.memory]
            # a measured candidate keeps the model's own figure (what tune_predicted.png checks); the others
            # take their measured siblings' compute
            c.predicted = self.model.predict(c.config, self.shape, anchored=not c.results)

    def noise(self, best: Candidate) -> float:
        spread = best.best_result()[1].get("tokens_per_s_spread") or 0.0
        return max(self.options.noise_floor, spread)

    def best(self) -> Candidate | None:
        done = [c for c in self.candidates if c.best_result()]
        return max(done, key=lambda c: (c.best_result()[0], c.best_result()[1]["tokens_per_s"])) if done else None

    def budget_left(self) -> bool:
        if self.options.budget_s is not None and self.spent_s >= self.options.budget_s:
            self.stops.append(f"budget spent: {self.spent_s:.0f} s of launches >= --budget-s {self.options.budget_s:g}")
            return False
        return True

    def measure(self, candidate: Candidate, rung: int) -> dict[str, Any]:
        """One real launch of the candidate at a rung's steps, through the study runner (skipped when finished)."""
        steps = self.options.rung_steps[rung]
        force = (self.device["kind"] == "cuda" and candidate.memory != "pruned"
                 and candidate.estimate_gib > self.device["fit_fraction"] * self.device["per_device_gib"])
        config = candidate.config.replace(steps=steps, out=str(self.options.out / "runs" /
                                                               f"{candidate.point_id}-s{steps}"), force=force)
        launches = self.state.setdefault("launches", [])
        number = len(launches) + 1
        record = run_points(self.sweep, [config], counts=self.counts, numbering=(number, len(self.candidates)))[0]
        row = result_row(record, Path(config.out))
        candidate.results[rung] = row
        self.spent_s += float(record.get("wall_s") or 0.0)
        launches.append({"point_id": record["point_id"], "rung": rung, "status": row["status"],
                         "wall_s": record.get("wall_s"), "tokens_per_s": row.get("tokens_per_s")})
        setting = memory_setting(config.offload, config.cudagraphs)
        if row["status"] == "ok":
            self.calibration.observe(config.zero, setting, needed_peak(row, config.cudagraphs),
                                     candidate.estimate_gib, record["point_id"])
        elif row["status"] == "oom":
            self.calibration.observe_oom(config.zero, setting, candidate.estimate_gib, record["point_id"])
            print(f"[tune] {record['point_id']}: out of memory; calibration raised, re-pruning", flush=True)
        self.save()
        return row

    def margin(self, candidate: Candidate) -> float:
        """How far a candidate's prediction may be below what it would measure: the model's error (at least
        --model-margin), or, where its compute comes from measured siblings, one configuration's run-to-run
        spread (--sibling-margin)."""
        if candidate.predicted.get("siblings"):
            return self.options.sibling_margin
        return max(self.options.model_margin, self.model.residual or 0.0)

    def first_rung(self) -> None:
        """Rung 0 in rank order: the default first, then the best predicted that could still beat the best
        measured, until the budget, the space or the cost model says stop."""
        while True:
            self.refresh()
            pending = [c for c in self.candidates if 0 not in c.results and c.memory != "pruned"]
            if not pending:
                self.stops.append("rung 0: every candidate that fits was measured")
                return
            if not self.budget_left():
                return
            default = [c for c in pending if c.default]
            best = self.best()
            ok = sum(1 for c in self.candidates if c.results.get(0, {}).get("status") == "ok")
            ranked = sorted(pending, key=lambda c: -c.predicted["tokens_per_s"])
            if best and not default and ok >= self.options.min_measured:
                best_rate, noise = best.best_result()[1]["tokens_per_s"], self.noise(best)
                bar = best_rate * (1 + noise)
                contenders = [c for c in ranked if c.predicted["tokens_per_s"] * (1 + self.margin(c)) > bar]
                if not contenders:
                    top = max(pending, key=lambda c: c.predicted["tokens_per_s"] * (1 + self.margin(c)))
                    rate = top.predicted["tokens_per_s"]
                    self.stops.append(
                        f"rung 0: early stop after {ok} measured: no candidate left can beat the best "
                        f"{best.point_id} ({best_rate:.0f} tok/s) by more than the noise {noise:.1%}; the closest, "
                        f"{top.point_id}, is predicted {rate:.0f} tok/s{_anchor_note(top)}, at most "
                        f"{rate * (1 + self.margin(top)):.0f} with a {self.margin(top):.0%} margin; "
                        f"{len(pending)} left unmeasured")
                    return
                ranked = contenders
            nxt = default[0] if default else ranked[0]
            print(f"[tune] rung 0: {nxt.point_id}{' (the default)' if nxt.default else ''}, predicted "
                  f"{nxt.predicted['tokens_per_s']:.0f} tok/s{_anchor_note(nxt)}", flush=True)
            self.measure(nxt, 0)

    def later_rungs(self) -> None:
        """Successive halving: the top `keep` share of the previous rung (at least 2, and the default) again,
        longer."""
        for rung in range(1, len(self.options.rung_steps)):
            previous = sorted((c for c in self.candidates if c.results.get(rung - 1, {}).get("status") == "ok"),
                              key=lambda c: -c.results[rung - 1]["tokens_per_s"])
            if len(previous) < 2:
                self.stops.append(f"rung {rung}: fewer than 2 candidates measured ok at rung {rung - 1}")
                return
            keep = previous[:max(2, math.ceil(self.options.keep * len(previous)))]
            keep += [c for c in previous if c.default and c not in keep]
            print(f"[tune] rung {rung} ({self.options.rung_steps[rung]} steps): {len(keep)} contenders", flush=True)
            for candidate in keep:
                if not self.budget_left():
                    return
                self.measure(candidate, rung)
        if len(self.options.rung_steps) > 1:
            self.stops.append(f"rung {len(self.options.rung_steps) - 1}: every contender measured")

    def save(self) -> None:
        self.state.update(candidates=[tune_report.candidate_summary(c) for c in self.candidates],
                          model=self.model.explain(), calibration=self.calibration.ratios, stops=self.stops,
                          spent_s=round(self.spent_s, 1))
        atomic_write_json(self.options.out / TUNE_FILE, self.state)


def earlier_tune(path: Path, space_sha: str, fingerprint: str) -> list[str]:
    """The commands of the tune DIR/tune.json holds, if any; a tune of another space or shard set, or a tune.json
    that cannot be read, is refused."""
    if not path.is_file():
        return []
    try:
        earlier = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: cannot be read as a tune's state ({str(err).splitlines()[0]}); use another "
                        f"--out") from None
    if not isinstance(earlier, dict) or (earlier.get("space_sha256"), earlier.get("fingerprint")) != (space_sha,
                                                                                                      fingerprint):
        raise UserError(f"{path}: this directory holds a tune of another space or shard set; rerun it with "
                        f"the same flags (see its commands) or use another --out")
    return list(earlier.get("commands") or [])


def open_tune(options: TuneOptions) -> Tune:
    """Build the space, the candidates and the models; refuse a directory that holds another tune."""
    machine = machine_info()
    grid_dict = space_grid(options, machine["cpus"] or 1, options.rung_steps[0], gpus=bool(machine["gpus"]))
    if not grid_dict["data"]:
        raise UserError("--data SHARDS is required (a shard set written by `prep corpus`), or `data:` in --space")
    if options.write_grid:
        check_grid_file(Path(options.write_grid), options.space)
    # held until this process ends: a second tune on the directory is refused, not interleaved with this one
    lock = acquire_run_lock(options.out, name=TUNE_LOCK_NAME, what="tune directory", holder_kind="study tune",
                            flag="study tune --out")
    text = yaml.safe_dump(grid_dict, sort_keys=False)
    space_sha = hashlib.sha256(text.encode()).hexdigest()
    manifest = storage.read_shard_set_manifest(str(grid_dict["data"]))
    # a directory holding another tune is refused before anything in it (space.yaml) or --write-grid is written
    state = {"space_sha256": space_sha, "fingerprint": manifest["fingerprint"],
             "commands": earlier_tune(options.out / TUNE_FILE, space_sha, manifest["fingerprint"])}
    state["commands"].append(shlex.join(options.argv))
    if options.write_grid:
        full = {**grid_dict, "name": f"{grid_dict['name']}-full",
                "base": {**grid_dict["base"], "steps": options.rung_steps[-1]}}
        write_space(full, Path(options.write_grid), f"{FULL_GRID_HEADER} (`{shlex.join(options.argv)}`); run it as: "
                    f"study run {options.write_grid} --out DIR\n",
                    "give --write-grid a file in a writable directory")
    grid = write_space(grid_dict, options.out / SPACE_FILE, f"# the space of `{shlex.join(options.argv)}`\n",
                       "pick another study tune --out")
    shards = str(grid.data)
    device = device_info(options, grid.base)
    points = grid.points(shards, options.out / "runs")
    shape, figures = model_arithmetic(grid, manifest, points, device)
    configs, default = resolve_graphs(points, figures, device, grid.include[0])
    state.update(device=device, shape=dataclasses.asdict(shape), space=grid_dict, launches=[])
    calibration = Calibration(capacity_gib=device["capacity_gib"], margin=options.memory_margin)
    calibrate_from(options.calibrate_from, calibration, device)
    candidates = [Candidate(config=config, point_id=Path(config.out).name,
                            default=at_point(config, default),
                            estimate_gib=figure)
                  for config, figure in zip(configs, figures)]
    sweep = Sweep(study_dir=options.out, settings=grid.settings, fingerprint=manifest["fingerprint"],
                  label=lambda c: f"{grid.label(c)} steps={c.steps}", values=grid.point_values,
                  pretrain_command=grid.pretrain_command, header=f"study tune {options.out}")
    return Tune(options=options, grid=grid, candidates=candidates, shape=shape, device=device,
                model=CostModel.for_device(device), calibration=calibration, sweep=sweep, state=state, lock=lock)


def run_tune(options: TuneOptions) -> Tune:
    """The whole tune (or, with dry_run, the space pruned and ranked, nothing launched); writes DIR/tune.json,
    tune.md, best.yaml and the plots."""
    # the grid to compare against, read first: one that is not there is said before anything launches
    against = grid_rows(Path(options.compare_grid)) if options.compare_grid else None
    tune = open_tune(options)
    if options.dry_run:
        tune.refresh()
        tune.stops.append("dry run: nothing launched")
        tune.save()
        tune_report.print_ranking(tune)
        return tune
    tune.first_rung()
    if tune.best() is not None and not (tune.stops and tune.stops[-1].startswith("budget")):
        tune.later_rungs()
    tune.refresh()
    if against is not None:
        tune.state["against_grid"] = compare_with_grid(tune, Path(options.compare_grid), against)
    tune.save()
    tune_report.write_outputs(tune)
    return tune
