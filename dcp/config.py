"""Config plumbing: nested frozen dataclasses ← YAML ← ``key.sub=value`` command-line overrides.

Each component owns a ``@dataclass(kw_only=True, frozen=True)`` config that validates itself in
``__post_init__``. This module only builds them from plain dicts: an unknown key anywhere raises
``ValueError`` naming its dotted path and the keys that are allowed there, and a value of the wrong
type raises naming the key. No global config object exists: configs are passed explicitly.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` against the annotation ``tp``; raise ValueError naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ValueError(f"{key}: {value!r} is not one of {list(allowed)}")
        return value
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (tuple, list, Sequence):
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        elem = args[0] if args else Any
        items = [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def from_dict[T](cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values raise ``ValueError``."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(
            f"unknown config key {where}{unknown[0]!s}; allowed keys here: {sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if prefix and not str(exc).startswith(prefix):
            raise ValueError(f"{prefix}.{exc}") from exc
        raise


def to_dict(obj: Any) -> Any:
    """Plain-data view of a (nested) config, for YAML/JSON and W&B."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` applied (value parsed as YAML)."""
    out = _deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if not all(parts):
            raise ValueError(f"override {item!r} has an empty key")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return out


def _parse_value(raw: str) -> Any:
    """YAML scalar/list parsing, plus ``1e-3`` style floats (YAML 1.1 reads them as strings)."""
    if not raw.strip():
        return ""
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at top level")
    return data


def load_config[T](cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """YAML file (optional) + command-line overrides → validated config of type ``cls``.

    A config class may define ``prepare_dict(data) -> data``: it fills defaults that depend on
    the merged data itself (``PretrainConfig``: the model section from ``init.from_hf``).
    """
    data = apply_overrides(load_yaml(path) if path is not None else {}, overrides)
    prepare = getattr(cls, "prepare_dict", None)
    if prepare is not None:
        data = prepare(data)
    return from_dict(cls, data)
