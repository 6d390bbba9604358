"""``gpuslice status`` against a real redis-server, with reservations made through the Ledger."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from typer.testing import CliRunner

from gpuslice_cli.main import app
from gpuslice_cli.status import (
    CardStatus,
    NodeStatus,
    gather_status,
    pod_count,
    table_columns,
    table_rows,
    without_password,
)
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    CardLayers,
    ContainerAssignment,
    DeviceGrant,
    LayerState,
    NodeInventory,
    Placement,
    PodRef,
)
from gpuslice_common.servers import free_port
from gpuslice_common.subjects import Subjects
from gpuslice_inventory.telemetry import TelemetryStore
from tests.conftest import make_inventory, make_vendor_inventory

ROOT = Path(__file__).resolve().parent.parent
MODEL = "NVIDIA A100-SXM4-80GB"
NV = "nvidia"
MIB = 1024 * 1024


def placement(uid: str, node: str, grants: list[list[tuple[int, int, int]]]) -> Placement:
    """grants[c] = [(gpu index, memory MiB, cores), ...] for app container c."""
    return Placement(
        pod=PodRef(uid=uid, namespace="ns", name=f"name-{uid}"),
        node=node,
        containers=tuple(
            ContainerAssignment(
                name=f"c{c}",
                devices=tuple(
                    DeviceGrant(uuid=f"GPU-{node}-{i}", memory_mib=m, cores=k) for i, m, k in devs
                ),
            )
            for c, devs in enumerate(grants)
        ),
    )


async def cli(redis_url: str, *args: str) -> Result:
    """Run ``gpuslice`` in-process (in a thread: the command runs its own event loop)."""
    env = {"GPUSLICE_REDIS_URL": redis_url, "GPUSLICE_LEDGER_PREFIX": "gpuslice", "COLUMNS": "200"}
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)


def cells(output: str, title: str = "gpuslice ledger") -> list[list[str]]:
    """The header and body rows of the table ``title`` as written to a pipe
    (tab-separated), as lists of cells."""
    rows: list[list[str]] = []
    inside = False
    for line in output.splitlines():
        if line.startswith("# "):
            inside = line == f"# {title}"
        elif inside:
            rows.append(line.split("\t"))
    return rows


@pytest.fixture
async def cluster(ledger: Ledger) -> Ledger:
    """node-a: two cards, memory scaled 1.5x, three pods (one released);
    node-b: one card, cordoned, holding one pod; node-c: a healthy and an unhealthy card."""
    await ledger.register_node(
        make_inventory("node-a", memory_mib=16000, memory_scaling=1.5), rebuilt=True
    )
    await ledger.register_node(make_inventory("node-b", gpus=1, split_count=4), rebuilt=True)
    inv_c = make_inventory("node-c", model="Tesla T4", memory_mib=15360)
    sick = inv_c.devices[1].model_copy(update={"healthy": False})
    await ledger.register_node(
        inv_c.model_copy(update={"devices": (inv_c.devices[0], sick)}), rebuilt=True
    )

    # pod-1: two containers share card 0 (5000 MiB, 40 cores, 2 slots), one also on card 1
    await ledger.reserve(
        placement("pod-1", "node-a", [[(0, 4000, 30)], [(1, 2000, 0), (0, 1000, 10)]])
    )
    await ledger.reserve(placement("pod-2", "node-a", [[(0, 3000, 20)]]))
    await ledger.mark_bound("pod-2")
    await ledger.reserve(placement("pod-3", "node-a", [[(1, 5000, 50)]]))
    await ledger.release("pod-3", reason="deleted")  # released: neither counted nor listed
    await ledger.reserve(placement("pod-4", "node-b", [[(0, 8000, 100)]]))
    await ledger.cordon("node-b", "GPU-node-b-0")
    return ledger


async def test_table_shows_allocations_pod_counts_and_health(
    cluster: Ledger, redis_url: str
) -> None:
    result = await cli(redis_url, "status")
    assert result.exit_code == 0, result.output
    # no telemetry yet: "-" in the used column
    assert cells(result.stdout) == [
        [
            "node",
            "gpu",
            "vendor",
            "model",
            "memory MiB",
            "used",
            "cores",
            "slots",
            "pods",
            "health",
        ],
        ["node-a", "0", NV, MODEL, "8000 / 24000", "-", "60 / 100", "3 / 10", "2", "healthy"],
        ["node-a", "1", NV, MODEL, "2000 / 24000", "-", "0 / 100", "1 / 10", "1", "healthy"],
        [
            "node-a",
            "total",
            NV,
            "2 GPUs",
            "10000 / 48000",
            "-",
            "60 / 200",
            "4 / 20",
            "2",
            "2 healthy",
        ],
        ["node-b", "0", NV, MODEL, "8000 / 16384", "-", "100 / 100", "1 / 4", "1", "cordoned"],
        [
            "node-b",
            "total",
            NV,
            "1 GPU",
            "8000 / 16384",
            "-",
            "100 / 100",
            "1 / 4",
            "1",
            "1 cordoned",
        ],
        ["node-c", "0", NV, "Tesla T4", "0 / 15360", "-", "0 / 100", "0 / 10", "0", "healthy"],
        ["node-c", "1", NV, "Tesla T4", "0 / 15360", "-", "0 / 100", "0 / 10", "0", "unhealthy"],
        [
            "node-c",
            "total",
            NV,
            "2 GPUs",
            "0 / 30720",
            "-",
            "0 / 200",
            "0 / 20",
            "0",
            "1 healthy, 1 unhealthy",
        ],
    ]
    assert result.stderr == ""


async def test_node_option_shows_only_that_node(cluster: Ledger, redis_url: str) -> None:
    result = await cli(redis_url, "status", "--node", "node-b")
    assert result.exit_code == 0, result.output
    assert [row[0] for row in cells(result.stdout)[1:]] == ["node-b", "node-b"]


async def test_json_document(cluster: Ledger, redis_url: str) -> None:
    result = await cli(redis_url, "status", "--json", "--node", "node-a")
    assert result.exit_code == 0, result.output

    def pod(uid: str, state: str, memory: int, cores: int) -> dict[str, Any]:
        named = {"uid": uid, "namespace": "ns", "name": f"name-{uid}", "state": state}
        return named | {"memory_mib": memory, "cores": cores}

    def card(index: int, **values: Any) -> dict[str, Any]:
        return {
            "index": index,
            "uuid": f"GPU-node-a-{index}",
            "vendor": "nvidia",
            "model": MODEL,
            "memory_physical_mib": 16000,
            "memory_total_mib": 24000,
            "cores_capacity": 100,
            "slots_total": 10,
            "health": "healthy",
            "healthy": True,
            "cordoned": False,
            "present": True,
            "exclusive_owner": None,
            "layers": None,  # make_inventory reports no layers, as older agents
            "used_bytes": None,  # no telemetry
            "sm_percent": None,
            **values,
        }

    totals = {
        "gpus": 2,
        "memory_total_mib": 48000,
        "memory_allocated_mib": 10000,
        "cores_capacity": 200,
        "cores_allocated": 60,
        "slots_total": 20,
        "slots_used": 4,
        "pod_count": 2,
    }
    assert json.loads(result.stdout) == {
        "version": 1,
        "skipped": {},
        "nodes": [
            {
                "node": "node-a",
                "gpus": [
                    card(
                        0,
                        memory_allocated_mib=8000,
                        cores_allocated=60,
                        slots_used=3,
                        pod_count=2,
                        pods=[pod("pod-1", "reserved", 5000, 40), pod("pod-2", "bound", 3000, 20)],
                    ),
                    card(
                        1,
                        memory_allocated_mib=2000,
                        cores_allocated=0,
                        slots_used=1,
                        pod_count=1,
                        pods=[pod("pod-1", "reserved", 2000, 0)],
                    ),
                ],
                "totals": totals,
                "vendors": {"nvidia": totals},
            }
        ],
    }


async def test_json_shows_cordon_and_exclusive_owner(cluster: Ledger, redis_url: str) -> None:
    result = await cli(redis_url, "status", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [n["node"] for n in doc["nodes"]] == ["node-a", "node-b", "node-c"]
    [b0] = doc["nodes"][1]["gpus"]
    assert (b0["health"], b0["cordoned"], b0["exclusive_owner"]) == ("cordoned", True, "pod-4")
    c1 = doc["nodes"][2]["gpus"][1]
    assert (c1["health"], c1["healthy"], c1["pods"]) == ("unhealthy", False, [])


async def test_released_pods_leave_the_table(cluster: Ledger, redis_url: str) -> None:
    await cluster.release("pod-1")
    result = await cli(redis_url, "status", "--node", "node-a")
    assert result.exit_code == 0, result.output
    assert [row[4:5] + row[6:9] for row in cells(result.stdout)[1:]] == [
        ["3000 / 24000", "20 / 100", "1 / 10", "1"],
        ["0 / 24000", "0 / 100", "0 / 10", "0"],
        ["3000 / 48000", "20 / 200", "1 / 20", "1"],
    ]


async def test_usage_adds_a_used_column_only_when_given(cluster: Ledger) -> None:
    nodes = await gather_status(cluster, "node-a")
    assert "used" not in table_columns()
    assert all(len(row) == 9 for row in table_rows(nodes))
    usage = {"GPU-node-a-0": (3 * 1024 * 1024 * 1024, 42.0)}
    assert table_columns(usage)[5] == "used"
    rows = table_rows(nodes, usage)
    assert [row[5] for row in rows] == ["3072 MiB 42%", "-", "3072 MiB 42%"]
    assert [row[:5] + row[6:] for row in rows] == table_rows(nodes)


async def test_table_and_json_show_what_telemetry_says_cards_use(
    cluster: Ledger, redis_url: str
) -> None:
    store = TelemetryStore(cluster.redis, "gpuslice")
    subjects = Subjects("gpuslice")
    for container, used_mib, sm in (("c0", 3000, 30.0), ("c1", 1000, 12.0)):
        devices = [
            {"uuid": "GPU-node-a-0", "used_bytes": used_mib * MIB, "limit_bytes": 4 * MIB**2}
            | {"sm_percent": sm}
        ]
        sample = {
            "node": "node-a",
            "pod_uid": "pod-1",
            "container": container,
            "pid": 7,
            "time": "2026-11-21T10:00:00Z",
            "devices": devices,
        }
        assert store.ingest(subjects.telemetry("node-a", "pod-1"), json.dumps(sample).encode())
    assert await store.flush() == 2
    table = await cli(redis_url, "status", "--node", "node-a")
    assert table.exit_code == 0, table.output
    assert [row[5] for row in cells(table.stdout)] == ["used", "4000 MiB 42%", "-", "4000 MiB 42%"]
    document = await cli(redis_url, "status", "--json", "--node", "node-a")
    gpus = json.loads(document.stdout)["nodes"][0]["gpus"]
    assert [(g["used_bytes"], g["sm_percent"]) for g in gpus] == [(4000 * MIB, 42.0), (None, None)]


def test_health_prefers_the_worst_state() -> None:
    base = CardStatus("n", 0, "u", "m", 1, 1, 0, 100, 0, 10, 0, (), True, False, True, None)
    assert base.health == "healthy"
    assert CardStatus(**{**base.__dict__, "cordoned": True}).health == "cordoned"
    assert CardStatus(**{**base.__dict__, "cordoned": True, "healthy": False}).health == "unhealthy"
    assert CardStatus(**{**base.__dict__, "present": False}).health == "missing"
    assert pod_count(NodeStatus("n", (base,)).gpus) == 0


async def test_unknown_node_is_a_one_line_error(cluster: Ledger, redis_url: str) -> None:
    result = await cli(redis_url, "status", "--node", "nope")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (
        "error: node 'nope' is not in the ledger (known nodes: node-a, node-b, node-c)\n"
    )


async def test_empty_ledger(redis_url: str) -> None:
    result = await cli(redis_url, "status")
    assert (result.exit_code, result.stdout) == (0, f"no GPU nodes in the ledger at {redis_url}\n")
    result = await cli(redis_url, "status", "--json")
    assert json.loads(result.stdout) == {"version": 1, "skipped": {}, "nodes": []}


async def test_an_unreadable_node_is_left_out_with_a_one_line_warning(
    cluster: Ledger, redis_url: str
) -> None:
    """A value no gpuslice writes (here as an older version stored 1e17 MiB) spoils
    one node, not the command."""
    keys = cluster.node_keys("node-b")
    await cluster.redis.hset(keys.gpus, "GPU-node-b-0|cap_mem", "1e+17")
    await cluster.redis.sadd(cluster.nodes_key, "Bad\nNode")  # no node's name
    result = await cli(redis_url, "status")
    assert result.exit_code == 0, result.output
    assert [row[0] for row in cells(result.stdout)[1:]] == ["node-a"] * 3 + ["node-c"] * 3
    assert result.stderr.count("\n") == 2
    assert "warning: node 'Bad\\nNode' left out" in result.stderr
    assert "warning: node node-b left out" in result.stderr
    assert "'1e+17', not a whole number" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    document = json.loads((await cli(redis_url, "status", "--json")).stdout)
    assert [n["node"] for n in document["nodes"]] == ["node-a", "node-c"]
    assert document["skipped"]["Bad\nNode"] == "its name is not a Kubernetes node name"
    assert "card GPU-node-b-0 cap_mem is '1e+17'" in document["skipped"]["node-b"]
    # a placement record that is not one is as unreadable
    await cluster.redis.hset(cluster.node_keys("node-c").pods, "pod-x", "[]")
    document = json.loads((await cli(redis_url, "status", "--json")).stdout)
    assert [n["node"] for n in document["nodes"]] == ["node-a"]
    assert document["skipped"]["node-c"].startswith("pod 'pod-x'")


def test_redis_down_is_a_clean_error_exit() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "gpuslice_cli.main", "status", "--redis-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: cannot read the ledger at {url}: Redis is unreachable")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 20  # a quick answer, not the services' long retries


def test_bad_redis_url_names_the_variable() -> None:
    result = CliRunner().invoke(app, ["status"], env={"GPUSLICE_REDIS_URL": "http://x"})
    assert result.exit_code == 2
    assert "GPUSLICE_REDIS_URL" in result.stderr
    assert result.stdout == ""


async def test_pods_option_lists_each_pod_on_each_card_with_its_grant(
    cluster: Ledger, redis_url: str
) -> None:
    result = await cli(redis_url, "status", "--pods")
    assert result.exit_code == 0, result.output
    # pod-1's two containers on card 0: 4000 + 1000 MiB, 30 + 10 cores; pod-3 is
    # released; pod-1 asked no cores on card 1: no limit, not "0"
    assert cells(result.stdout, "pods by card") == [
        ["node", "gpu", "vendor", "pod", "state", "memory MiB", "cores"],
        ["node-a", "0", NV, "ns/name-pod-1", "reserved", "5000", "40"],
        ["node-a", "0", NV, "ns/name-pod-2", "bound", "3000", "20"],
        ["node-a", "1", NV, "ns/name-pod-1", "reserved", "2000", "no limit"],
        ["node-b", "0", NV, "ns/name-pod-4", "reserved", "8000", "100"],
    ]
    plain = await cli(redis_url, "status")
    assert "# pods by card" not in plain.stdout


async def test_status_names_the_redis_it_read(cluster: Ledger, redis_url: str) -> None:
    result = await cli(redis_url, "status")
    assert result.stdout.splitlines()[-1] == f"# read from {redis_url}"
    assert result.stderr == ""


def test_a_password_in_the_redis_url_is_never_printed(redis_url: str) -> None:
    assert without_password("redis://user:s3cret@host:6379/0") == "redis://user@host:6379/0"
    assert without_password("rediss://:s3cret@host:6380/1") == "rediss://host:6380/1"
    assert without_password("redis://host:6379/0") == "redis://host:6379/0"
    # what the command says names the server, not the password
    with_password = redis_url.replace("redis://", "redis://:s3cret@")
    result = subprocess.run(
        [sys.executable, "-m", "gpuslice_cli.main", "status", "--redis-url", with_password],
        capture_output=True,
        text=True,
        timeout=60,
        env=command_env(),
        cwd=ROOT,
        check=False,
    )
    assert redis_url in result.stdout + result.stderr
    assert "s3cret" not in result.stdout + result.stderr


def command_env(**more: str) -> dict[str, str]:
    """The environment without any setting of the terminal or of gpuslice."""
    skip = ("GPUSLICE_", "COLUMNS", "LINES", "TTY_", "FORCE_COLOR", "TERM")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    return env | more


def test_the_default_redis_is_named_with_a_warning() -> None:
    """Nothing names a Redis: the command says it reads the built-in default."""
    result = subprocess.run(
        [sys.executable, "-m", "gpuslice_cli.main", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=command_env(),
        cwd=ROOT,
        check=False,
    )
    assert result.stderr.splitlines()[0] == (
        "warning: no --redis-url or GPUSLICE_REDIS_URL: reading the default"
        " redis://127.0.0.1:6379/0"
    )
    assert "Traceback" not in result.stderr


def in_terminal(args: list[str], env: dict[str, str], columns: int) -> str:
    """What ``gpuslice`` writes to a terminal ``columns`` wide (a pseudo-terminal),
    without colour codes."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuslice_cli.main", *args],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env | {"TERM": "xterm", "NO_COLOR": "1"},
        cwd=ROOT,
    )
    os.close(follower)
    said = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the command ended and closed the terminal
            break
        if not chunk:
            break
        said += chunk
    os.close(leader)
    assert proc.wait(60) == 0, said
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", said.decode()).replace("\r", "")


async def test_tables_fit_the_terminal_and_are_plain_columns_in_a_pipe(
    cluster: Ledger, redis_url: str
) -> None:
    env = command_env(GPUSLICE_REDIS_URL=redis_url, GPUSLICE_LEDGER_PREFIX="gpuslice")
    args = ["status", "--pods"]
    piped = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gpuslice_cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert piped.returncode == 0, piped.stderr
    # whole cells, no drawing, one row a line
    for drawing in ("┃", "│", "…"):
        assert drawing not in piped.stdout
    assert {MODEL, "1 healthy, 1 unhealthy"} <= {c for row in cells(piped.stdout) for c in row}
    for columns in (70, 160):
        drawn = await asyncio.to_thread(in_terminal, args, env, columns)
        lines = drawn.splitlines()
        assert any("┃" in line for line in lines), drawn
        assert max(len(line) for line in lines) <= columns, drawn
        assert "\t" not in drawn
        # room enough: the widest cells whole; too narrow: cut or wrapped, in the width
        assert (MODEL in drawn) is (columns == 160), drawn
        assert ("1 healthy, 1 unhealthy" in drawn) is (columns == 160), drawn


async def test_enforcement_layers_per_card(ledger: Ledger, redis_url: str) -> None:
    """The second table and the JSON say which layers enforce on each card; a node
    whose agent reports none shows "-" (and null)."""
    on, off = LayerState.ENFORCING, LayerState.MISSING
    inventory = make_inventory("node-a", gpus=2)
    layers = {
        "GPU-node-a-0": CardLayers(driver=on, driver_note="dmem", agent_memory=on),
        "GPU-node-a-1": CardLayers(driver=off, driver_note="MIG mode", agent_compute=on),
    }
    reported = NodeInventory.model_validate({**inventory.model_dump(), "layers": layers})
    await ledger.register_node(reported, rebuilt=True)
    await ledger.register_node(make_inventory("node-b", gpus=1), rebuilt=True)
    result = await cli(redis_url, "status")
    assert result.exit_code == 0, result.output
    assert cells(result.stdout, "enforcement layers") == [
        ["node", "gpu", "driver", "agent memory", "agent compute", "interposer", "driver note"],
        ["node-a", "0", "enforcing", "enforcing", "missing", "enforcing", "dmem"],
        ["node-a", "1", "missing", "missing", "enforcing", "enforcing", "MIG mode"],
        ["node-b", "0", "-", "-", "-", "-", ""],
    ]
    result = await cli(redis_url, "status", "--json")
    nodes = {n["node"]: n for n in json.loads(result.stdout)["nodes"]}
    assert nodes["node-a"]["gpus"][0]["layers"] == {
        "driver": "enforcing",
        "driver_note": "dmem",
        "agent_memory": "enforcing",
        "agent_compute": "missing",
        "interposer": "enforcing",
    }
    assert nodes["node-b"]["gpus"][0]["layers"] is None


# ---------------------------------------------------------------- other vendors


async def test_every_vendor_s_cards_are_shown_with_their_vendor_model_memory_and_cores(
    ledger: Ledger, redis_url: str
) -> None:
    """A node with NVIDIA's, Moore Threads' (16 cores a card) and Hygon's cards,
    and a node with Hygon's alone, as the inventory registers them from the
    vendors' node objects: each card with its vendor, and totals per vendor,
    since cores add up only within a vendor's units."""
    await ledger.register_node(make_inventory("node-v", gpus=1), rebuilt=True)
    await ledger.register_node(
        make_vendor_inventory("node-v", "mthreads", "MTT S4000", memory_mib=49152, cores=16)
    )
    await ledger.register_node(
        make_vendor_inventory("node-v", "hygon", "DCU-Z100", cards=1, memory_mib=32768)
    )
    await ledger.register_node(
        make_vendor_inventory("node-w", "hygon", "DCU-Z100", cards=1, memory_mib=32768)
    )
    mt = Placement(
        pod=PodRef(uid="mt-1", namespace="ns", name="mt-pod"),
        node="node-v",
        containers=(
            ContainerAssignment(
                name="c0",
                vendor="mthreads",
                devices=(DeviceGrant(uuid="MTHREADS-node-v-0", memory_mib=8192, cores=4),),
            ),
        ),
    )
    await ledger.reserve(mt)

    MT, S4000, HY, Z100 = "mthreads", "MTT S4000", "hygon", "DCU-Z100"
    V, W = "node-v", "node-w"
    result = await cli(redis_url, "status", "--pods")
    assert result.exit_code == 0, result.output
    assert cells(result.stdout)[1:] == [
        [V, "0", NV, MODEL, "0 / 16384", "-", "0 / 100", "0 / 10", "0", "healthy"],
        [V, "total", NV, "1 GPU", "0 / 16384", "-", "0 / 100", "0 / 10", "0", "1 healthy"],
        [V, "0", HY, Z100, "0 / 32768", "-", "0 / 100", "0 / 10", "0", "healthy"],
        [V, "total", HY, "1 GPU", "0 / 32768", "-", "0 / 100", "0 / 10", "0", "1 healthy"],
        [V, "0", MT, S4000, "8192 / 49152", "-", "4 / 16", "1 / 10", "1", "healthy"],
        [V, "1", MT, S4000, "0 / 49152", "-", "0 / 16", "0 / 10", "0", "healthy"],
        [V, "total", MT, "2 GPUs", "8192 / 98304", "-", "4 / 32", "1 / 20", "1", "2 healthy"],
        [W, "0", HY, Z100, "0 / 32768", "-", "0 / 100", "0 / 10", "0", "healthy"],
        [W, "total", HY, "1 GPU", "0 / 32768", "-", "0 / 100", "0 / 10", "0", "1 healthy"],
    ]  # fmt: skip
    assert cells(result.stdout, "pods by card")[1:] == [
        ["node-v", "0", "mthreads", "ns/mt-pod", "reserved", "8192", "4"],
    ]
    # gpuslice's enforcement layers are NVIDIA's cards' only
    assert [row[:2] for row in cells(result.stdout, "enforcement layers")[1:]] == [["node-v", "0"]]

    document = await cli(redis_url, "status", "--json")
    assert document.exit_code == 0, document.output
    nodes = {n["node"]: n for n in json.loads(document.stdout)["nodes"]}
    shown = [
        (g["vendor"], g["index"], g["model"], g["memory_total_mib"], g["cores_capacity"])
        for g in nodes["node-v"]["gpus"]
    ]
    assert shown == [
        (NV, 0, MODEL, 16384, 100),
        ("hygon", 0, "DCU-Z100", 32768, 100),
        ("mthreads", 0, "MTT S4000", 49152, 16),
        ("mthreads", 1, "MTT S4000", 49152, 16),
    ]
    mt_card = nodes["node-v"]["gpus"][2]
    assert (mt_card["cores_allocated"], mt_card["pods"][0]["cores"]) == (4, 4)
    vendors = nodes["node-v"]["vendors"]
    assert list(vendors) == [NV, "hygon", "mthreads"]
    assert vendors["mthreads"] == {
        "gpus": 2,
        "memory_total_mib": 98304,
        "memory_allocated_mib": 8192,
        "cores_capacity": 32,
        "cores_allocated": 4,
        "slots_total": 20,
        "slots_used": 1,
        "pod_count": 1,
    }
    assert nodes["node-v"]["totals"]["gpus"] == 4
    assert nodes["node-v"]["totals"]["pod_count"] == 1
    assert list(nodes["node-w"]["vendors"]) == ["hygon"]


async def test_a_node_whose_cards_are_all_gone_keeps_its_total_row(
    ledger: Ledger, redis_url: str
) -> None:
    await ledger.register_node(make_vendor_inventory("node-x", "hygon", "DCU-Z100", cards=1))
    await ledger.register_node(NodeInventory(node="node-x", devices=(), vendor="hygon"))
    result = await cli(redis_url, "status")
    assert result.exit_code == 0, result.output
    assert cells(result.stdout)[1:] == [
        ["node-x", "total", "-", "0 GPUs", "0 / 0", "-", "0 / 0", "0 / 0", "0", ""],
    ]
