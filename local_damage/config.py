"""Dataclass configs loaded from YAML: unknown keys are errors, `--set a.b=value` overrides any field.

The generic machinery (``from_dict``, ``apply_overrides``, ``to_dict``) works on any nesting of
dataclasses; the training config itself is :class:`local_damage.train.config.Config`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from data_prep.errors import LocalDamageError
from data_prep.store import atomic_path

T = TypeVar("T")


class ConfigError(LocalDamageError, ValueError):
    """A config file or override that does not fit the config's fields."""


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the annotated type, with a clear error."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        is_none = value is None or (
            isinstance(value, str) and value.lower() in ("none", "null", "~")
        )
        if is_none and len(args) < len(typing.get_args(typ)):
            return None
        last_error = None
        for arg in args:
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                last_error = exc
        raise last_error or ConfigError(f"{where}: cannot interpret {value!r}")
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping of fields, got {value!r}")
        return from_dict(typ, value, where)
    if origin in (list, tuple):
        (item_type, *_) = typing.get_args(typ) or (Any,)
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        items = [_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if typ is Any:
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if not f.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(f)
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, Mapping | list):
            raise ConfigError(f"{where}: expected text, got {value!r}")
        if isinstance(value, bool):  # YAML reads a bare off/on/no/yes as a boolean
            return "on" if value else "off"
        return str(value)
    if origin is typing.Literal:
        allowed = typing.get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    return value


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str = "config") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys raise :class:`ConfigError`."""
    data = dict(data or {})
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid keys are {', '.join(names)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a dataclass config (tuples become lists, ready for YAML/JSON)."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def apply_overrides(cfg: T, overrides: Iterable[str]) -> T:
    """Return a copy of ``cfg`` with ``dotted.key=value`` overrides applied (values parsed as YAML)."""
    data = to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. train.batch_size=16")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section of the config"
                )
            node = node[part]
        if parts[-1] not in node:
            raise ConfigError(
                f"override {item!r}: unknown key {key!r}; valid keys here are {', '.join(node)}"
            )
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return from_dict(type(cfg), data)


def load_yaml(cls: type[T], path: str | Path | None, overrides: Iterable[str] = ()) -> T:
    """Load ``cls`` from a YAML file (or defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    cfg = from_dict(cls, data, where=str(path) if path else "config")
    return apply_overrides(cfg, overrides)


def save_yaml(cfg: Any, path: str | Path) -> None:
    """Write a config as YAML atomically."""
    with atomic_path(path, suffix=".yaml") as tmp:
        tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
