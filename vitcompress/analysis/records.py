"""How the model map's records name graph nodes and how they become JSON.

A record's node-name fields are handles into one captured graph: they are compared by no one
(``field(compare=False)``) and written nowhere, so a record read back from JSON equals the record
written and names no nodes (``GRAPH_NODE_ABSENT``; ``ModelMap.has_nodes``). Every other field is
written under its own name, tuples as lists, and read back with its declared type.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, field, fields
from typing import Any, Self, TypeVar, get_args, get_origin

# What a node name holds in a record read back from JSON: no graph is named.
GRAPH_NODE_ABSENT = ""

Record = TypeVar("Record")


def graph_node() -> Any:
    """A field naming a node of the captured graph: left out of equality and of the JSON."""
    return _node_field(GRAPH_NODE_ABSENT)


def graph_nodes() -> Any:
    """A field naming several nodes of the captured graph (see :func:`graph_node`)."""
    return _node_field(())


def _node_field(absent: Any) -> Any:
    return field(default=absent, compare=False)


def record_to_json(record: Any) -> dict[str, Any]:
    """The fields of a dataclass ``record`` that say something about the model (those compared),
    in declaration order, tuples as lists."""
    return {f.name: _plain(getattr(record, f.name)) for f in fields(record) if f.compare}


def record_from_json(kind: type[Record], data: dict[str, Any]) -> Record:
    """The record of type ``kind`` that :func:`record_to_json` wrote: each compared field read
    with its declared type (a missing one takes its default); a node field names no node."""
    hints = typing.get_type_hints(kind)
    values: dict[str, Any] = {}
    for f in fields(kind):  # type: ignore[arg-type]
        if not f.compare:
            if f.default is MISSING and f.default_factory is MISSING:
                values[f.name] = GRAPH_NODE_ABSENT
        elif f.name in data:
            values[f.name] = _typed(hints[f.name], data[f.name])
    return kind(**values)


class JsonRecord:
    """A dataclass record written and read back by :func:`record_to_json` and
    :func:`record_from_json`."""

    def to_json(self) -> dict[str, Any]:
        return record_to_json(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        return record_from_json(cls, data)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


def _typed(hint: Any, value: Any) -> Any:
    """``value`` as JSON holds it, made of the type ``hint`` says: lists where a tuple is
    declared become tuples, at every depth."""
    if value is None:
        return None
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in get_args(hint) if arg is not type(None)]
        return _typed(options[0], value) if len(options) == 1 else value
    if origin is tuple:
        items = [arg for arg in get_args(hint) if arg is not Ellipsis]
        if len(items) == 1:
            return tuple(_typed(items[0], item) for item in value)
        return tuple(_typed(arg, item) for arg, item in zip(items, value, strict=True))
    if origin is list:
        return [_typed(get_args(hint)[0], item) for item in value]
    return value
