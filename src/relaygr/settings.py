"""One loader for the configuration dataclasses: ``load(cls, data)`` and ``changed(config, ...)``.

Every configuration in relaygr is a frozen dataclass that states its defaults and checks its own
invariants in ``__post_init__``. Building one from JSON-like data (a configuration file, ``--set``
overrides, a saved run) goes through ``load``: keys the class does not have are refused by name;
pydantic validates each value against the field's type and converts it where the conversion is
exact (a list to a tuple, a string to a ``Path`` or an enum member, nested mappings to nested
dataclasses, an integral float to an int); and every failure, the class's own checks included,
is one ``ConfigError`` naming the class and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from relaygr.errors import ConfigError

T = TypeVar("T")


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


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
    unknown = sorted(set(data) - {f.name for f in fields(cls)})  # type: ignore[arg-type]
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} keys: {unknown}")
    try:
        result: T = _adapter(cls).validate_python(dict(data))
        return result
    except ValidationError as exc:
        raise ConfigError(_describe(cls, exc)) from None


def changed(config: T, **changes: Any) -> T:
    """``config`` with ``changes`` applied, validated as ``load`` validates."""
    current = {f.name: getattr(config, f.name) for f in fields(config)}  # type: ignore[arg-type]
    return load(type(config), {**current, **changes})


def _describe(cls: type, exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{cls.__name__}.{where}: {message}" if where else message)
    return "; ".join(problems)
