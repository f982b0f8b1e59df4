"""One loader for the configuration dataclasses: ``load(cls, data)`` and ``changed(config, ...)``.

Every configuration in relaygr is a frozen dataclass that states its defaults and checks its own
invariants in ``__post_init__``; a configuration of a larger part is composed of its parts'
configurations (a field whose type is another configuration dataclass). Building one from
JSON-like data (a configuration file, ``--set`` overrides, a saved run) goes through ``load``:
keys the class does not have are refused by name, at any depth; pydantic validates each value
against the field's type and converts it where the conversion is exact (a list to a tuple, a
string to a ``Path`` or an enum member, nested mappings to nested dataclasses, an integral float
to an int); and every failure, the classes' own checks included, is one ``ConfigError`` naming
the field's path from the outer class (``SystemConfig.trigger.risk_fraction``). A nested
mapping states only the fields it changes: the rest take their defaults (``load``) or keep their
values (``changed``).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from relaygr.errors import ConfigError

T = TypeVar("T")


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}

# A class's own check names the field it refuses as "ClassName.field ..." (relaygr's convention).
_OWN_CHECK = re.compile(r"^[A-Z]\w*\.(?=\w)")


def _adapter(cls: type) -> TypeAdapter[Any]:
    """One adapter per class (building one compiles its validator: milliseconds)."""
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def load(cls: type[T], data: Mapping[str, Any]) -> T:
    """``cls`` from ``data`` (see the module docstring); ``ConfigError`` on any bad key or value."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{cls.__name__} takes a mapping of its fields, got "
                          f"{type(data).__name__}")
    _refuse_unknown(cls, data, cls.__name__)
    try:
        result: T = _adapter(cls).validate_python(dict(data))
        return result
    except ValidationError as exc:
        raise ConfigError(_describe(cls, exc)) from None


def changed(config: T, **changes: Any) -> T:
    """``config`` with ``changes`` applied, validated as ``load`` validates. A mapping given for
    a nested configuration changes only the fields it names."""
    return load(type(config), _merged(config, changes))


def require_positive_ints(config: Any, *names: str) -> None:
    """``ConfigError`` naming the first of ``config``'s fields ``names`` that is not a positive
    int (a bool is not one): the check configurations share in ``__post_init__``."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(config).__name__}.{name} must be a positive int, got "
                              f"{value!r}")


def _merged(config: Any, changes: Mapping[str, Any]) -> dict[str, Any]:
    current = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for name, value in changes.items():
        now = current.get(name)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(now) \
                and not isinstance(now, type):
            value = _merged(now, value)
        current[name] = value
    return current


def _config_in(hint: Any) -> tuple[type | None, bool]:
    """The configuration dataclass a field of type ``hint`` holds, alone or optional or as a
    ``tuple[C, ...]`` (then the flag is true); ``None`` when it holds none."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _config_in(inner[0]) if len(inner) == 1 else (None, False)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item, many = _config_in(args[0])
        return (item, True) if item is not None and not many else (None, False)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, False
    return None, False


def _refuse_unknown(cls: type, data: Mapping[str, Any], path: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown {path} keys: {unknown}")
    for name, hint in typing.get_type_hints(cls, include_extras=False).items():
        inner, many = _config_in(hint) if name in data else (None, False)
        if inner is None:
            continue
        value = data[name]
        if many and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    _refuse_unknown(inner, item, f"{path}.{name}.{i}")
        elif not many and isinstance(value, Mapping):
            _refuse_unknown(inner, value, f"{path}.{name}")


def _describe(cls: type, exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if not where:
            problems.append(message)
        elif isinstance(error.get("ctx", {}).get("error"), ConfigError) \
                and _OWN_CHECK.match(message):   # a nested class's own check: name its path
            problems.append(_OWN_CHECK.sub(f"{cls.__name__}.{where}.", message, count=1))
        else:
            problems.append(f"{cls.__name__}.{where}: {message}")
    return "; ".join(problems)
