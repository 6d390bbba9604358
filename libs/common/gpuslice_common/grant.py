"""A container's grant: the limits the node agent gives it, as the interposer reads them.

At Allocate the device plugin writes one grant per GPU container (``render``) into
the container's host directory, which is mounted read-only at ``GRANT_DIR``
inside the container. The interposer (``native/src/config.c``) reads it before
anything else, so every process of the container is held to the same limits
whatever its environment. ``parse`` reads the format back with the same rules
as the C side (tools and tests); both refuse anything they do not know.

Format (text, one setting a line, one space between fields, ``#`` starts a
comment line; every key once except ``device``, all required)::

    gpuslice-grant 1
    node <name>
    pod <uid>
    container <name>
    policy default|force|disable
    priority 0|1
    control required|optional
    context-overhead <bytes>
    device <uuid> <memory bytes> <sm percent 0..100>
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

from pydantic import Field, ValidationError, model_validator

from gpuslice_common.models import Frozen

__all__ = ["GRANT_DIR", "GRANT_FILE", "MAX_DEVICES", "Grant", "GrantDevice", "GrantError", "parse"]

GRANT_DIR: Final = "/run/gpuslice"  # fixed in the interposer: not a setting
GRANT_FILE: Final = "grant"
HEADER: Final = "gpuslice-grant 1"
MAX_DEVICES: Final = 16  # GS_MAX_DEVICES
MAX_BYTES: Final = 65536
MAX_NUMBER: Final = (1 << 64) - 2  # a uint64_t below GS_NO_LIMIT, as the interposer reads it

# Patterns are anchored: pydantic finds a pattern anywhere in the string.
# A word is printable ASCII without spaces, not starting a comment.
_WORD: Final = r"^[!-\"$-~][!-~]*$"
_UUID: Final = r"^[A-Za-z0-9/-]{1,95}$"  # valid_uuid() below GS_UUID_LEN
# ASCII digits, at most 20 (a uint64_t): str.isdigit() takes '²' and other scripts'
# digits, and int() refuses more than 4300 digits with a ValueError of its own
_NUMBER: Final = re.compile(r"[0-9]{1,20}")

Bytes = Annotated[int, Field(ge=0, le=MAX_NUMBER)]


class GrantError(ValueError):
    """A grant that is not in the format; the message names the line."""


class GrantDevice(Frozen):
    uuid: Annotated[str, Field(pattern=_UUID)]
    memory_bytes: Bytes
    sm_percent: Annotated[int, Field(ge=0, le=100)]


class Grant(Frozen):
    node: Annotated[str, Field(pattern=_WORD, max_length=253)]
    pod_uid: Annotated[str, Field(pattern=_WORD, max_length=128)]
    container: Annotated[str, Field(pattern=_WORD, max_length=253)]
    policy: Literal["default", "force", "disable"]
    priority: Literal[0, 1]
    control_optional: bool  # CUDA_DISABLE_CONTROL is honoured
    context_overhead_bytes: Bytes
    devices: Annotated[tuple[GrantDevice, ...], Field(min_length=1, max_length=MAX_DEVICES)]

    @model_validator(mode="after")
    def _distinct_devices(self) -> Grant:
        uuids = [d.uuid for d in self.devices]
        if len(set(uuids)) != len(uuids):  # the interposer refuses such a grant
            raise ValueError(f"a device is given twice: {', '.join(uuids)}")
        return self

    def render(self) -> str:
        """The file's text."""
        lines = [
            HEADER,
            f"node {self.node}",
            f"pod {self.pod_uid}",
            f"container {self.container}",
            f"policy {self.policy}",
            f"priority {self.priority}",
            f"control {'optional' if self.control_optional else 'required'}",
            f"context-overhead {self.context_overhead_bytes}",
        ]
        lines += [f"device {d.uuid} {d.memory_bytes} {d.sm_percent}" for d in self.devices]
        return "\n".join(lines) + "\n"


_KEYS: Final = {
    "node": "node",
    "pod": "pod_uid",
    "container": "container",
    "policy": "policy",
    "priority": "priority",
    "control": "control_optional",
    "context-overhead": "context_overhead_bytes",
}


def parse(text: str) -> Grant:
    """Read a grant; :class:`GrantError` names what is wrong, and the line."""
    if len(text.encode()) > MAX_BYTES:
        raise GrantError(f"grant is longer than {MAX_BYTES} bytes")
    fields: dict[str, object] = {}
    where: dict[str, int] = {}  # field -> its line
    devices: list[GrantDevice] = []
    header = False
    lines = text.split("\n")
    if lines[-1] == "":  # the newline ending the last line
        lines.pop()
    for number, line in enumerate(lines, 1):
        if line.startswith("#"):
            continue
        if not line:  # the interposer takes an empty line for an empty field
            raise GrantError(f"line {number}: an empty line")
        if not header:
            if line != HEADER:
                raise GrantError(f"line {number}: a grant starts with {HEADER!r}")
            header = True
            continue
        key, *values = line.split(" ")
        if "" in values:
            raise GrantError(f"line {number}: an empty field")
        if key == "device":
            if len(values) != 3 or not all(_NUMBER.fullmatch(v) for v in values[1:]):
                raise GrantError(f"line {number}: device <uuid> <memory bytes> <sm percent>")
            if len(devices) == MAX_DEVICES:
                raise GrantError(f"line {number}: more than {MAX_DEVICES} devices")
            if any(d.uuid == values[0] for d in devices):
                raise GrantError(f"line {number}: device {values[0]} given twice")
            try:
                devices.append(
                    GrantDevice(
                        uuid=values[0], memory_bytes=int(values[1]), sm_percent=int(values[2])
                    )
                )
            except ValidationError as e:
                raise GrantError(f"line {number}: {_first(e)}") from None
            continue
        field = _KEYS.get(key)
        if field is None:
            raise GrantError(f"line {number}: unknown key {key!r}")
        if field in fields:
            raise GrantError(f"line {number}: {key} given twice")
        if len(values) != 1:
            raise GrantError(f"line {number}: {key} takes one value")
        value: object = values[0]
        if field == "control_optional":
            if value not in ("required", "optional"):
                raise GrantError(f"line {number}: control is required or optional")
            value = value == "optional"
        elif field in ("priority", "context_overhead_bytes"):
            if not _NUMBER.fullmatch(values[0]):
                raise GrantError(f"line {number}: {key} is a number")
            value = int(values[0])
        fields[field] = value
        where[field] = number
    if not header:
        raise GrantError(f"a grant starts with {HEADER!r}; this one has no such line")
    try:
        return Grant.model_validate({**fields, "devices": tuple(devices)})
    except ValidationError as e:
        field = str(e.errors()[0]["loc"][0])
        key = next(k for k, f in _KEYS.items() if f == field) if field in _KEYS.values() else field
        if field in where:
            raise GrantError(f"line {where[field]}: {key}: {_first(e)}") from None
        raise GrantError(f"grant: {key}: {_first(e)}") from None


def _first(e: ValidationError) -> str:
    return str(e.errors()[0]["msg"])
