"""A study grid file -> its points, each one a validated `TrainConfig` (pretrain/config.py).

    grid = load_grid("configs/study/cpu-tiny.yaml"); [grid.point_id(config) for config in grid.points()]

A grid file (YAML) holds `name`, `description`, `data` (the shared shard set, or a `prep corpus` spec),
`base` (settings every point shares), `grid` (axes: a value or a list of values each), `exclude` / `include`
rules, `repeats` (run points more than once, to measure run-to-run spread) and `pretrain_command`. An axis is any `TrainConfig` field, and so is any `base` key beside the study's
own settings (`StudySettings`, and `skip_steps` for `steady_skip`): a new pretrain setting is a new axis with
no edit here. Every point is built and checked by `config_from_values` when the grid is loaded, so a bad grid
fails in one line naming the file and the point before anything is prepared or launched.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pipeline.common import CONFIGS_DIR, UserError
from pipeline.settings import build_settings, field_names, read_yaml, setting
from pretrain.config import TrainConfig, config_from_values

CLASSIC_AXES = ("model", "zero", "offload", "micro_batch", "loader_workers", "nproc", "activation_checkpointing")
"""The axes every study has (and every results.csv column list starts with), named in the point id's fixed part."""
GRID_KEYS = ("name", "description", "data", "base", "grid", "exclude", "include", "repeats", "pretrain_command")
REPEAT_SUFFIX = re.compile(r"-r(\d+)$")
"""A repeat's point id: the point's id + -r2, -r3 ... (the first run keeps the plain id)."""
SET_BY_STUDY = ("data", "out")      # TrainConfig fields the study fills in: the shard set and STUDY/runs/<point-id>
SKIP_STEPS_KEY = "skip_steps"       # the grid files' name for TrainConfig.steady_skip
AXIS_NAMES = tuple(sorted(field_names(TrainConfig) - set(SET_BY_STUDY)))
MODELS_DIR = CONFIGS_DIR / "models"     # where a model preset's YAML is (pretrain.model.t5, which imports torch)
POINT_DEFAULTS = {"save_final": False}
"""Where a study point differs from `pretrain`'s defaults: a point measures, so it keeps no final checkpoint
(mt5-large's is ~17 GB) unless `base` or `grid` says `save_final: true`."""


@dataclass
class StudySettings:
    """Settings of the sweep itself, in a grid file's `base` beside the pretrain settings."""

    timeout_s: float = setting(1800.0, "wall-clock limit per point; a point past it is killed and recorded as a "
                                       "timeout")
    overlap_startup: bool = setting(False, "launch the next point while the current one trains: its host-side "
                                           "start-up (imports, preflight, model build) runs ahead and it waits at a "
                                           "start gate until the devices are free. Measured steps never overlap; "
                                           "never used beside an offload point; off by default because on a "
                                           "few-core host the early start-up competes with the measured steps")

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise UserError(f"timeout_s must be > 0, got {self.timeout_s}")


STUDY_SETTING_NAMES = tuple(f.name for f in dataclasses.fields(StudySettings))


def _in_file(where: str, build: Callable[[], Any]) -> Any:
    """`build()`, with a UserError that does not yet say where it comes from prefixed by `where`."""
    try:
        return build()
    except UserError as err:
        message = str(err)
        raise UserError(message if message.startswith(where) else f"{where}: {message}") from None


def as_list(value: Any) -> list[Any]:
    """A grid value as a list of values: a scalar is a list of one."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _matches(values: dict[str, Any], rule: dict[str, Any]) -> bool:
    """Whether a point's values (every axis, over base, over the defaults) match all keys of a rule."""
    return all(values[key] in as_list(allowed) for key, allowed in rule.items())


def _id_text(value: Any) -> str:
    """An axis value as it reads in a point id: true -> 1, 0.001 -> 0.001, mt5/base -> mt5_base."""
    if isinstance(value, bool):
        value = int(value)
    elif isinstance(value, float):
        value = f"{value:g}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(value))


def _field_default(name: str) -> Any:
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


@dataclass
class StudyGrid:
    """A parsed grid file: the shared pretrain settings (`base`), the axes and their values, the rules."""

    name: str
    source: Path
    data: str | dict[str, Any] | None
    settings: StudySettings
    base: dict[str, Any]
    """TrainConfig values every point shares (steady_skip for the file's skip_steps)."""
    axes: dict[str, list[Any]]
    """Every axis, classic ones first, with its values: the grid's, else [base's value or the field default]."""
    exclude: list[dict[str, Any]]
    include: list[dict[str, Any]]
    pretrain_command: list[str] | None = None
    repeats: int = 1
    """How many runs each point repeated gets (1: none); see `repeat_where`."""
    repeat_where: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The rules (exclude-style) choosing the points repeated; empty: every point."""

    @property
    def extra_axes(self) -> tuple[str, ...]:
        """The axes the grid names beside the classic ones (each is a results.csv column and a point-id suffix)."""
        return tuple(axis for axis in self.axes if axis not in CLASSIC_AXES)

    def point_values(self, config: TrainConfig) -> dict[str, Any]:
        """A point's value of every axis."""
        return {axis: getattr(config, axis) for axis in self.axes}

    def point_id(self, config: TrainConfig | dict[str, Any]) -> str:
        """Directory-safe id, e.g. mt5-base-z2-cpu-mb8-w4-n2 (+ -ac with activation checkpointing, + a suffix for
        each other axis the grid names, e.g. -compile1)."""
        values = config if isinstance(config, dict) else self.point_values(config)
        ident = (f"{_id_text(values['model'])}-z{values['zero']}-{values['offload']}-mb{values['micro_batch']}"
                 f"-w{values['loader_workers']}-n{values['nproc']}")
        ident += "-ac" if values["activation_checkpointing"] else ""
        return ident + "".join(f"-{axis}{_id_text(values[axis])}" for axis in self.extra_axes)

    def label(self, config: TrainConfig) -> str:
        """Progress label, e.g. "mt5-base zero=2 offload=cpu mb=8 w=4 n=2" (+ " ckpt", + " compile=True")."""
        text = (f"{config.model} zero={config.zero} offload={config.offload} mb={config.micro_batch} "
                f"w={config.loader_workers} n={config.nproc}")
        text += " ckpt" if config.activation_checkpointing else ""
        return text + "".join(f" {axis}={getattr(config, axis)}" for axis in self.extra_axes)

    def points(self, shards: str = "SHARDS", runs_dir: str | os.PathLike = "STUDY/runs") -> list[TrainConfig]:
        """The grid's points as TrainConfigs with data=`shards` and out=`runs_dir`/<point-id>.

        The product of the axes, minus `exclude` matches, plus `include` entries. An `exclude` rule removes
        every point whose values match all its keys (a list value matches any of its items). An `include` entry
        is a small grid of its own (scalars or lists); axes it does not name take their first grid value.
        Order: product order, then includes; duplicates are dropped. Then the repeats: the second run of each
        repeated point (id + `-r2`), then the third, ..., so a sweep cut short has every point once first.
        """
        names = list(self.axes)
        product = [dict(zip(names, values)) for values in itertools.product(*self.axes.values())]
        defaults = {name: _field_default(name) for name in AXIS_NAMES} | POINT_DEFAULTS | self.base
        chosen = [p for p in product if not any(_matches(defaults | p, rule) for rule in self.exclude)]
        for entry in self.include:
            sub_axes = [as_list(entry.get(axis, self.axes[axis][0])) for axis in names]
            chosen += [dict(zip(names, values)) for values in itertools.product(*sub_axes)]
        unique: dict[str, tuple[dict[str, Any], TrainConfig]] = {}
        for values in chosen:
            point_id = self.point_id(values)
            if point_id not in unique:
                unique[point_id] = values, self._point_config(values, point_id, shards, Path(runs_dir) / point_id)
        points = [config for _, config in unique.values()]
        repeated = [(point_id, config) for point_id, (values, config) in unique.items()
                    if not self.repeat_where or any(_matches(defaults | values, rule) for rule in self.repeat_where)]
        for run in range(2, self.repeats + 1):
            points += [dataclasses.replace(config, out=str(Path(runs_dir) / f"{point_id}-r{run}"))
                       for point_id, config in repeated]
        return points

    @staticmethod
    def repeat_of(config: TrainConfig) -> tuple[str, int]:
        """(the point's id, which run of it) for a point's config: runs/mt5-base-...-r2 -> (mt5-base-..., 2)."""
        name = Path(config.out).name
        match = REPEAT_SUFFIX.search(name)
        return (name[:match.start()], int(match.group(1))) if match else (name, 1)

    def _point_config(self, values: dict[str, Any], point_id: str, shards: str, run_dir: Path) -> TrainConfig:
        where = f"{self.source}: point {point_id}"

        def build(values: dict[str, Any]) -> TrainConfig:
            return config_from_values({**POINT_DEFAULTS, **self.base, **values, "data": str(shards),
                                       "out": str(run_dir)}, where=where)
        try:
            config = _in_file(where, lambda: build(values))
        except UserError as err:
            rule = self._combination(values, build)
            if rule is None:
                raise
            shown = ", ".join(f"{axis}: {_scalar(value)}" for axis, value in rule.items())
            raise UserError(f"{err}; or, to keep the grid's other points, leave this combination out: "
                            f"exclude: [{{{shown}}}]") from None
        if not 0 <= config.steady_skip < config.steps:
            raise UserError(f"{where}: {SKIP_STEPS_KEY} must be in [0, steps={config.steps}) so some steps are "
                            f"measured, got {config.steady_skip}")
        # what pretrain would refuse at once, from the settings alone: a model preset that is not there, and (where
        # pretrain spawns the point's nproc ranks itself) a global batch the micro batches cannot make up
        _check_model(config.model, where)
        if self.pretrain_command is None:
            _in_file(where, lambda: config.grad_accum(config.nproc))
        return config

    def _combination(self, values: dict[str, Any], build: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
        """The axis values of a point pretrain refuses that make it refused together: those of the axes where another
        of the grid's values makes the point valid (zero 3 with cudagraphs true: both); None unless two or more do
        (a value refused on its own is to be fixed, not left out)."""
        culprits = {}
        for axis, value in values.items():
            for other in self.axes.get(axis, []):
                if other == value:
                    continue
                try:
                    build({**values, axis: other})
                except UserError:
                    continue
                culprits[axis] = value
                break
        return culprits if len(culprits) > 1 else None


def _scalar(value: Any) -> str:
    """A value as YAML writes it in a rule (true, null, 3, cpu)."""
    if value is None or isinstance(value, bool):
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def _check_model(model: str, where: str) -> None:
    """A point's model is a preset in configs/models/ or a model YAML file, as pretrain.model.t5.load_config reads
    it (that module imports torch, which a grid check must not)."""
    path = Path(model)
    if path.suffix not in (".yaml", ".yml"):
        path = MODELS_DIR / f"{model}.yaml"
    if not path.is_file():
        presets = sorted(preset.stem for preset in MODELS_DIR.glob("*.yaml"))
        raise UserError(f"{where}: model preset {model!r} not found ({path}); pick one of: {', '.join(presets)}")


def _read_base(path: Path, raw: Any) -> tuple[StudySettings, dict[str, Any]]:
    """The `base` section -> (the sweep's own settings, the TrainConfig values every point shares)."""
    if not isinstance(raw, dict):
        raise UserError(f"{path}: base must be a mapping of settings, e.g. {{steps: 20, precision: bf16}}")
    if "extra_args" in raw:
        raise UserError(f"{path}: base.extra_args is gone: write each pretrain flag as its setting, e.g. "
                        f"`compile: true` for --compile, `force: true` for --force")
    allowed = {*STUDY_SETTING_NAMES, SKIP_STEPS_KEY, *AXIS_NAMES} - {"steady_skip"}
    bad = sorted(set(raw) - allowed)
    if bad:
        raise UserError(f"{path}: unknown base settings {bad}; allowed: {list(STUDY_SETTING_NAMES)}, "
                        f"{SKIP_STEPS_KEY} and any pretrain setting (`pretrain --help`, with _ for -)"
                        + ("; the study sets data and out itself" if set(bad) & set(SET_BY_STUDY) else ""))
    study = {key: value for key, value in raw.items() if key in STUDY_SETTING_NAMES}
    settings = _in_file(f"{path}: base", lambda: build_settings(StudySettings, study, where=f"{path}: base"))
    train = {key: value for key, value in raw.items() if key in AXIS_NAMES}
    if SKIP_STEPS_KEY in raw:
        train["steady_skip"] = raw[SKIP_STEPS_KEY]
    return settings, train


def _read_axes(path: Path, raw: Any, base: dict[str, Any], include: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every axis with its values: the classic ones, then those `grid` names, then those only `include` names."""
    if not isinstance(raw, dict):
        raise UserError(f"{path}: grid must be a mapping of axes to a value or a list, e.g. {{zero: [0, 1, 2, 3]}}")
    bad = sorted(set(raw) - set(AXIS_NAMES))
    if bad:
        raise UserError(f"{path}: unknown grid axes {bad}; an axis is any pretrain setting (`pretrain --help`, "
                        f"with _ for -) but data and out")
    both = sorted(set(raw) & set(base))
    if both:
        raise UserError(f"{path}: {both} in both base and grid; keep each in one of them")
    names = list(dict.fromkeys([*CLASSIC_AXES, *raw, *(key for entry in include for key in entry)]))
    axes: dict[str, list[Any]] = {}
    for axis in names:
        values = as_list(raw[axis]) if axis in raw else [base.get(axis, _field_default(axis))]
        if not values:
            raise UserError(f"{path}: grid.{axis} is empty; give a value or a list of values")
        axes[axis] = values
    return axes


def _read_rules(path: Path, raw: dict[str, Any], key: str) -> list[dict[str, Any]]:
    entries = raw.get(key) or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UserError(f"{path}: {key} must be a list of mappings like {{zero: [0, 1], offload: cpu}}")
    for entry in entries:
        unknown = sorted(set(entry) - set(AXIS_NAMES))
        if unknown:
            raise UserError(f"{path}: {key} entry {entry} names unknown axes {unknown}; axes are pretrain settings")
    return entries


def _read_repeats(path: Path, raw: Any) -> tuple[int, list[dict[str, Any]]]:
    """`repeats: 3` (every point three times) or `repeats: {times: 3, where: [{model: mt5-large, zero: 2}]}`."""
    spec = {"times": raw} if not isinstance(raw, dict) else raw
    times = spec.get("times")
    if isinstance(times, bool) or not isinstance(times, int) or times < 1 or set(spec) - {"times", "where"}:
        raise UserError(f"{path}: repeats must be a count >= 1 or {{times: 3, where: [rules like exclude's]}}, "
                        f"got {raw!r}")
    return times, _read_rules(path, {"repeats.where": spec.get("where")}, "repeats.where")


def load_grid(path: str | os.PathLike) -> StudyGrid:
    """Read a grid file and build every point; any problem raises `UserError` naming the file and the fix."""
    path = Path(path)
    raw = read_yaml(path, "grid file", hint="see configs/study/ for examples")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping with name, data, base, grid; see configs/study/cpu-tiny.yaml")
    unknown = sorted(set(raw) - set(GRID_KEYS))
    if unknown:
        raise UserError(f"{path}: unknown keys {unknown}; allowed: {sorted(GRID_KEYS)}")

    settings, base = _read_base(path, raw.get("base") or {})
    exclude, include = _read_rules(path, raw, "exclude"), _read_rules(path, raw, "include")
    axes = _read_axes(path, raw.get("grid") or {}, base, include)
    data = raw.get("data")
    if data is not None and not isinstance(data, (str, dict)):
        raise UserError(f"{path}: data must be a shard-set path or a prep spec {{input: ..., tokenizer: ...}}")
    if isinstance(data, dict) and ("input" not in data or "tokenizer" not in data):
        raise UserError(f"{path}: a data prep spec needs input and tokenizer (it is passed to `prep corpus`)")
    command = raw.get("pretrain_command")
    if command is not None and (not isinstance(command, list) or not all(isinstance(c, str) for c in command)):
        raise UserError(f"{path}: pretrain_command must be a list of strings, e.g. [deepspeed, -m, pretrain.cli]")
    repeats, repeat_where = _read_repeats(path, raw.get("repeats", 1))
    grid = StudyGrid(name=str(raw.get("name") or path.stem), source=path, data=data, settings=settings, base=base,
                     axes=axes, exclude=exclude, include=include, pretrain_command=command, repeats=repeats,
                     repeat_where=repeat_where)
    if not grid.points(data if isinstance(data, str) else "SHARDS"):     # builds (checks) every point
        raise UserError(f"{path}: the grid has no points left after exclude; loosen the exclude rules")
    return grid
