"""The one JSON conversion of the analysis results (reports, verdicts, layout results, estimates).

Every result is a frozen dataclass of typed fields; `to_json` writes it as plain JSON values (a dataclass as an
object of its fields, tuples as lists) and `from_json` reads such an object back into the dataclass, driven by the
field types (nested dataclasses, `X | None`, `tuple[X, ...]`, `list[X]`, `dict[str, X]`). A dataclass may name
derived figures in `JSON_PROPERTIES` (properties written beside its fields for readers of the JSON; not read
back). Keys that are not fields are ignored on reading, so a file written with more figures still reads.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def to_json(value: Any) -> Any:
    """`value` as JSON values: dataclasses as objects (fields, then their `JSON_PROPERTIES`), tuples and lists as
    lists, dicts with their values converted."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {field.name: to_json(getattr(value, field.name)) for field in dataclasses.fields(value)}
        return {**fields, **{name: to_json(getattr(value, name)) for name in getattr(value, "JSON_PROPERTIES", ())}}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


def from_json(cls: type[T], data: Any) -> T:
    """The `cls` (a dataclass, or a field type such as `list[X]` or `X | None`) that `to_json` wrote as `data`."""
    return _read(cls, data)


def _read(kind: Any, data: Any) -> Any:
    if data is None:
        return None
    origin, params = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        present = [param for param in params if param is not type(None)]
        return _read(present[0], data) if len(present) == 1 else data
    if origin in (list, tuple):
        item = params[0] if params else Any
        values = [_read(item, value) for value in data]
        return values if origin is list else tuple(values)
    if origin is dict:
        return {key: _read(params[1], value) for key, value in data.items()}
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = _hints(kind)
        return kind(**{field.name: _read(hints[field.name], data[field.name])
                       for field in dataclasses.fields(kind) if field.name in data})
    return data


@functools.cache
def _hints(kind: type) -> dict[str, Any]:
    """The resolved field types of a dataclass (its annotations are strings under postponed evaluation)."""
    return typing.get_type_hints(kind, vars(sys.modules[kind.__module__]))
