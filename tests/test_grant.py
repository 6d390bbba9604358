"""The grant file: what the node agent writes for a container and the interposer
reads (gpuslice_common.grant). ``parse`` refuses whatever the format does not
allow, naming the line, and ``Grant`` cannot be made with a value the format
(or the interposer) cannot carry."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from gpuslice_common.grant import (
    GRANT_DIR,
    GRANT_FILE,
    MAX_DEVICES,
    Grant,
    GrantDevice,
    GrantError,
    parse,
)

GPU0 = "GPU-facefeed-0000-4000-8000-000000000000"
GPU1 = "GPU-facefeed-0000-4000-8000-000000000001"
MIB = 1 << 20
UINT64_MAX = (1 << 64) - 1

TEXT = f"""\
gpuslice-grant 1
node gpu-1.example.com
pod 0b3a9c3e-5d1f-4c7a-9e2b-1f2e3d4c5b6a
container main
policy force
priority 0
control required
context-overhead {384 * MIB}
device {GPU1} {4096 * MIB} 30
device {GPU0} {2048 * MIB} 100
"""


def grant(**overrides: Any) -> Grant:
    values: dict[str, Any] = {
        "node": "gpu-1.example.com",
        "pod_uid": "0b3a9c3e-5d1f-4c7a-9e2b-1f2e3d4c5b6a",
        "container": "main",
        "policy": "force",
        "priority": 0,
        "control_optional": False,
        "context_overhead_bytes": 384 * MIB,
        "devices": (
            GrantDevice(uuid=GPU1, memory_bytes=4096 * MIB, sm_percent=30),
            GrantDevice(uuid=GPU0, memory_bytes=2048 * MIB, sm_percent=100),
        ),
    }
    values.update(overrides)
    return Grant(**values)


def line_of(key: str) -> int:
    """The line of ``TEXT`` that holds ``key`` (1-based)."""
    return next(n for n, line in enumerate(TEXT.splitlines(), 1) if line.split(" ")[0] == key)


def with_line(key: str, replacement: str) -> str:
    """``TEXT`` with the (first) line of ``key`` replaced."""
    lines = TEXT.splitlines()
    lines[line_of(key) - 1] = replacement
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the format


def test_the_grant_lies_where_the_interposer_looks() -> None:
    assert (GRANT_DIR, GRANT_FILE) == ("/run/gpuslice", "grant")


def test_render_writes_the_format() -> None:
    assert grant().render() == TEXT


@pytest.mark.parametrize(
    "g",
    [
        grant(),
        grant(control_optional=True, policy="default", priority=1),
        grant(policy="disable", context_overhead_bytes=0),
        grant(devices=(GrantDevice(uuid="MIG-1/2/3", memory_bytes=0, sm_percent=0),)),
        grant(
            devices=tuple(
                GrantDevice(uuid=f"GPU-{i}", memory_bytes=UINT64_MAX - 1, sm_percent=i)
                for i in range(MAX_DEVICES)
            )
        ),
    ],
    ids=["full", "optional", "disable", "mig", "most"],
)
def test_parse_reads_back_what_render_writes(g: Grant) -> None:
    back = parse(g.render())
    assert back == g
    assert back.render() == g.render()


def test_device_order_is_the_container_s() -> None:
    assert [d.uuid for d in parse(TEXT).devices] == [GPU1, GPU0]


def test_comment_lines_are_skipped_anywhere() -> None:
    lines = TEXT.splitlines()
    commented = ["# made by the agent", lines[0], "#", *lines[1:5], "# limits", *lines[5:]]
    assert parse("\n".join(commented)) == grant()  # the last newline is optional too


# ----------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # the header
        (TEXT.replace("gpuslice-grant 1\n", ""), "line 1: a grant starts with"),
        (TEXT.replace("gpuslice-grant 1", "gpuslice-grant 2"), "line 1: a grant starts with"),
        ("", "a grant starts with 'gpuslice-grant 1'"),
        ("# only a comment\n", "a grant starts with 'gpuslice-grant 1'"),
        # keys
        (with_line("node", "nodes gpu-1"), f"line {line_of('node')}: unknown key 'nodes'"),
        (TEXT + "memory 1\n", "line 11: unknown key 'memory'"),
        (TEXT + "Node x\n", "line 11: unknown key 'Node'"),
        (TEXT + "priority 1\n", "line 11: priority given twice"),
        (TEXT + "node other\n", "line 11: node given twice"),
        (with_line("node", "node a b"), f"line {line_of('node')}: node takes one value"),
        (with_line("node", "node"), f"line {line_of('node')}: node takes one value"),
        # empty fields and lines
        (with_line("node", "node  gpu-1"), f"line {line_of('node')}: an empty field"),
        (with_line("node", "node gpu-1 "), f"line {line_of('node')}: an empty field"),
        (with_line("device", f"device {GPU1}  1 2"), f"line {line_of('device')}: an empty field"),
        (TEXT.replace("container main\n", "container main\n\n"), "line 5: an empty line"),
        (TEXT + "\n", "line 11: an empty line"),
        # values
        (with_line("policy", "policy fair"), f"line {line_of('policy')}: policy: Input should be"),
        (with_line("control", "control off"), f"line {line_of('control')}: control is required"),
        (with_line("priority", "priority 2"), f"line {line_of('priority')}: priority: Input"),
        (with_line("node", "node gpu\r"), f"line {line_of('node')}: node: String should match"),
        (with_line("node", "node #1"), f"line {line_of('node')}: node: String should match"),
        (with_line("node", "node n\u00e9"), f"line {line_of('node')}: node: String should match"),
        (with_line("node", f"node {'n' * 254}"), f"line {line_of('node')}: node: String should"),
    ],
)
def test_parse_refuses_and_names_the_line(text: str, message: str) -> None:
    with pytest.raises(GrantError, match="^" + re.escape(message)):
        parse(text)


@pytest.mark.parametrize("number", ["-1", "+1", "1e3", "abc", "0x10", "1.5", "\u00b2", "\u0661"])
@pytest.mark.parametrize("key", ["priority", "context-overhead", "memory", "sm"])
def test_bad_numbers_are_refused(key: str, number: str) -> None:
    if key in ("memory", "sm"):
        fields = [GPU1, "1024", "30"]
        fields[1 if key == "memory" else 2] = number
        text = with_line("device", "device " + " ".join(fields))
        message = f"line {line_of('device')}: device <uuid> <memory bytes> <sm percent>"
    else:
        text = with_line(key, f"{key} {number}")
        message = f"line {line_of(key)}: {key} is a number"
    with pytest.raises(GrantError, match="^" + re.escape(message)):
        parse(text)


@pytest.mark.parametrize(
    ("key", "number"),
    [
        ("context-overhead", str(UINT64_MAX)),  # "no limit" to the interposer
        ("context-overhead", str(1 << 64)),
        ("memory", str(UINT64_MAX)),
        ("memory", "9" * 20),
        ("memory", "9" * 21),
        ("memory", "1" * 5000),  # past what int() takes, and still a GrantError
        ("sm", "101"),
        ("sm", "1000"),
    ],
)
def test_numbers_too_big_are_refused(key: str, number: str) -> None:
    if key in ("memory", "sm"):
        fields = [GPU1, "1024", "30"]
        fields[1 if key == "memory" else 2] = number
        text = with_line("device", "device " + " ".join(fields))
        where = line_of("device")
    else:
        text = with_line(key, f"{key} {number}")
        where = line_of(key)
    with pytest.raises(GrantError, match=f"^line {where}: "):
        parse(text)


def test_the_largest_numbers_are_taken() -> None:
    text = with_line("device", f"device {GPU1} {UINT64_MAX - 1} 100")
    text = text.replace(f"context-overhead {384 * MIB}", f"context-overhead {UINT64_MAX - 1}")
    got = parse(text)
    assert got.context_overhead_bytes == UINT64_MAX - 1
    assert (got.devices[0].memory_bytes, got.devices[0].sm_percent) == (UINT64_MAX - 1, 100)


@pytest.mark.parametrize(
    ("key", "missing"),
    [
        ("node", "node"),
        ("pod", "pod"),
        ("container", "container"),
        ("policy", "policy"),
        ("priority", "priority"),
        ("control", "control"),
        ("context-overhead", "context-overhead"),
    ],
)
def test_every_key_is_required(key: str, missing: str) -> None:
    text = "\n".join(line for line in TEXT.splitlines() if line.split(" ")[0] != key)
    with pytest.raises(GrantError, match=f"^grant: {missing}: Field required"):
        parse(text)


def test_a_grant_without_devices_is_refused() -> None:
    text = "\n".join(line for line in TEXT.splitlines() if not line.startswith("device "))
    with pytest.raises(GrantError, match=r"^grant: devices: .*at least 1"):
        parse(text)


def test_a_device_given_twice_is_refused_at_its_line() -> None:
    text = TEXT + f"device {GPU1} 1 1\n"
    with pytest.raises(GrantError, match=f"^line 11: device {GPU1} given twice"):
        parse(text)


def test_more_devices_than_the_interposer_holds_are_refused_at_the_line() -> None:
    devices = "".join(f"device GPU-{i} 1 1\n" for i in range(MAX_DEVICES + 1))
    base = "\n".join(line for line in TEXT.splitlines() if not line.startswith("device ")) + "\n"
    assert parse(base + "".join(devices.splitlines(keepends=True)[:MAX_DEVICES]))
    first_device = len(base.splitlines()) + 1
    with pytest.raises(GrantError, match=f"^line {first_device + MAX_DEVICES}: more than 16"):
        parse(base + devices)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (f"device GPU-a b {MIB} 30", "device <uuid> <memory bytes> <sm percent>"),  # space
        (f"device {MIB} 30", "device <uuid> <memory bytes> <sm percent>"),
        (f"device {GPU1} {MIB}", "device <uuid> <memory bytes> <sm percent>"),
        (f"device {GPU1} {MIB} 30 1", "device <uuid> <memory bytes> <sm percent>"),
        (f"device GPU_1 {MIB} 30", "String should match pattern"),
        (f"device GPU-\u00e9 {MIB} 30", "String should match pattern"),
        (f"device GPU-1\r {MIB} 30", "String should match pattern"),
        (f"device {'G' * 96} {MIB} 30", "String should match pattern"),  # past GS_UUID_LEN
    ],
)
def test_bad_devices_are_refused_at_their_line(device: str, message: str) -> None:
    with pytest.raises(GrantError, match=f"^line {line_of('device')}: .*{re.escape(message)}"):
        parse(with_line("device", device))


def test_a_grant_too_long_is_refused() -> None:
    with pytest.raises(GrantError, match="longer than 65536 bytes"):
        parse(TEXT + "#" * 65536 + "\n")


def test_a_grant_error_is_a_value_error() -> None:
    assert issubclass(GrantError, ValueError)


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"node": ""}, "node"),
        ({"node": "a b"}, "node"),
        ({"node": "gpu-1\n"}, "node"),  # would add a line to the file
        ({"node": "gpu-1\npriority 1"}, "node"),
        ({"node": "#gpu"}, "node"),
        ({"node": "n" * 254}, "node"),
        ({"pod_uid": "p" * 129}, "pod_uid"),
        ({"pod_uid": "uid "}, "pod_uid"),
        ({"container": "main\tx"}, "container"),
        ({"policy": "fair"}, "policy"),
        ({"priority": 2}, "priority"),
        ({"priority": -1}, "priority"),
        ({"context_overhead_bytes": -1}, "context_overhead_bytes"),
        ({"context_overhead_bytes": UINT64_MAX}, "context_overhead_bytes"),
        ({"devices": ()}, "devices"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_grant_the_format_cannot_carry_cannot_be_made(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError) as info:
        grant(**overrides)
    assert info.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"uuid": ""}, "uuid"),
        ({"uuid": "GPU-1 2"}, "uuid"),
        ({"uuid": "GPU-1\n"}, "uuid"),
        ({"uuid": "GPU-" + "f" * 92}, "uuid"),  # 96 bytes: no room for the NUL
        ({"uuid": "GPU-\u00e9"}, "uuid"),
        ({"memory_bytes": -1}, "memory_bytes"),
        ({"memory_bytes": UINT64_MAX}, "memory_bytes"),
        ({"sm_percent": -1}, "sm_percent"),
        ({"sm_percent": 101}, "sm_percent"),
    ],
)
def test_a_device_the_format_cannot_carry_cannot_be_made(
    values: dict[str, Any], field: str
) -> None:
    base: dict[str, Any] = {"uuid": GPU0, "memory_bytes": MIB, "sm_percent": 30}
    with pytest.raises(ValidationError) as info:
        GrantDevice(**{**base, **values})
    assert info.value.errors()[0]["loc"][0] == field


def test_the_longest_uuid_is_taken() -> None:
    uuid = "GPU-" + "f" * 91  # 95 bytes and the NUL: GS_UUID_LEN
    device = GrantDevice(uuid=uuid, memory_bytes=1, sm_percent=1)
    assert parse(grant(devices=(device,)).render()).devices == (device,)


def test_a_grant_with_a_device_twice_cannot_be_made() -> None:
    device = GrantDevice(uuid=GPU0, memory_bytes=MIB, sm_percent=30)
    with pytest.raises(ValidationError, match="a device is given twice"):
        grant(devices=(device, device.model_copy(update={"memory_bytes": 2 * MIB})))


def test_a_grant_with_too_many_devices_cannot_be_made() -> None:
    devices = tuple(
        GrantDevice(uuid=f"GPU-{i}", memory_bytes=1, sm_percent=1) for i in range(MAX_DEVICES + 1)
    )
    with pytest.raises(ValidationError) as info:
        grant(devices=devices)
    assert info.value.errors()[0]["loc"][0] == "devices"


def test_a_grant_is_frozen() -> None:
    g = grant()
    with pytest.raises(ValidationError):
        g.priority = 1  # type: ignore[misc]
