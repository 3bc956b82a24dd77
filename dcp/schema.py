"""Config plumbing: nested frozen dataclasses ← YAML ← ``key.sub=value`` command-line overrides.

Each component owns a ``@dataclass(kw_only=True, frozen=True)`` config that validates itself in
``__post_init__``. This module only builds them from plain dicts: an unknown key anywhere raises
``ValueError`` naming its dotted path and the keys that are allowed there, and a value of the wrong
type raises naming the key. ``check_range`` is the one numeric check every ``__post_init__`` uses.
No global config object exists: configs are passed explicitly.

Every number a config takes is bounded here, whatever its key: its magnitude is at most
``MAX_NUMBER`` (2**53: a count, a size or a rate exactly representable as a float, so JSON, W&B
and numpy read it back unchanged, and sums of a few stay within 64 bits). A field that needs a
wider range says so in its metadata (``wider(MAX_SEED)``: seeds); the range a key's meaning
allows (``>= 1``, a memory bound) is its class's ``__post_init__``.

An override's value is read as YAML (``train.steps=7``, ``metrics.wandb_tags=[a, b]``), except
that a ``str`` field keeps the text as typed: ``name=2024`` names the run "2024", ``name=nan``
"nan" (a YAML file's ``name: 2024`` stays an integer and is refused; quote it there).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dcp.files import FileContentError, parse_yaml, yaml_problem
from dcp.files import load_yaml as load_yaml_file

logger = logging.getLogger(__name__)

MAX_SEED = 2**63 - 1
"""Largest seed a config takes: torch seeds are 64-bit, and megatron adds per-rank offsets."""

MAX_NUMBER = 2**53
"""Largest magnitude of any number in a config, unless its field declares a wider range."""
_MAX_ABS = "dcp.schema.max_abs"
"""Field-metadata key of a wider range (``wider``)."""


def wider(max_abs: int) -> dict[str, int]:
    """Field metadata for a number that may reach ``max_abs`` (beyond ``MAX_NUMBER``):
    ``seed: int = field(default=0, metadata=wider(MAX_SEED))``."""
    return {_MAX_ABS: max_abs}


_BOUNDS = ((">=", operator.ge), (">", operator.gt), ("<=", operator.le), ("<", operator.lt))


def check_range(
    value: Any,
    key: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    integer: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``key`` and the allowed range unless ``value`` is a finite
    number (an int when ``integer``; never a bool) with ``value >= ge``, ``> gt``, ``<= le`` and
    ``< lt`` (a bound left at None does not apply)."""
    bounds = [
        (symbol, test, bound)
        for (symbol, test), bound in zip(_BOUNDS, (ge, gt, le, lt), strict=True)
        if bound is not None
    ]
    if (
        isinstance(value, int if integer else int | float)
        and not isinstance(value, bool)
        and (isinstance(value, int) or math.isfinite(value))
        and all(test(value, bound) for _, test, bound in bounds)
    ):
        return
    allowed = " and ".join(f"{symbol} {_number(bound)}" for symbol, _, bound in bounds)
    kind = "an integer" if integer else "a finite number"
    raise ValueError(f"{key} must be {kind} {allowed}".rstrip() + f", got {value!r}")


def _number(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _section_types(tp: Any) -> tuple[type, ...]:
    """The config classes an annotation holds: ``tp`` itself, or the members of a union."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return tuple(
        arg for arg in (typing.get_args(tp) if union else (tp,)) if _is_dataclass_type(arg)
    )


@functools.cache
def config_keys(cls: type) -> frozenset[str]:
    """Every dotted key of config class ``cls``: its fields, and below each config section
    (optional ones too) the section's own keys: ``optim``, ``optim.lr``,
    ``model.rope_scaling.factor``."""
    hints = typing.get_type_hints(cls)
    keys = set()
    for f in dataclasses.fields(cls):
        if f.init:
            keys.add(f.name)
            for section in _section_types(hints[f.name]):
                keys.update(f"{f.name}.{key}" for key in config_keys(section))
    return frozenset(keys)


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


def _check_numbers(value: Any, key: str, max_abs: int) -> None:
    """Raise ``ValueError`` naming ``key`` when a number in ``value`` (a field's value, lists
    included) has a magnitude above ``max_abs``."""
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_numbers(item, f"{key}[{i}]", max_abs)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if not abs(value) <= max_abs:
            raise ValueError(
                f"{key} must be a number of magnitude at most {max_abs} (the bound of every "
                f"config number), got {value!r}"
            )


def from_dict[T](cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values raise ``ValueError``
    naming the dotted key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = rename_sections(cls, data)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(
            f"unknown config key {where}{unknown[0]!s}; allowed keys here: {sorted(fields)}"
        )
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{prefix or cls.__name__} is missing {missing}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        config = cls(**kwargs)
    except ValueError as exc:
        # A config names its fields bare or as ``ClassName.field``; here they get their path.
        message = str(exc).removeprefix(f"{cls.__name__}.")
        if prefix and not message.startswith(prefix):
            raise ValueError(f"{prefix}.{message}") from exc
        raise
    # After the class's own checks, whose ranges are tighter and say what the key means.
    for name, value in kwargs.items():
        key = f"{prefix}.{name}" if prefix else name
        _check_numbers(value, key, fields[name].metadata.get(_MAX_ABS, MAX_NUMBER))
    return config


def rename_sections(cls: type, data: Mapping[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """``data`` with the sections ``cls.renamed_sections`` ({old name: new name}) renamed, and a
    warning for each old name found; the old section's keys go under the new one, and a key
    set in both to different values is an error. Classes without the table: ``data`` as is."""
    renamed = getattr(cls, "renamed_sections", None) or {}
    out = dict(data)
    for old, new in renamed.items():
        if old not in out:
            continue
        section = out.pop(old)
        if warn:
            logger.warning(
                "config section %r is now %r; %r is still read in this release, rename it",
                old,
                new,
                old,
            )
        current = out.get(new)
        if not isinstance(section, Mapping) or not isinstance(current, Mapping | None):
            out[new] = section if current is None else current
            continue
        merged = dict(current or {})
        for key, value in section.items():
            if key in merged and merged[key] != value:
                raise ValueError(
                    f"{old}.{key}={value!r} and {new}.{key}={merged[key]!r}: {old!r} is the old "
                    f"name of {new!r}; set the key once, under {new!r}"
                )
            merged[key] = value
        out[new] = merged
    return out


def rename_key(cls: type, key: str) -> str:
    """Dotted ``key`` with an old section name of ``cls.renamed_sections`` replaced."""
    head, dot, rest = key.partition(".")
    renamed = getattr(cls, "renamed_sections", None) or {}
    return f"{renamed[head]}{dot}{rest}" if head in renamed else key


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
    return _apply_overrides(data, overrides)[0]


def _apply_overrides(
    data: dict[str, Any], overrides: Sequence[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """``apply_overrides``, and the text each override's dotted key was given (a key that a
    later override replaces, its section included, loses its text)."""
    out = _deepcopy(data)
    text: dict[str, str] = {}
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
        try:
            node[parts[-1]] = _parse_value(raw, source=f"override {item!r}")
        except yaml.YAMLError as exc:
            raise ValueError(f"override {item!r}: not valid YAML ({yaml_problem(exc)})") from None
        key = ".".join(parts)
        text = {k: v for k, v in text.items() if k != key and not k.startswith(key + ".")}
        text[key] = raw.strip()
    return out, text


def _parse_value(raw: str, *, source: str) -> Any:
    """YAML scalar/list parsing, plus ``1e-3`` style floats (YAML 1.1 reads them as strings);
    ``source`` names the text in errors (aliases and nesting are bounded as in files)."""
    if not raw.strip():
        return ""
    value = parse_yaml(raw, source=source)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _keep_text_of_str_fields(
    cls: type, data: dict[str, Any], override_text: dict[str, str]
) -> None:
    """Where an override gave a ``str`` field of ``cls`` a value YAML reads as something else (a
    number, bool, date, or null where the field is not optional), put back the text as typed:
    ``name=2024`` names the run "2024"."""
    for key, text in override_text.items():
        *parents, name = key.split(".")
        tp = _annotation(cls, key)
        union = (
            typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
        )
        if tp is not str and str not in union:
            continue
        optional = type(None) in union
        node = data
        for part in parents:
            node = node[part]
        value = node[name]
        if not isinstance(value, str | Mapping | list) and not (value is None and optional):
            node[name] = text


def _annotation(cls: type, key: str) -> Any:
    """The annotation of dotted ``key`` in config class ``cls``; None for an unknown key."""
    *sections, name = key.split(".")
    for part in sections:
        found = _section_types(typing.get_type_hints(cls).get(part))
        if not found:
            return None
        cls = found[0]
    return typing.get_type_hints(cls).get(name)


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in the YAML config file ``path``, read under ``dcp.files``' rules (size,
    aliases, nesting): every problem is one ``ValueError`` line naming the file."""
    try:
        data = load_yaml_file(path, what="YAML config") or {}
    except FileContentError as exc:
        raise ValueError(f"config file {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at top level")
    return data


def load_config[T](cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """YAML file (optional) + command-line overrides → validated config of type ``cls``.

    A config class may define ``prepare_dict(data) -> data``: it fills defaults that depend on
    the merged data itself (``PretrainConfig``: the model section from ``init.from_hf``).
    """
    data, override_text = _apply_overrides(load_yaml(path) if path is not None else {}, overrides)
    data = rename_sections(cls, data)
    override_text = {rename_key(cls, k): v for k, v in override_text.items()}
    _keep_text_of_str_fields(cls, data, override_text)
    prepare = getattr(cls, "prepare_dict", None)
    if prepare is not None:
        data = prepare(data)
    return from_dict(cls, data)
