"""Flat YAML configs with `key=value` overrides, validated whole at load time.

A stage declares its config as a dataclass; `load_config(Cls, path, overrides)` reads the YAML (or the
dataclass defaults when no path is given), applies `key=value` overrides parsed as YAML scalars/lists, and reports
*every* problem at once: unknown keys, wrong types, and the dataclass's own `validate()` messages.

A mapping-typed field is a section of its own (the on-policy driver's `generate:`, `score:`, `train:`): overrides
merge into it key by key (`train.lr=1e-5`).

A recipe (configs/recipes/) is one YAML file for several stages: its top-level keys are stage names (`SECTIONS`),
each holding that stage's flat config, and `load_config(..., section="train")` reads the one section.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pipeline.errors import UserError

T = TypeVar("T")
SECTIONS = ("generate", "score", "train", "onpolicy")  # the sections of a recipe file


class ConfigError(UserError, ValueError):
    """One or more problems in a config; the message lists all of them."""


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return out


def _check_type(name: str, value: Any, tp: Any) -> str | None:
    origin = typing.get_origin(tp)
    if tp is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        errors = [_check_type(name, value, a) for a in typing.get_args(tp)]
        return None if any(e is None for e in errors) else f"{name}: {value!r} is not {tp}"
    if tp is type(None):
        return None if value is None else f"{name}: expected null"
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            return f"{name}: expected a list, got {value!r}"
        (inner, *_) = typing.get_args(tp) or (Any,)
        for i, v in enumerate(value):
            if (e := _check_type(f"{name}[{i}]", v, inner)) is not None:
                return e
        return None
    if origin is dict:
        return None if isinstance(value, dict) else f"{name}: expected a mapping, got {value!r}"
    if tp is float:
        return None if isinstance(value, int | float) and not isinstance(value, bool) else f"{name}: expected a number, got {value!r}"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"{name}: expected an integer, got {value!r}"
    if tp is bool:
        return None if isinstance(value, bool) else f"{name}: expected true/false, got {value!r}"
    if tp is str:
        return None if isinstance(value, str) else f"{name}: expected a string, got {value!r}"
    return None


def _flatten(data: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """`lora.rank=8` (a dotted key) and `lora: {rank: 8}` (a mapping under a name that is not a field) both mean
    the flat field `lora_rank`; mapping-typed fields (e.g. train_extra) stay as they are."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        k = k if k in fields else k.replace(".", "_")
        if k not in fields and isinstance(v, dict) and all(isinstance(x, str) for x in v):
            out.update(_flatten({f"{k}_{x}": y for x, y in v.items()}, fields))
        else:
            out[k] = v
    return out


def _merge(data: dict[str, Any], overrides: dict[str, Any], mappings: set[str]) -> None:
    """Apply overrides to the file's values. A mapping-typed field (a section such as the on-policy driver's
    `train:`) is merged key by key, from `train.lr=1e-5` or `train={lr: 1e-5}`; every other key is replaced."""
    for k, v in overrides.items():
        section, dot, rest = k.partition(".")
        if dot and section in mappings:
            data[section] = {**(data.get(section) or {}), rest: v}
        elif k in mappings and isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | dict | None = None,
                section: str | None = None, launch: dict[str, Any] | None = None) -> T:
    """Build `cls` from a YAML file (optional) and overrides; raise ConfigError listing every problem. With
    `section`, a recipe file (top-level keys all in SECTIONS) contributes its `section:` mapping; a flat file is read
    as it is. `launch`: what the entry knows of the launch (e.g. `world_size`), passed to `cls.validate`."""
    data: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a config is a flat mapping of key: value")
        if section is not None and loaded and all(k in SECTIONS for k in loaded):
            if not isinstance(loaded.get(section), dict):
                raise ConfigError(f"{path}: this recipe has sections {', '.join(loaded)} but no `{section}:` "
                                  "mapping for this stage")
            loaded, where = loaded[section], f"{path} [{section}]"
        data.update(loaded)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    mappings = {k for k in fields if hints[k] is dict or typing.get_origin(hints[k]) is dict}
    _merge(data, parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {}), mappings)
    data = _flatten(data, fields)
    for k, v in data.items():  # PyYAML follows YAML 1.1, which reads 1e-3 (no dot) as a string
        if k in fields and isinstance(v, str) and (hints[k] is float or float in typing.get_args(hints[k])):
            try:
                data[k] = float(v)
            except ValueError:
                pass
    hint = getattr(cls, "key_hint", lambda key: None)
    problems = [f"unknown key {k!r} ({hint(k) or 'known: ' + ', '.join(sorted(fields))})" for k in data if k not in fields]
    problems += [e for k, v in data.items() if k in fields and (e := _check_type(k, v, hints[k])) is not None]
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    for k, v in list(data.items()):
        if hints[k] is float or float in typing.get_args(hints[k]):
            data[k] = float(v) if isinstance(v, int) and not isinstance(v, bool) else v
    cfg = cls(**data)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        problems = list(validate(**(launch or {})))
        if problems:
            raise ConfigError(f"{where}: " + "; ".join(problems))
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
