"""RFC 6902 JSON Patch operations with RFC 6901 pointers, built one change at a time.

``add`` and ``replace``, and ``remove`` for the GPU resources DRA mode turns
into a claim. A map or list that does not exist yet is added whole, so the
patch never points into a missing parent.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

Operation = dict[str, Any]


def escape(token: str | int) -> str:
    """One reference token: ``~`` becomes ``~0`` and ``/`` becomes ``~1`` (in that order)."""
    return str(token).replace("~", "~0").replace("/", "~1")


def pointer(*tokens: str | int) -> str:
    """A JSON Pointer such as ``/spec/containers/0/resources/limits/nvidia.com~1gpu``."""
    return "".join("/" + escape(token) for token in tokens)


class Patch:
    """Operations in the order they were added."""

    def __init__(self) -> None:
        self.operations: list[Operation] = []

    def __bool__(self) -> bool:
        return bool(self.operations)

    def set(self, path: Sequence[str | int], value: Any, *, exists: bool) -> None:
        """Write ``value`` at ``path``: ``replace`` when something is there, else ``add``."""
        op = "replace" if exists else "add"
        self.operations.append({"op": op, "path": pointer(*path), "value": value})

    def remove(self, path: Sequence[str | int]) -> None:
        """Remove what is at ``path`` (it must exist)."""
        self.operations.append({"op": "remove", "path": pointer(*path)})

    def put(self, parent: Sequence[str | int], current: object, key: str, value: Any) -> None:
        """Set ``key`` in the map at ``parent`` (``current`` is that map, or None when
        absent): the whole map is added when there is none yet."""
        if not isinstance(current, Mapping):
            self.set(parent, {key: value}, exists=current is not None)
        else:
            self.set([*parent, key], value, exists=key in current)

    def append(self, parent: Sequence[str | int], current: object, items: Sequence[Any]) -> None:
        """Append ``items`` to the list at ``parent`` (``current``: that list, or None)."""
        if not items:
            return
        if not isinstance(current, list):
            self.set(parent, list(items), exists=current is not None)
            return
        end = pointer(*parent, "-")
        self.operations.extend({"op": "add", "path": end, "value": item} for item in items)

    def encoded(self) -> str:
        """The patch as the AdmissionReview response carries it: base64 of its JSON."""
        return base64.b64encode(orjson.dumps(self.operations)).decode("ascii")
