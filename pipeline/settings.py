"""Settings as typed dataclass fields: one field carries its default, help text and choices; the argparse
flags and the YAML keys of a command are generated from it, never restated by hand.

    @dataclass
    class CorpusConfig:
        input_length: int = setting(512, "tokens per example input")
    add_flags(parser, CorpusConfig)                       # --input-length N  "tokens per example input (default 512)"
    values = merged_settings(CorpusConfig, parser.parse_args(argv))    # flags over `--config FILE` over defaults

A few lines of our own instead of `tyro` or `jsonargparse`: the commands keep their flag spellings
(`--zero 2`, `--compile`, `--bf16`), the defaults are argparse.SUPPRESS so a YAML file sits between the
defaults and the flags, and a bad value is a `UserError` from the dataclass's own `__post_init__`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import UserError, describe_os_error

_NO_DEFAULT_TEXT = object()


def setting(default: Any = dataclasses.MISSING, help: str = "", *, choices: tuple | None = None,
            flag: bool = True, metavar: str | None = None, default_factory: Any = dataclasses.MISSING,
            default_text: Any = _NO_DEFAULT_TEXT, nargs: str | None = None) -> Any:
    """A dataclass field with the metadata `add_flags` reads.

    flag=False keeps a setting out of the command line (YAML only, e.g. nested mappings); `default_text`
    replaces the "(default ...)" shown in --help (None hides it), for defaults that are derived at run time.
    """
    metadata = {"help": help, "choices": choices, "flag": flag, "metavar": metavar, "default_text": default_text,
                "nargs": nargs}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(name: str) -> str:
    """The command-line spelling of a field: micro_batch -> --micro-batch."""
    return "--" + name.replace("_", "-")


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _without_none(hint: Any) -> Any:
    """int | None -> int (an optional setting is typed by what it holds when set)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _base_type(hint: Any) -> Any:
    """int | None -> int; list[str] -> list; everything else as is."""
    hint = _without_none(hint)
    return typing.get_origin(hint) or hint


def setting_type(cls: type, name: str) -> Any:
    """The type field `name` of `cls` holds when set (int | None -> int, dict[str, Any] -> dict), None if no field."""
    hint = typing.get_type_hints(cls).get(name)
    return None if hint is None else _base_type(hint)


def _help_text(f: dataclasses.Field) -> str:
    text = f.metadata.get("help", "")
    shown = f.metadata.get("default_text", _NO_DEFAULT_TEXT)
    if shown is _NO_DEFAULT_TEXT:
        if f.default is dataclasses.MISSING or f.default is None or f.default is False or f.default == "":
            return text
        shown = f.default
    return text if shown is None else f"{text} (default {shown})"


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls` whose metadata allows it, typed from the annotation; bools are switches."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("flag", True):
            continue
        kind = _base_type(hints[f.name])
        options: dict[str, Any] = {"dest": f.name, "help": _help_text(f), "default": argparse.SUPPRESS}
        if kind is bool:
            # a switch off by default; one on by default, or decided at run time (None), also gets --no-NAME
            options["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        else:
            if kind is list:
                options["nargs"] = f.metadata.get("nargs") or "+"
                item = typing.get_args(_without_none(hints[f.name]))
                options["type"] = item[0] if item else str
            else:
                options["type"] = kind if kind in (int, float) else str
                if f.metadata.get("nargs"):
                    options["nargs"] = f.metadata["nargs"]
            if f.metadata.get("choices"):
                options["choices"] = f.metadata["choices"]
            if f.metadata.get("metavar"):
                options["metavar"] = f.metadata["metavar"]
        parser.add_argument(flag_name(f.name), **options)


def read_yaml(path: str | os.PathLike, what: str, hint: str = "pass an existing YAML file") -> Any:
    """The YAML content of `path`, a `what` ("config file", "grid file", ...): a directory, a missing or unreadable
    file, text that is not UTF-8 or not YAML is one UserError naming the file (hint: the fix for a missing one)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: a directory, not a {what}; pass a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such {what}; {hint}") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}); save the {what} "
                        f"as UTF-8 YAML") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read the {what} ({describe_os_error(err)}); check the path and its "
                        f"permissions") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML ({str(err).splitlines()[0]}); fix the syntax") from None


def load_yaml_settings(path: str | os.PathLike, cls: type, *, command: str,
                       extra_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a `--config` YAML file into field names of `cls` ('-' or '_' accepted); unknown keys are refused."""
    raw = read_yaml(path, "config file", hint="pass an existing YAML file to --config") or {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of setting names to values, got {type(raw).__name__}")
    values = {str(key).replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(values) - field_names(cls) - set(extra_keys))
    if unknown:
        raise UserError(f"{path}: unknown keys {unknown}; use the flag names of `{command} --help`")
    return values


def merged_settings(cls: type, flags: argparse.Namespace | dict[str, Any], *, command: str,
                    config_key: str = "config", extra_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Flags over the YAML file named by `--config` (if any): the keyword arguments for `cls(...)`."""
    given = dict(vars(flags) if isinstance(flags, argparse.Namespace) else flags)
    values: dict[str, Any] = {}
    path = given.pop(config_key, None)
    if path is not None:
        values.update(load_yaml_settings(path, cls, command=command, extra_keys=extra_keys))
    values.update(given)
    return values


def build_settings(cls: type, values: dict[str, Any], *, where: str) -> Any:
    """`cls(**values)`, with a wrong type in a YAML file or grid (a string for an int) as one UserError line."""
    hints = typing.get_type_hints(cls)
    values = dict(values)
    for name, value in values.items():
        kind = _base_type(hints.get(name, Any))
        if kind is float and isinstance(value, str):     # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                values[name] = value = float(value)
            except ValueError:
                pass
        ok = (value is None or kind is Any or isinstance(value, kind)
              or (kind is float and isinstance(value, int) and not isinstance(value, bool)))
        if not ok or (kind in (int, float) and isinstance(value, bool)):
            raise UserError(f"{where}: {name} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return cls(**values)


def to_yaml_values(config: Any) -> dict[str, Any]:
    """The fields of a settings dataclass as plain YAML-ready values (tuples as lists)."""
    return {name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(config).items()}
