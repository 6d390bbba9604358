"""The Kubernetes manifests (k8s/, kustomize): every object valid against the
Kubernetes schemas, and wired the way the services read their settings."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpuslice_cli.dev.natsauth import AUTHORIZATION, NatsAuth
from gpuslice_common.config import (
    DevicePluginSettings,
    InventorySettings,
    ResourceNames,
    SchedulerSettings,
    WebhookSettings,
)
from tests.deploy.kustomize import render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.32.0"
SETTINGS: dict[str, type[Any]] = {
    "gpuslice_webhook": WebhookSettings,
    "gpuslice_scheduler": SchedulerSettings,
    "gpuslice_inventory": InventorySettings,
    "gpuslice_deviceplugin": DevicePluginSettings,
}


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(K8S)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name}")


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_renderer_agrees_with_kubectl_kustomize(objects: list[dict[str, Any]]) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, check=True
    ).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]

    def key(d: dict[str, Any]) -> tuple[str, str, str]:
        return d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]

    assert {key(d): d for d in theirs} == {key(d): d for d in objects}


def test_every_object_is_valid_against_the_kubernetes_schemas(
    objects: list[dict[str, Any]],
) -> None:
    custom = []
    for obj in objects:
        if obj["apiVersion"].startswith("cert-manager.io/"):
            custom.append(obj["kind"])
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{obj['kind']} {obj['metadata']['name']}: {exc}") from None
    assert sorted(custom) == ["Certificate", "Issuer"]
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))


def test_the_webhook_sees_pod_creation_and_ephemeral_containers(
    objects: list[dict[str, Any]],
) -> None:
    config = find(objects, "MutatingWebhookConfiguration", "gpuslice")
    (hook,) = config["webhooks"]
    rules = {(tuple(r["operations"]), tuple(r["resources"])) for r in hook["rules"]}
    assert rules == {(("CREATE",), ("pods",)), (("UPDATE",), ("pods/ephemeralcontainers",))}
    assert hook["sideEffects"] == "NoneOnDryRun"
    assert set(hook["admissionReviewVersions"]) == {"v1", "v1beta1"}
    service = hook["clientConfig"]["service"]
    assert service["path"] == "/mutate"
    svc = find(objects, "Service", service["name"])
    assert svc["metadata"]["namespace"] == service["namespace"]
    assert svc["spec"]["ports"][0]["port"] == service["port"]
    # the certificate cert-manager injects is the one the webhook serves
    certificate = find(objects, "Certificate", "gpuslice-webhook")
    namespace = certificate["metadata"]["namespace"]
    annotation = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == f"{namespace}/gpuslice-webhook"
    assert f"{service['name']}.{service['namespace']}.svc" in certificate["spec"]["dnsNames"]
    (_, spec), *_ = [(n, s) for n, s in pod_specs(objects) if n == "gpuslice-webhook"]
    (volume,) = spec["volumes"]
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    # gpuslice's own namespace and HAMi's ignore label are left alone
    keys = {e["key"] for e in hook["namespaceSelector"]["matchExpressions"]}
    assert keys == {"hami.io/webhook", "gpuslice.io/webhook"}
    assert find(objects, "Namespace", "gpuslice")["metadata"]["labels"]["gpuslice.io/webhook"] == (
        "ignore"
    )


def rules_of(objects: list[dict[str, Any]], account: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) granted to a service account by gpuslice's own roles."""
    granted: set[tuple[str, str, str]] = set()
    for binding in objects:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s["name"] == account for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        try:
            role = find(objects, ref["kind"], ref["name"])
        except AssertionError:
            continue  # a role Kubernetes ships (kube-scheduler's own)
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((group, resource, verb))
    return granted


def test_each_service_has_exactly_the_permissions_it_uses(objects: list[dict[str, Any]]) -> None:
    assert rules_of(objects, "gpuslice-webhook") == {
        ("", "namespaces", "get"),
        ("", "resourcequotas", "list"),
        ("", "pods", "list"),
    }
    assert rules_of(objects, "gpuslice-scheduler") == {
        ("", "pods", "get"),
        ("", "pods", "patch"),
        ("", "pods/binding", "create"),
        *(
            ("coordination.k8s.io", "leases", v)
            for v in ("create", "get", "list", "update", "watch")
        ),
    }
    assert rules_of(objects, "gpuslice-inventory") == {
        ("", "pods", "list"),
        ("", "pods", "watch"),
        # the NATS auth callout reviews node agents' tokens
        ("authentication.k8s.io", "tokenreviews", "create"),
    }
    assert rules_of(objects, "gpuslice-deviceplugin") == {("", "pods", "get")}
    shipped = {
        b["roleRef"]["name"]
        for b in objects
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and b["subjects"][0]["name"] == "gpuslice-scheduler"
    }
    assert {"system:kube-scheduler", "system:volume-scheduler"} <= shipped


def test_every_container_has_probes_and_resources(objects: list[dict[str, Any]]) -> None:
    for name, spec in pod_specs(objects):
        for container in spec["containers"]:
            where = f"{name}/{container['name']}"
            assert "readinessProbe" in container, where
            assert "livenessProbe" in container, where
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), where
            assert "memory" in container["resources"]["limits"], where


def test_replicated_deployments_have_disruption_budgets(objects: list[dict[str, Any]]) -> None:
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for obj in objects:
        if obj["kind"] != "Deployment":
            continue
        assert obj["spec"]["replicas"] >= 2, obj["metadata"]["name"]
        labels = obj["spec"]["template"]["metadata"]["labels"]
        covering = [
            b
            for b in budgets
            if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
            and b["metadata"]["namespace"] == obj["metadata"]["namespace"]
        ]
        assert covering, f"no PodDisruptionBudget for {obj['metadata']['name']}"


def test_every_gpuslice_variable_is_a_setting_of_its_service(
    objects: list[dict[str, Any]],
) -> None:
    seen = set()
    for name, spec in pod_specs(objects):
        for container in spec["containers"]:
            command = container.get("command") or []
            if command[:2] != ["python", "-m"]:
                continue
            settings = SETTINGS[command[2]]
            seen.add(command[2])
            assert container["image"] == "ghcr.io/gpuslice/gpuslice:0.1.0", name
            for env in container.get("env", []):
                if env["name"].startswith("GPUSLICE_"):
                    field = env["name"].removeprefix("GPUSLICE_").lower()
                    assert field in settings.model_fields, f"{name}: {env['name']} is unknown"
    assert seen == set(SETTINGS)


def test_the_scheduler_configuration_hands_gpu_pods_to_the_extender(
    objects: list[dict[str, Any]],
) -> None:
    config = yaml.safe_load(find(objects, "ConfigMap", "gpuslice-scheduler")["data"]["config.yaml"])
    (profile,) = config["profiles"]
    assert profile["schedulerName"] == WebhookSettings.model_fields["scheduler_name"].default
    (extender,) = config["extenders"]
    assert extender["bindVerb"] == "bind"
    assert extender["filterVerb"] == "filter"
    assert extender["prioritizeVerb"] == "prioritize"
    assert extender["nodeCacheCapable"] is True
    managed = {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]}
    assert managed == dict.fromkeys(ResourceNames().all(), True)
    (_, spec), *_ = [(n, s) for n, s in pod_specs(objects) if n == "gpuslice-scheduler"]
    env = {e["name"]: e.get("value") for c in spec["containers"] for e in c.get("env", [])}
    assert extender["urlPrefix"] == f"http://127.0.0.1:{env['GPUSLICE_LISTEN_PORT']}"
    assert env["GPUSLICE_LISTEN_HOST"] == "127.0.0.1"


def test_the_device_plugin_runs_on_gpu_nodes_with_the_kubelet_socket_directory(
    objects: list[dict[str, Any]],
) -> None:
    plugin = find(objects, "DaemonSet", "gpuslice-deviceplugin")
    spec = plugin["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "on"}
    paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert paths["device-plugins"] == env["GPUSLICE_KUBELET_DIR"] == mounts["device-plugins"]
    assert paths["host-dir"] == env["GPUSLICE_HOST_DIR"] == mounts["host-dir"]


def test_node_agents_prove_their_node_with_a_projected_token_for_nats(
    objects: list[dict[str, Any]],
) -> None:
    (daemonset,) = [
        o
        for o in objects
        if o["metadata"]["name"] == "gpuslice-deviceplugin" and o["kind"] == "DaemonSet"
    ]
    spec = daemonset["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e for e in container["env"]}
    # no shared NATS password on the node, none for its containers
    assert not {"GPUSLICE_NATS_PASSWORD", "GPUSLICE_TELEMETRY_NATS_PASSWORD"} & set(env)
    token_file = env["GPUSLICE_NATS_TOKEN_FILE"]["value"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (source,) = volumes["nats-token"]["projected"]["sources"]
    projection = source["serviceAccountToken"]
    assert token_file == f"{mounts['nats-token']}/{projection['path']}"
    inventory_env = {
        e["name"]: e
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "gpuslice-inventory"
        for e in o["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert projection["audience"] == inventory_env["GPUSLICE_NODE_AGENT_AUDIENCE"]["value"]
    assert projection["expirationSeconds"] <= 3600
    account = inventory_env["GPUSLICE_NODE_AGENT_SERVICE_ACCOUNT"]["value"]
    namespace = daemonset["metadata"]["namespace"]
    assert account == f"system:serviceaccount:{namespace}:{spec['serviceAccountName']}"


def test_the_local_stack_runs_the_manifests_nats_accounts_and_users(
    objects: list[dict[str, Any]],
) -> None:
    (config_map,) = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpuslice-nats"
    ]
    config = config_map["data"]["nats.conf"]
    # the cluster's part before the accounts: listeners and storage only
    assert config.endswith(AUTHORIZATION)
    before = config.removesuffix(AUTHORIZATION)
    assert "accounts" not in before
    assert "authorization" not in before
    assert "$" not in before
    # nats-server's environment names every password the template reads
    (statefulset,) = [
        o
        for o in objects
        if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "gpuslice-nats"
    ]
    env = {e["name"] for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]}
    read = set(re.findall(r":\s*\$([A-Z_]+)", AUTHORIZATION))  # values, not subjects
    assert read == env == set(NatsAuth.generate().server_env())
