"""``gpuslice dev driver``: the cluster driver alone, attached to services started
on their own, as compose.yaml runs them (here as processes, the services'
hostnames being loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gpuslice_common.servers import NatsServer, free_port
from tests.conftest import Native

BIN = Path(sys.executable).parent
NODES = ("gpu-node-1", "gpu-node-2")


def test_the_driver_runs_the_demo_against_services_started_apart(
    native: Native, nats_server: NatsServer, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    ports: dict[str, int] = {}
    for name in ("webhook", "scheduler", "inventory", "api"):
        ports[name] = free_port()
        while ports[name] in [ports[n] for n in ports if n != name]:  # one port, two services
            ports[name] = free_port()
    kubeconfig = tmp_path / "shared" / "kubeconfig"
    kubeconfig.parent.mkdir()
    kubelets = Path(f"/tmp/gs-{prefix}")  # unix socket paths must stay short
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSLICE_", "FAKE"))}
    base.pop("KUBERNETES_SERVICE_HOST", None)
    common = {
        **base,
        "GPUSLICE_NATS_URL": nats_server.url,
        "GPUSLICE_REDIS_URL": redis_url,
        "GPUSLICE_SUBJECT_PREFIX": prefix,
        "GPUSLICE_LEDGER_PREFIX": prefix,
        "GPUSLICE_LISTEN_HOST": "127.0.0.1",
        "KUBECONFIG": str(kubeconfig),
    }
    driver = subprocess.Popen(
        [
            str(BIN / "gpuslice"), "dev", "driver", "--demo", "--plain",
            *(arg for node in NODES for arg in ("--node", node)),
            "--nats-url", nats_server.url, "--redis-url", redis_url,
            "--webhook-url", f"http://127.0.0.1:{ports['webhook']}",
            "--extender-url", f"http://127.0.0.1:{ports['scheduler']}",
            "--inventory-url", f"http://127.0.0.1:{ports['inventory']}",
            "--kubelet-root", str(kubelets), "--kubeconfig", str(kubeconfig),
            "--api-advertise", f"http://127.0.0.1:{ports['api']}",
            "--api-port", str(ports["api"]), "--workdir", str(tmp_path / "driver"),
        ],
        env={**base, "GPUSLICE_SUBJECT_PREFIX": prefix, "GPUSLICE_LEDGER_PREFIX": prefix},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    services: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 30
        while not kubeconfig.exists():
            assert driver.poll() is None, driver.communicate()[0]
            assert time.monotonic() < deadline, "the driver wrote no kubeconfig"
            time.sleep(0.1)
        logs = tmp_path / "logs"
        logs.mkdir()

        def start(name: str, module: str, ledger: bool = True, **env: str) -> None:
            shared = {k: v for k, v in common.items() if ledger or "REDIS" not in k}
            with (logs / f"{name}.log").open("wb") as out:
                services.append(
                    subprocess.Popen(
                        [sys.executable, "-m", module],
                        env={**shared, **env},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )

        # the install step: only the admin credential makes the audit stream
        init = subprocess.run(
            [str(BIN / "gpuslice"), "audit", "init", "--nats-url", nats_server.url],
            env=common,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert init.returncode == 0, init.stdout + init.stderr
        assert f"audit stream {prefix}_audit" in init.stdout
        for name, module in (("webhook", "gpuslice_webhook"), ("scheduler", "gpuslice_scheduler")):
            start(
                name,
                module,
                GPUSLICE_LISTEN_PORT=str(ports[name]),
                GPUSLICE_METRICS_PORT=str(free_port()),
            )
        start(
            "inventory",
            "gpuslice_inventory",
            GPUSLICE_LISTEN_PORT=str(ports["inventory"]),
            GPUSLICE_CONSOLE_PORT=str(free_port()),
            GPUSLICE_HEARTBEAT_INTERVAL="1s",
            GPUSLICE_RECONCILE_INTERVAL="5s",
            GPUSLICE_RECONCILE_GRACE="2s",
        )
        for node in NODES:
            start(
                node,
                "gpuslice_deviceplugin",
                ledger=False,  # node agents ask the inventory
                GPUSLICE_NODE_NAME=node,
                GPUSLICE_BACKEND="simulated",
                GPUSLICE_KUBELET_DIR=str(kubelets / node),
                GPUSLICE_HOST_DIR=str(tmp_path / "nodes" / node),
                GPUSLICE_INTERPOSER_LIBRARY=str(native.lib),
                GPUSLICE_METRICS_PORT=str(free_port()),
                GPUSLICE_INVENTORY_INTERVAL="1s",
            )
        output, _ = driver.communicate(timeout=180)
        assert driver.returncode == 0, output
        assert "demo passed" in output
        assert "Traceback" not in output
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
        for proc in services:
            proc.terminate()
        for proc in services:
            proc.wait(20)
    assert [p.returncode for p in services] == [0] * len(services)
