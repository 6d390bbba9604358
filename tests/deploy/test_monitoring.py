"""The Prometheus Operator component (k8s/monitoring): each monitor selects
objects that exist and names a port those objects really carry, scraped on
/metrics and on /metrics/hami (HAMi's camelCase names); the base k8s/
needs none of the operator's kinds; every scrape annotation names a port the
pod declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.kustomize import overlay, render

K8S = Path(__file__).resolve().parents[2] / "k8s"
OPERATOR = "monitoring.coreos.com/v1"
# the plain-HTTP metrics port of each service (docs/architecture.md)
METRICS_PORTS = {
    "gpuslice-webhook": 9091,
    "gpuslice-scheduler": 9092,
    "gpuslice-inventory": 9090,
    "gpuslice-deviceplugin": 9400,
}


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(overlay(tmp_path_factory.mktemp("overlay"), K8S, "monitoring"))


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for rule in selector.get("matchExpressions") or []:
        key, operator, values = rule["key"], rule["operator"], rule.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def pod_template(obj: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = obj["spec"]["template"]
    return template


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def test_the_base_applies_without_the_operator() -> None:
    assert not [o for o in render(K8S) if o["apiVersion"] == OPERATOR]


def test_the_component_adds_one_service_monitor_and_one_pod_monitor(
    monitored: list[dict[str, Any]],
) -> None:
    kinds = sorted(o["kind"] for o in monitored if o["apiVersion"] == OPERATOR)
    assert kinds == ["PodMonitor", "ServiceMonitor"]
    # everything else is the base, unchanged and still valid
    for obj in monitored:
        if obj["apiVersion"] in (OPERATOR,) or obj["apiVersion"].startswith("cert-manager.io/"):
            continue
        kubernetes_validate.validate(obj, "1.32.0", strict=True)


def test_the_service_monitor_reaches_each_service_s_metrics_port(
    monitored: list[dict[str, Any]],
) -> None:
    monitor = next(o for o in monitored if o["kind"] == "ServiceMonitor")
    spec = monitor["spec"]
    ports = {e["port"] for e in spec["endpoints"]}
    assert ports == {"metrics"}
    assert all(e.get("honorLabels") for e in spec["endpoints"])
    assert sorted(e["path"] for e in spec["endpoints"]) == ["/metrics", "/metrics/hami"]
    services = [
        o
        for o in monitored
        if o["kind"] == "Service"
        and o["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
        and matches(spec["selector"], o["metadata"].get("labels") or {})
    ]
    reached: dict[str, int] = {}
    for service in services:
        named = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports & named.keys(), f"{service['metadata']['name']} has no port {ports}"
        port = named[next(iter(ports & named.keys()))]
        # the Service's port leads to a container port of that name, on the pods it selects
        pods = [
            w
            for w in workloads(monitored)
            if matches(
                {"matchLabels": service["spec"]["selector"]}, pod_template(w)["metadata"]["labels"]
            )
        ]
        assert pods, service["metadata"]["name"]
        for workload in pods:
            declared = {
                p["name"]: p["containerPort"]
                for c in pod_template(workload)["spec"]["containers"]
                for p in c.get("ports", [])
            }
            assert port["targetPort"] in declared, workload["metadata"]["name"]
            reached[workload["metadata"]["name"]] = declared[port["targetPort"]]
    assert reached == {k: v for k, v in METRICS_PORTS.items() if k != "gpuslice-deviceplugin"}


def test_the_pod_monitor_reaches_every_node_agent_s_metrics_port(
    monitored: list[dict[str, Any]],
) -> None:
    monitor = next(o for o in monitored if o["kind"] == "PodMonitor")
    spec = monitor["spec"]
    selected = [
        w
        for w in workloads(monitored)
        if w["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
        and matches(spec["selector"], pod_template(w)["metadata"]["labels"])
    ]
    assert [w["kind"] for w in selected] == ["DaemonSet"]
    declared = {
        p["name"]: p["containerPort"]
        for c in pod_template(selected[0])["spec"]["containers"]
        for p in c.get("ports", [])
    }
    for endpoint in spec["podMetricsEndpoints"]:
        assert endpoint.get("honorLabels")
        assert declared[endpoint["port"]] == METRICS_PORTS["gpuslice-deviceplugin"]
    paths = sorted(e["path"] for e in spec["podMetricsEndpoints"])
    assert paths == ["/metrics", "/metrics/hami"]  # HAMi's camelCase names on the second


def test_scrape_annotations_name_the_metrics_port_each_pod_declares() -> None:
    found = {}
    for workload in workloads(render(K8S)):
        template = pod_template(workload)
        notes = template["metadata"].get("annotations") or {}
        if notes.get("prometheus.io/scrape") != "true":
            continue
        declared = {
            p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
        }
        port = int(notes["prometheus.io/port"])
        assert port in declared, workload["metadata"]["name"]
        assert notes.get("prometheus.io/path", "/metrics") == "/metrics"
        found[workload["metadata"]["name"]] = port
    assert found == METRICS_PORTS


SCRAPER = {"gpuslice.io/scrape-metrics": "true"}


def reachable_from(policy: dict[str, Any], port: int, namespace_labels: dict[str, str]) -> bool:
    """Whether ``policy`` lets a pod of a namespace labelled ``namespace_labels`` in
    on ``port`` (rules with ipBlock peers, such as the webhook's 8443, are not
    for metrics and are left out)."""
    for rule in policy["spec"].get("ingress") or []:
        if port not in {p["port"] for p in rule.get("ports") or []}:
            continue
        for peer in rule.get("from") or []:
            if "namespaceSelector" in peer and matches(peer["namespaceSelector"], namespace_labels):
                return True
    return False


@pytest.mark.parametrize(("name", "port"), sorted(METRICS_PORTS.items()))
def test_metrics_ports_admit_the_scraper_s_namespace_and_no_tenant(name: str, port: int) -> None:
    """The series name every tenant's pods and their GPU use: a tenant's
    namespace may not read them, the namespace labelled for Prometheus may."""
    policy = next(
        o for o in render(K8S) if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == name
    )
    tenant = {"kubernetes.io/metadata.name": "team-a"}
    assert not reachable_from(policy, port, tenant)
    assert reachable_from(policy, port, {**tenant, **SCRAPER})
