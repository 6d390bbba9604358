"""compose.yaml and the Dockerfile: valid by the Compose specification, and wired
the way the services and the driver read their settings and flags (no Docker
engine runs here, so the images are not built)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer
import yaml
from compose_spec import PyCompose

from gpuslice_cli.main import app
from tests.deploy.test_k8s import SETTINGS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # YAML merge keys (<<) are the YAML parser's business, as in docker compose
    doc: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return doc


def test_compose_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    parsed = PyCompose.from_json(json.dumps(compose))
    assert set(parsed.service_names()) == {
        "nats",
        "redis",
        "audit-init",
        "webhook",
        "scheduler",
        "inventory",
        "node-1",
        "node-2",
        "driver",
    }
    broken = dict(compose, services={"x": {"image": "a", "restart": "sometimes"}})
    with pytest.raises(ValueError, match="unknown variant `sometimes`"):
        PyCompose.from_json(json.dumps(broken))


def test_every_gpuslice_variable_is_a_setting_of_its_service(compose: dict[str, Any]) -> None:
    modules = set()
    for name, service in compose["services"].items():
        command = service.get("command") or []
        if command[:2] != ["python", "-m"]:
            continue
        modules.add(command[2])
        settings = SETTINGS[command[2]]
        for variable in service["environment"]:
            if variable.startswith("GPUSLICE_"):
                field = variable.removeprefix("GPUSLICE_").lower()
                assert field in settings.model_fields, f"{name}: {variable} is unknown"
        assert service["environment"]["KUBECONFIG"] == "/shared/kubeconfig"
    assert modules == set(SETTINGS)


def driver_options(compose: dict[str, Any]) -> dict[str, Any]:
    """The driver's command line as the gpuslice CLI itself parses it."""
    command = compose["services"]["driver"]["command"]
    assert command[:3] == ["gpuslice", "dev", "driver"]
    group: Any = typer.main.get_command(app)
    driver = group.commands["dev"].commands["driver"]
    context = driver.make_context("driver", list(command[3:]))
    return dict(context.params)


def test_the_driver_reaches_every_service_and_shares_the_nodes_directories(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    options = driver_options(compose)
    for flag, service in (
        ("webhook_url", "webhook"),
        ("extender_url", "scheduler"),
        ("inventory_url", "inventory"),
    ):
        url = urlsplit(options[flag])
        assert url.hostname == service
        assert str(url.port) == services[service]["environment"]["GPUSLICE_LISTEN_PORT"]
    assert urlsplit(options["nats_url"]).hostname == "nats"
    assert urlsplit(options["redis_url"]).hostname == "redis"
    assert urlsplit(options["api_advertise"]).hostname == "driver"
    assert urlsplit(options["api_advertise"]).port == options["api_port"]
    assert str(options["kubeconfig"]) == "/shared/kubeconfig"
    nodes = {
        s["environment"]["GPUSLICE_NODE_NAME"]: s
        for s in services.values()
        if "environment" in s and "GPUSLICE_NODE_NAME" in s["environment"]
    }
    assert sorted(options["nodes"]) == sorted(nodes)
    driver_mounts = set(services["driver"]["volumes"])
    for name, node in nodes.items():
        env = node["environment"]
        assert env["GPUSLICE_KUBELET_DIR"] == f"{options['kubelet_root']}/{name}"
        # the driver runs containers with the host paths Allocate names
        host_volume = next(v for v in node["volumes"] if v.endswith(":/nodes"))
        assert env["GPUSLICE_HOST_DIR"].startswith("/nodes/")
        assert host_volume in driver_mounts
        assert f"kubelet:{options['kubelet_root']}" in node["volumes"]
    assert f"kubelet:{options['kubelet_root']}" in driver_mounts


def test_the_dockerfile_copies_what_exists_and_builds_what_native_makes() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+(?: AS (\w+))?$", text, re.MULTILINE)
    assert stages == ["native", "wheel", ""]
    for source in re.findall(r"^COPY (?!--from)(\S+)", text, re.MULTILINE):
        assert (ROOT / source).exists(), source
    (targets,) = re.findall(r"make -C native (.+)$", text, re.MULTILINE)
    dry = subprocess.run(
        ["make", "-n", "-C", str(ROOT / "native"), *targets.split()],
        capture_output=True,
        text=True,
    )
    assert dry.returncode == 0, dry.stderr
    # what the device plugin installs and the stack runs is in the image
    assert "GPUSLICE_NATIVE_DIR=/opt/gpuslice" in text
    interposer = SETTINGS["gpuslice_deviceplugin"].model_fields["interposer_library"].default
    assert interposer == "/opt/gpuslice/libgpuslice.so"
    assert "/src/native/build/libgpuslice.so" in text
    assert "/src/native/build/libgsengine.so" in text  # the scheduler's placement engine
    # the native stage has every header native/ includes from outside it
    makefile = (ROOT / "native" / "Makefile").read_text()
    for folder in re.findall(r"-I\$\((\w+)\)", makefile):
        (value,) = re.findall(rf"^{folder}\s*:?=\s*\.\./(\S+)$", makefile, re.MULTILINE)
        copied = rf"^COPY {re.escape(value)}/\S+ {re.escape(value)}/$"
        assert re.search(copied, text, re.MULTILINE), value
