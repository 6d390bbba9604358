"""No test or bench binds a fixed port: a service started as a process gets each
of its ports (settings ``*_port`` whose default is a port, not 0) from the
environment the test or bench sets; left out, the service binds its default
(9092, 9090, ...), and the run fails whenever anything else holds it (another
run, a Prometheus on :9090). Each port is meant to come from
``gpuslice_common.servers.free_port``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.config import (
    ENV_PREFIX,
    DevicePluginSettings,
    InventorySettings,
    SchedulerSettings,
    WebhookSettings,
)
from gpuslice_common.servers import free_port
from gpuslice_common.service import http_server, plain_http
from tests.conftest import FIXED_SERVICE_PORTS

ROOT = Path(__file__).resolve().parents[1]
SERVICES: dict[str, type[Any]] = {
    "gpuslice_webhook": WebhookSettings,
    "gpuslice_scheduler": SchedulerSettings,
    "gpuslice_inventory": InventorySettings,
    "gpuslice_deviceplugin": DevicePluginSettings,
}


def port_variables(settings: type[Any]) -> set[str]:
    """The environment variables of a service's ports that default to a fixed one."""
    return {
        f"{ENV_PREFIX}{name.upper()}"
        for name, field in settings.model_fields.items()
        if name.endswith("_port") and isinstance(field.default, int) and field.default > 0
    }


PORTS = {module: port_variables(settings) for module, settings in SERVICES.items()}
EVERY_PORT = set().union(*PORTS.values())


def started(tree: ast.AST) -> set[str]:
    """The services a file starts as processes: ``"-m", "<service module>"`` in a
    command, or ``"-m", name`` where the name takes service modules the file lists
    (a loop over them, a parametrized test)."""
    modules: set[str] = set()
    listed: set[str] = set()
    any_name = False
    for node in ast.walk(tree):
        items: list[ast.expr] = []
        if isinstance(node, ast.List | ast.Tuple):
            items = list(node.elts)
        elif isinstance(node, ast.Call):
            items = list(node.args)
        values = [i.value if isinstance(i, ast.Constant) else None for i in items]
        listed |= {v for v in values if isinstance(v, str) and v in SERVICES}
        for i, value in enumerate(values[:-1]):
            if value != "-m":
                continue
            after = items[i + 1]
            if isinstance(after, ast.Constant) and after.value in SERVICES:
                modules.add(after.value)
            elif not isinstance(after, ast.Constant | ast.Starred):
                any_name = True
    return modules | (listed if any_name else set())


def named(tree: ast.AST) -> set[str]:
    """Every port variable the file sets: a dict's key, a keyword, an item assigned."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found |= {k.value for k in node.keys if isinstance(k, ast.Constant)} & EVERY_PORT
        elif isinstance(node, ast.keyword) and node.arg in EVERY_PORT:
            found.add(node.arg)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.slice, ast.Constant)
            and node.slice.value in EVERY_PORT
        ):
            found.add(node.slice.value)
    return found


FILES = sorted(
    p
    for folder in ("tests", "bench")
    for p in (ROOT / folder).rglob("*.py")
    if started(ast.parse(p.read_text()))
)


def test_the_check_sees_the_processes_tests_and_benches_start() -> None:
    assert PORTS["gpuslice_scheduler"] == {"GPUSLICE_LISTEN_PORT", "GPUSLICE_METRICS_PORT"}
    assert PORTS["gpuslice_inventory"] >= {"GPUSLICE_LISTEN_PORT", "GPUSLICE_CONSOLE_PORT"}
    assert PORTS["gpuslice_deviceplugin"] == {"GPUSLICE_METRICS_PORT"}
    found = {str(p.relative_to(ROOT)): started(ast.parse(p.read_text())) for p in FILES}
    assert found["tests/test_extender.py"] == {"gpuslice_scheduler"}
    assert found["bench/extender_bench.py"] == {"gpuslice_scheduler"}
    assert found["tests/dev/test_attach.py"] == set(SERVICES)  # a loop over modules
    assert "tests/deploy/test_k8s.py" not in found  # names the modules, starts none


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_service_a_test_or_bench_starts_gets_each_of_its_ports(path: Path) -> None:
    tree = ast.parse(path.read_text())
    services = started(tree)
    missing = {s: sorted(PORTS[s] - named(tree)) for s in services if PORTS[s] - named(tree)}
    assert missing == {}, f"{path.name} starts services on fixed ports: {missing}"


async def test_a_service_served_in_a_test_on_its_default_port_fails_the_test() -> None:
    """The autouse guard (tests/conftest.py): nothing is bound, the start fails."""
    assert {9090, 9091, 9092, 9400, 8888, 8443, 8090} <= FIXED_SERVICE_PORTS
    for port in (
        SchedulerSettings().metrics_port,
        DevicePluginSettings.model_fields["metrics_port"].default,
    ):
        endpoint = plain_http(lambda *_: None, "127.0.0.1", port)
        with pytest.raises(AssertionError, match=f"fixed port {port}: give it free_port"):
            async with http_server(endpoint, "metrics", max_body=0, handle_signals=False):
                pass
    free = plain_http(lambda *_: None, "127.0.0.1", free_port())
    async with http_server(free, "metrics", max_body=0, handle_signals=False) as (server, _):
        assert server.started
