"""The Kubernetes manifests (k8s/, kustomize): every object valid against the
Kubernetes schemas, and wired the way the services read their settings."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from gpuslice_cli.dev.natsauth import AUTHORIZATION, NatsAuth
from gpuslice_common.config import (
    CommonSettings,
    DevicePluginSettings,
    InventorySettings,
    RequestSettings,
    ResourceNames,
    SchedulerSettings,
    WebhookSettings,
)
from gpuslice_common.devicetypes import parse_device_config, with_vendors
from gpuslice_common.dra import DEVICE_CLASS, DRIVER
from gpuslice_common.models import NVIDIA
from tests.deploy.kustomize import overlay, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.32.0"
# DRA mode's objects (resource.k8s.io/v1) exist from Kubernetes 1.34
DRA_KUBERNETES_VERSION = "1.34.0"
SETTINGS: dict[str, type[Any]] = {
    "gpuslice_webhook": WebhookSettings,
    "gpuslice_scheduler": SchedulerSettings,
    "gpuslice_inventory": InventorySettings,
    "gpuslice_deviceplugin": DevicePluginSettings,
}


OVERLAYS = ROOT / "overlays"
# the components combined in overlays of one's own (docs/install.md)
COMBINATIONS = [
    ("cpu-pods", "redis-cluster"),
    ("without-cert-manager", "redis-cluster"),
    ("without-cert-manager", "cpu-pods", "redis-cluster"),
    ("console-tokenreview", "redis-cluster"),
    ("dra", "redis-cluster"),
    ("vendors", "redis-cluster"),
    ("without-cert-manager", "console-tokenreview", "vendors"),
    # k8s/vendors' layout for k8s/cpu-pods, listed after it
    ("cpu-pods", "vendors/cpu-pods", "redis-cluster"),
]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """What can be applied: k8s/ (Redis Sentinel), each overlay of overlays/,
    and overlays of one's own combining k8s/'s components (docs/install.md)."""
    found: dict[str, Path] = {"k8s": K8S}
    found.update((d.name, d) for d in sorted(OVERLAYS.iterdir()) if d.is_dir())
    for components in COMBINATIONS:
        found["+".join(components)] = overlay(tmp_path_factory.mktemp("overlay"), K8S, *components)
    return found


BUILDS = [
    "k8s",
    *sorted(d.name for d in OVERLAYS.iterdir() if d.is_dir()),
    *("+".join(c) for c in COMBINATIONS),
]


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(K8S)


@pytest.fixture(scope="module")
def cluster_objects(builds: dict[str, Path]) -> list[dict[str, Any]]:
    return render(builds["redis-cluster"])


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name}")


POD_SPEC_KINDS = ("Deployment", "DaemonSet", "StatefulSet", "Job")


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("build", BUILDS)
def test_the_renderer_agrees_with_kubectl_kustomize(builds: dict[str, Path], build: str) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(builds[build])], capture_output=True, text=True, check=True
    ).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]

    def key(d: dict[str, Any]) -> tuple[str, str, str]:
        return d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]

    assert {key(d): d for d in theirs} == {key(d): d for d in render(builds[build])}


@pytest.mark.parametrize("build", BUILDS)
def test_every_object_is_valid_against_the_kubernetes_schemas(
    builds: dict[str, Path], build: str
) -> None:
    objects = render(builds[build])
    custom = []
    version = DRA_KUBERNETES_VERSION if "dra" in build.split("+") else KUBERNETES_VERSION
    for obj in objects:
        if obj["apiVersion"].startswith("cert-manager.io/"):
            custom.append(obj["kind"])
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{obj['kind']} {obj['metadata']['name']}: {exc}") from None
    # cert-manager's, unless gpuslice's own Jobs keep the webhook's certificate
    expected = [] if "without-cert-manager" in build else ["Certificate", "Issuer"]
    assert sorted(custom) == expected
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
        # GPU preemption: evictions (never deletes), the nominated node, Events
        ("", "pods/eviction", "create"),
        ("", "pods/status", "patch"),
        ("", "events", "create"),
        # node CPU and memory: a list and a watch of nodes and of pods, cluster-wide
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        *(
            ("coordination.k8s.io", "leases", v)
            for v in ("create", "get", "list", "update", "watch")
        ),
    }
    assert rules_of(objects, "gpuslice-inventory") == {
        ("", "pods", "list"),
        ("", "pods", "watch"),
        # DRA: the claim a node prepares and its pod, read from the API server;
        # the claims listed by the reconciliation
        ("", "pods", "get"),
        ("resource.k8s.io", "resourceclaims", "get"),
        ("resource.k8s.io", "resourceclaims", "list"),
        # the NATS auth callout reviews node agents' tokens, the web console its viewers'
        ("authentication.k8s.io", "tokenreviews", "create"),
        # and asks what each viewer may list
        ("authorization.k8s.io", "subjectaccessreviews", "create"),
    }
    assert rules_of(objects, "gpuslice-deviceplugin") == {("", "pods", "get")}
    shipped = {
        b["roleRef"]["name"]
        for b in objects
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and b["subjects"][0]["name"] == "gpuslice-scheduler"
    }
    assert {"system:kube-scheduler", "system:volume-scheduler"} <= shipped


@pytest.mark.parametrize("build", ["dra", "dra+redis-cluster"])
def test_dra_mode_adds_exactly_the_permissions_it_uses(
    builds: dict[str, Path], objects: list[dict[str, Any]], build: str
) -> None:
    dra = render(builds[build])
    added = {
        account: rules_of(dra, account) - rules_of(objects, account)
        for account in (
            "gpuslice-webhook",
            "gpuslice-scheduler",
            "gpuslice-inventory",
            "gpuslice-deviceplugin",
        )
    }
    group = "resource.k8s.io"
    assert added == {
        # a pod's claim template: created, read back when one of its name is
        # there (translated pods keep their GPU resources: quotas count those,
        # no template is listed); a pod's own claims read; the slices listed
        # for the cards' memory sizes
        "gpuslice-webhook": {
            (group, "resourceclaimtemplates", "create"),
            (group, "resourceclaimtemplates", "get"),
            (group, "resourceclaims", "get"),
            (group, "resourceslices", "list"),
        },
        "gpuslice-scheduler": set(),
        # k8s/'s own role reads claims and pods already: the inventory prepares a
        # node's claims and reconciles them in either mode
        "gpuslice-inventory": set(),
        # its node's slice only (the policy below narrows it to that slice)
        "gpuslice-deviceplugin": {
            (group, "resourceslices", verb)
            for verb in ("create", "update", "delete", "get", "list", "watch")
        },
    }
    # nothing of k8s/'s own roles changes
    for account in added:
        assert rules_of(dra, account) >= rules_of(objects, account)
    # no wildcard anywhere
    for obj in dra:
        if obj["kind"] in ("ClusterRole", "Role"):
            for rule in obj["rules"]:
                assert "*" not in rule["verbs"], obj
                assert "*" not in rule["resources"], obj


@pytest.mark.parametrize("build", ["dra", "dra+redis-cluster"])
def test_dra_mode_runs_the_agent_with_kubelet_s_plugin_directories(
    builds: dict[str, Path], objects: list[dict[str, Any]], build: str
) -> None:
    dra = render(builds[build])
    spec = find(dra, "DaemonSet", "gpuslice-deviceplugin")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUSLICE_DRA"] == "true"
    paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    # at the host's own paths, where the agent's settings look by default
    defaults = DevicePluginSettings.model_fields
    for volume, setting in (
        ("dra-plugins", "dra_plugins_dir"),
        ("dra-registry", "dra_registry_dir"),
        ("cdi", "cdi_dir"),
    ):
        assert paths[volume] == mounts[volume] == defaults[setting].default, volume
    assert env_of(dra, "gpuslice-webhook", "webhook")["GPUSLICE_DRA"] == "true"
    # everything else of the agent and the webhook as in k8s/
    base = find(objects, "DaemonSet", "gpuslice-deviceplugin")["spec"]["template"]["spec"]
    (before,) = base["containers"]
    assert [e for e in container["env"] if e["name"] != "GPUSLICE_DRA"] == before["env"]
    assert container["volumeMounts"][: len(before["volumeMounts"])] == before["volumeMounts"]
    # the device class the webhook's templates name selects the agents' driver
    device_class = find(dra, "DeviceClass", DEVICE_CLASS)
    (selector,) = device_class["spec"]["selectors"]
    assert selector["cel"]["expression"] == f'device.driver == "{DRIVER}"'


def test_the_scheduler_follows_nodes_and_pods_cluster_wide(objects: list[dict[str, Any]]) -> None:
    """Nodes are cluster-scoped and pods of every namespace count on a node: the
    role that lists and watches them must be bound for the whole cluster."""
    (binding,) = [
        b
        for b in objects
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and b["roleRef"]["name"] == "gpuslice-scheduler"
    ]
    assert binding["kind"] == "ClusterRoleBinding"
    assert binding["roleRef"]["kind"] == "ClusterRole"
    assert {(s["name"], s["namespace"]) for s in binding["subjects"]} == {
        ("gpuslice-scheduler", "gpuslice")
    }


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
        if obj["kind"] not in ("Deployment", "StatefulSet"):
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


def settings_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The GPUSLICE_ variables a container gets: its ConfigMaps' (envFrom), then
    its own env, which wins (values from Secrets left out, the pod's own fields
    as a name)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config = find(objects, "ConfigMap", source["configMapRef"]["name"])
        env.update(config.get("data") or {})
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "fieldRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = "gpu-node-1"
    return {k: v for k, v in env.items() if k.startswith("GPUSLICE_")}


@pytest.mark.parametrize("build", BUILDS)
def test_every_gpuslice_variable_is_a_setting_of_its_service(
    builds: dict[str, Path], build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(builds[build])
    seen = set()
    shared: dict[str, set[str]] = {}  # a shared ConfigMap's variable -> services that know it
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
            values = settings_env(objects, container)
            for key in values:
                field = key.removeprefix("GPUSLICE_").lower().split("__")[0]
                shared.setdefault(key, set())
                if field in settings.model_fields:
                    shared[key].add(command[2])
            # the service starts with these: each value parses as its setting
            with monkeypatch.context() as patched:
                for key in [k for k in os.environ if k.startswith("GPUSLICE_")]:
                    patched.delenv(key)
                for key, value in values.items():
                    patched.setenv(key, value)
                try:
                    settings()
                except ValidationError as error:
                    raise AssertionError(f"{name}: {error}") from None
    assert seen == set(SETTINGS)
    # the settings ConfigMap holds no variable that no service reads (a misspelling)
    assert {key for key, services in shared.items() if not services} == set()


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
    # the enforcer: host PIDs, the host's cgroup tree where its settings say
    assert spec["hostPID"] is True
    assert paths["cgroup"] == "/sys/fs/cgroup"
    assert mounts["cgroup"] == env["GPUSLICE_CGROUP_ROOT"]
    added = set(container["securityContext"]["capabilities"]["add"])
    assert {"KILL", "SYS_PTRACE"} <= added
    assert "SYS_ADMIN" not in added


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
    data = find(objects, "ConfigMap", "gpuslice-nats")["data"]
    # the accounts and users are the local stack's, word for word
    assert data["authorization.conf"] == AUTHORIZATION
    # the members' own part: listeners, storage and the cluster, then those
    config = data["nats.conf"]
    top_level = [
        line.split(":")[0].split(" ")[0] for line in config.splitlines() if line[:1].isalpha()
    ]
    assert top_level == [
        "server_name",
        "port",
        "http_port",
        "lame_duck_duration",
        "lame_duck_grace_period",
        "jetstream",
        "cluster",
        "include",
    ]
    assert config.rstrip().endswith("include ./authorization.conf")
    assert "accounts" not in config
    assert "auth_callout" not in config
    own = set(re.findall(r":\s*\$([A-Z_]+)", config))
    assert own == {"POD_NAME", "NATS_ROUTE_PASSWORD", "NATS_ROUTES"}
    # nats-server's environment names every variable the two read
    env = {e["name"] for e in nats_container(objects)["env"]}
    read = set(re.findall(r":\s*\$([A-Z_]+)", AUTHORIZATION))  # values, not subjects
    assert read == set(NatsAuth.generate().server_env())
    assert env == read | own


# ---------------------------------------------------------------- losing a member

NATS_MEMBERS = tuple(f"gpuslice-nats-{i}.gpuslice-nats-cluster.gpuslice.svc" for i in range(3))
REDIS_MEMBERS = tuple(f"gpuslice-redis-{i}.gpuslice-redis.gpuslice.svc" for i in range(3))


def nats_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    spec = find(objects, "StatefulSet", "gpuslice-nats")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return container


def member_names(statefulset: dict[str, Any], objects: list[dict[str, Any]]) -> tuple[str, ...]:
    """The DNS names of a StatefulSet's pods, through its headless Service."""
    service = find(objects, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    # members starting together find each other before any is ready
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= (
        statefulset["spec"]["template"]["metadata"]["labels"].items()
    )
    name, namespace = statefulset["metadata"]["name"], statefulset["metadata"]["namespace"]
    return tuple(
        f"{name}-{i}.{service['metadata']['name']}.{namespace}.svc"
        for i in range(statefulset["spec"]["replicas"])
    )


@pytest.mark.parametrize("name", ["gpuslice-nats", "gpuslice-redis"])
def test_the_servers_run_three_members_on_three_nodes_and_drain_one_at_a_time(
    objects: list[dict[str, Any]], name: str
) -> None:
    statefulset = find(objects, "StatefulSet", name)
    spec = statefulset["spec"]
    assert spec["replicas"] == 3
    # all start at once: a quorum (NATS) or the first primary (Redis) needs the others
    assert spec["podManagementPolicy"] == "Parallel"
    labels = spec["template"]["metadata"]["labels"]
    # never two members on one node: that node's loss would be the loss of two
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert (
        "preferredDuringSchedulingIgnoredDuringExecution"
        not in (spec["template"]["spec"]["affinity"]["podAntiAffinity"])
    )
    # drains and upgrades take one member at a time
    (budget,) = [
        b
        for b in objects
        if b["kind"] == "PodDisruptionBudget"
        and b["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}
    # each member keeps its own data
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert len(member_names(statefulset, objects)) == 3


def test_nats_members_route_to_each_other_with_the_route_password(
    objects: list[dict[str, Any]],
) -> None:
    statefulset = find(objects, "StatefulSet", "gpuslice-nats")
    assert member_names(statefulset, objects) == NATS_MEMBERS
    container = nats_container(objects)
    env = [e["name"] for e in container["env"]]
    values = {e["name"]: e for e in container["env"]}
    # the server's name is its pod's
    assert values["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    key = values["NATS_ROUTE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "gpuslice-credentials", "key": "nats-route"}
    # kubelet expands $(NATS_ROUTE_PASSWORD) only if it is defined before
    assert env.index("NATS_ROUTE_PASSWORD") < env.index("NATS_ROUTES")
    routes = yaml.safe_load(values["NATS_ROUTES"]["value"])
    assert routes == [
        f"nats-route://route:$(NATS_ROUTE_PASSWORD)@{member}:6222" for member in NATS_MEMBERS
    ]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"client": 4222, "cluster": 6222, "monitor": 8222}
    config = find(objects, "ConfigMap", "gpuslice-nats")["data"]["nats.conf"]
    assert re.search(r"cluster \{\n\s+name: gpuslice\n\s+port: 6222\n", config)
    assert "authorization { user: route, password: $NATS_ROUTE_PASSWORD }" in config
    assert "routes: $NATS_ROUTES" in config
    # lame duck on the way out, within the grace period
    assert "nats-server --signal ldm=1" in container["lifecycle"]["preStop"]["exec"]["command"][-1]
    duck = sum(int(m) for m in re.findall(r"lame_duck_(?:duration|grace_period): (\d+)s", config))
    assert duck < statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_every_nats_client_is_given_every_member(objects: list[dict[str, Any]]) -> None:
    members = [f"nats://{member}:4222" for member in NATS_MEMBERS]
    seen = set()
    for obj in objects:
        if obj["kind"] not in POD_SPEC_KINDS:
            continue
        spec = obj["spec"]["template"]["spec"]
        for container in spec["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if "GPUSLICE_NATS_URL" in env:
                seen.add(obj["metadata"]["name"])
                assert env["GPUSLICE_NATS_URL"].split(",") == members, obj["metadata"]["name"]
            # the interposer reads one address: the clients' Service, any member
            if "GPUSLICE_TELEMETRY_NATS_URL" in env:
                assert (
                    env["GPUSLICE_TELEMETRY_NATS_URL"] == "nats://gpuslice-nats.gpuslice.svc:4222"
                )
    assert seen == {
        "gpuslice-webhook",
        "gpuslice-scheduler",
        "gpuslice-inventory",
        "gpuslice-deviceplugin",
        "gpuslice-audit-init",
    }
    client = find(objects, "Service", "gpuslice-nats")
    assert "clusterIP" not in client["spec"]  # a virtual address in front of the members


def test_the_audit_stream_has_a_copy_on_each_member(objects: list[dict[str, Any]]) -> None:
    job = find(objects, "Job", "gpuslice-audit-init")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["gpuslice", "audit", "init"]
    env = {e["name"]: e for e in container["env"]}
    replicas = find(objects, "StatefulSet", "gpuslice-nats")["spec"]["replicas"]
    assert env["GPUSLICE_AUDIT_REPLICAS"]["value"] == str(replicas)
    for name in env:
        field = name.removeprefix("GPUSLICE_").lower()
        assert field in CommonSettings.model_fields, name


def test_the_ledger_s_clients_ask_every_sentinel_for_the_primary(
    objects: list[dict[str, Any]],
) -> None:
    statefulset = find(objects, "StatefulSet", "gpuslice-redis")
    assert member_names(statefulset, objects) == REDIS_MEMBERS
    data = find(objects, "ConfigMap", "gpuslice-redis")["data"]
    sentinel_conf = data["sentinel.conf"]
    service = CommonSettings.model_fields["redis_sentinel_service"].default
    # two of three sentinels agree a primary is lost
    assert f"sentinel monitor {service} ${{REDIS_PRIMARY}} ${{REDIS_PORT}} 2\n" in sentinel_conf
    assert f"sentinel down-after-milliseconds {service} 5000\n" in sentinel_conf
    # the scripts ask for the same primary
    assert f"sentinel get-master-addr-by-name {service}" in data["lib.sh"]
    # every container of a member knows every member and itself by name
    containers = {c["name"]: c for c in statefulset["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"redis", "sentinel"}
    for container in containers.values():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["REDIS_MEMBERS"].split() == list(REDIS_MEMBERS)
        assert env["REDIS_SELF"] == "$(POD_NAME).gpuslice-redis.gpuslice.svc"
        assert (env["REDIS_PORT"], env["SENTINEL_PORT"]) == ("6379", "26379")
    ports = {p["name"]: p["containerPort"] for c in containers.values() for p in c["ports"]}
    assert ports == {"redis": 6379, "sentinel": 26379}
    # the services: every member's sentinel, as the sentinels' "client" user
    client_user = re.search(r"user client on >\$\{(\w+)\}", sentinel_conf)
    assert client_user is not None
    sentinel_env = {e["name"]: e for e in containers["sentinel"]["env"]}
    client_key = sentinel_env[client_user[1]]["valueFrom"]["secretKeyRef"]["key"]
    for name in ("gpuslice-scheduler", "gpuslice-inventory"):
        spec = find(objects, "Deployment", name)["spec"]["template"]["spec"]
        (container,) = [c for c in spec["containers"] if c["image"].startswith("ghcr.io/gpuslice")]
        env = {e["name"]: e for e in container["env"]}
        sentinels = env["GPUSLICE_REDIS_SENTINELS"]["value"].split(",")
        assert sentinels == [f"{member}:26379" for member in REDIS_MEMBERS], name
        assert env["GPUSLICE_REDIS_SENTINEL_USER"]["value"] == "client"
        key = env["GPUSLICE_REDIS_SENTINEL_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"]
        assert key == client_key
        assert "GPUSLICE_REDIS_CLUSTER" not in env
        # the user, password and database for the primary
        assert env["GPUSLICE_REDIS_URL"]["value"].startswith(
            f"redis://{name.removeprefix('gpuslice-')}:$(REDIS_PASSWORD)@"
        )
    # operators reach a sentinel through one Service
    service_obj = find(objects, "Service", "gpuslice-redis-sentinel")
    assert [p["port"] for p in service_obj["spec"]["ports"]] == [26379]


# ---------------------------------------------------------------- Redis Cluster


def acl_lines(objects: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each ACL user's rules (users.acl), by user."""
    text = find(objects, "ConfigMap", "gpuslice-redis")["data"]["users.acl"]
    return {line.split()[1]: line.split()[2:] for line in text.splitlines()}


def test_the_redis_cluster_component_runs_six_members_and_no_sentinels(
    objects: list[dict[str, Any]], cluster_objects: list[dict[str, Any]]
) -> None:
    statefulset = find(cluster_objects, "StatefulSet", "gpuslice-redis")
    assert statefulset["spec"]["replicas"] == 6
    members = member_names(statefulset, cluster_objects)
    spec = statefulset["spec"]["template"]["spec"]
    # still one member per node, and one at a time drained (k8s/'s)
    assert (
        spec["affinity"]
        == find(objects, "StatefulSet", "gpuslice-redis")["spec"]["template"]["spec"]["affinity"]
    )
    assert (
        find(cluster_objects, "PodDisruptionBudget", "gpuslice-redis")["spec"]["maxUnavailable"]
        == 1
    )
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["REDIS_MEMBERS"].split() == list(members)
    assert {p["containerPort"] for p in container["ports"]} == {6379, 16379}
    assert {v["name"] for v in spec["volumes"]} == {"config", "redis-run"}
    data = find(cluster_objects, "ConfigMap", "gpuslice-redis")["data"]
    assert "cluster-enabled yes" in data["redis.conf"]
    assert not {"sentinel.conf", "sentinel.sh", "handover.sh"} & set(data)
    assert data["lib.sh"] == find(objects, "ConfigMap", "gpuslice-redis")["data"]["lib.sh"]
    # the Job that makes the cluster knows the same members
    job = find(cluster_objects, "Job", "gpuslice-redis-cluster-create")
    (creator,) = job["spec"]["template"]["spec"]["containers"]
    job_env = {e["name"]: e.get("value") for e in creator["env"]}
    assert job_env["REDIS_MEMBERS"] == env["REDIS_MEMBERS"]
    # no sentinels to ask
    kinds = {(o["kind"], o["metadata"]["name"]) for o in cluster_objects}
    assert ("Service", "gpuslice-redis-sentinel") not in kinds
    for name in ("gpuslice-scheduler", "gpuslice-inventory"):
        spec = find(cluster_objects, "Deployment", name)["spec"]["template"]["spec"]
        (client,) = [c for c in spec["containers"] if c["image"].startswith("ghcr.io/gpuslice")]
        client_env = {e["name"]: e.get("value") for e in client["env"]}
        assert client_env["GPUSLICE_REDIS_CLUSTER"] == "true"
        assert not [k for k in client_env if k.startswith("GPUSLICE_REDIS_SENTINEL")], name
        assert client_env["GPUSLICE_REDIS_URL"].endswith("@gpuslice-redis:6379/0")


def test_the_redis_cluster_keeps_k8s_s_users_with_what_a_cluster_client_sends(
    objects: list[dict[str, Any]], cluster_objects: list[dict[str, Any]]
) -> None:
    sentinel, cluster = acl_lines(objects), acl_lines(cluster_objects)
    # the clients read where the slots are and the commands' key positions
    for user in ("scheduler", "inventory", "operator"):
        assert cluster[user] == [*sentinel[user], "+cluster|slots", "+command"], user
    for user in ("default", "probe", "replica"):
        assert cluster[user] == sentinel[user], user
    # no sentinels; the cluster's creation by the Job, which reads no key
    assert set(cluster) == set(sentinel) - {"sentinel"} | {"clusteradmin"}
    admin = cluster["clusteradmin"]
    assert "-@all" in admin
    assert not [rule for rule in admin if rule.startswith(("~", "%", "&", "allkeys"))]
    assert all(r.startswith(("+ping", "+info", "+dbsize", "+cluster|")) for r in admin[3:])


def test_the_redis_cluster_bus_is_open_between_members_only(
    cluster_objects: list[dict[str, Any]],
) -> None:
    policy = find(cluster_objects, "NetworkPolicy", "gpuslice-redis-cluster")
    rules = {
        tuple(p["port"] for p in rule["ports"]): [
            peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for peer in rule["from"]
        ]
        for rule in policy["spec"]["ingress"]
    }
    assert rules == {
        (16379,): ["gpuslice-redis"],
        (6379,): ["gpuslice-redis-cluster-create"],
    }


# ---------------------------------------------------------------- pods without GPUs


def env_of(objects: list[dict[str, Any]], deployment: str, container: str) -> dict[str, Any]:
    spec = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    (found,) = [c for c in spec["containers"] if c["name"] == container]
    return {e["name"]: e.get("value") for e in found.get("env", [])}


def test_pods_without_gpus_are_left_to_the_default_scheduler_unless_asked(
    objects: list[dict[str, Any]],
) -> None:
    # k8s/ alone: the webhook is called for GPU pods only and routes nothing else
    (hook,) = find(objects, "MutatingWebhookConfiguration", "gpuslice")["webhooks"]
    assert hook["name"] == "pods.gpuslice.io"
    assert "GPUSLICE_ROUTE_CPU_PODS" not in env_of(objects, "gpuslice-webhook", "webhook")
    assert "GPUSLICE_SCORE_CPU_PODS" not in env_of(objects, "gpuslice-scheduler", "extender")
    assert WebhookSettings.model_fields["route_cpu_pods"].default is False
    assert SchedulerSettings.model_fields["score_cpu_pods"].default is False


@pytest.mark.parametrize("build", ["cpu-pods", "cpu-pods+redis-cluster"])
def test_the_cpu_pods_component_adds_a_fail_open_entry_and_both_switches(
    builds: dict[str, Path],
    objects: list[dict[str, Any]],
    cluster_objects: list[dict[str, Any]],
    build: str,
) -> None:
    routed = render(builds[build])
    (base,) = find(objects, "MutatingWebhookConfiguration", "gpuslice")["webhooks"]
    gpu, cpu = find(routed, "MutatingWebhookConfiguration", "gpuslice")["webhooks"]
    assert gpu == base  # GPU pods' entry unchanged
    assert cpu["name"] == "cpu-pods.gpuslice.io"
    assert cpu["failurePolicy"] == "Ignore"
    assert cpu["sideEffects"] == "None"  # no event is published for these pods
    assert cpu["clientConfig"] == base["clientConfig"]
    assert [(r["operations"], r["resources"]) for r in cpu["rules"]] == [(["CREATE"], ["pods"])]
    assert cpu["timeoutSeconds"] <= base["timeoutSeconds"]
    assert cpu["objectSelector"] == base["objectSelector"]
    expressions = cpu["namespaceSelector"]["matchExpressions"]
    assert expressions[1:] == base["namespaceSelector"]["matchExpressions"]
    assert expressions[0] == {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": ["kube-system", "gpuslice"],
    }
    (condition,) = cpu["matchConditions"]
    assert condition["name"] == "names-no-gpu-resource"
    # the webhook routes them, the extender scores them
    assert env_of(routed, "gpuslice-webhook", "webhook")["GPUSLICE_ROUTE_CPU_PODS"] == "true"
    assert env_of(routed, "gpuslice-scheduler", "extender")["GPUSLICE_SCORE_CPU_PODS"] == "true"
    # and nothing else of k8s/'s (or the Redis Cluster component's) settings changes
    before = cluster_objects if build.endswith("+redis-cluster") else objects
    webhook_env = env_of(routed, "gpuslice-webhook", "webhook")
    extender_env = env_of(routed, "gpuslice-scheduler", "extender")
    del webhook_env["GPUSLICE_ROUTE_CPU_PODS"], extender_env["GPUSLICE_SCORE_CPU_PODS"]
    assert webhook_env == env_of(before, "gpuslice-webhook", "webhook")
    assert extender_env == env_of(before, "gpuslice-scheduler", "extender")


@pytest.mark.parametrize("build", ["cpu-pods", "cpu-pods+redis-cluster"])
def test_the_cpu_pods_component_sends_every_pod_to_the_extender(
    builds: dict[str, Path], objects: list[dict[str, Any]], build: str
) -> None:
    """kube-scheduler calls an extender that lists managedResources only for pods
    that ask for one of them: with the component the extender lists none, and
    the GPU resources kube-scheduler must not count itself move to
    NodeResourcesFit's ignoredResources (what ignoredByScheduler sets)."""
    base = yaml.safe_load(find(objects, "ConfigMap", "gpuslice-scheduler")["data"]["config.yaml"])
    routed = yaml.safe_load(
        find(render(builds[build]), "ConfigMap", "gpuslice-scheduler")["data"]["config.yaml"]
    )
    (extender,) = routed["extenders"]
    assert "managedResources" not in extender
    (profile,) = routed["profiles"]
    (fit,) = profile.pop("pluginConfig")
    assert fit == {
        "name": "NodeResourcesFit",
        "args": {"ignoredResources": list(ResourceNames().all())},
    }
    (managed,) = [e.pop("managedResources") for e in base["extenders"]]
    assert all(r["ignoredByScheduler"] for r in managed)
    assert [r["name"] for r in managed] == fit["args"]["ignoredResources"]
    assert routed == base  # everything else as k8s/ has it


# ---------------------------------------------------------------- other vendors

HAMI_DEVICE_CONFIG = ROOT / "tests" / "data" / "hami-device-config.yaml"
# the builds with k8s/vendors, and the build each adds it to
VENDOR_BUILDS = {
    "vendors": "k8s",
    "vendors+redis-cluster": "redis-cluster",
    "cpu-pods+vendors/cpu-pods+redis-cluster": "cpu-pods+redis-cluster",
}
VENDOR_SERVICES = [
    ("gpuslice-webhook", "webhook"),
    ("gpuslice-scheduler", "extender"),
    ("gpuslice-inventory", "inventory"),
]


def vendor_resources() -> list[str]:
    """Every resource the webhook and the extender must know: NVIDIA's, then
    each count, memory and cores resource of the vendors gpuslice reads from
    the device configuration k8s/vendors ships, in its order."""
    config = parse_device_config(HAMI_DEVICE_CONFIG.read_text())
    others = [n for t in config.announced() if t.vendor != NVIDIA for n in t.resources]
    assert len(others) > 40  # every vendor of HAMi's chart
    return [*ResourceNames().all(), *others]


def listed_names(expression: str) -> list[str]:
    """The resource names a k8s/vendors condition lists: the list literal it
    begins with (``[...].exists(n, ...)``), read as JSON."""
    literal, sep, _ = expression.removeprefix("!(").lstrip().partition("].exists(n,")
    assert sep, expression[:80]
    names = json.loads(literal + "]")
    assert isinstance(names, list)
    return names


def container_of(objects: list[dict[str, Any]], deployment: str, name: str) -> dict[str, Any]:
    spec = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


@pytest.mark.parametrize("build", sorted(VENDOR_BUILDS))
def test_the_vendors_component_ships_hami_s_device_configuration(
    builds: dict[str, Path], build: str, tmp_path: Path
) -> None:
    objects = render(builds[build])
    config = find(objects, "ConfigMap", "gpuslice-device-config")
    assert config["metadata"]["namespace"] == "gpuslice"
    (text,) = config["data"].values()
    assert list(config["data"]) == ["device-config.yaml"]
    # HAMi's chart defaults, as the tests' own copy, without its comments
    shipped = parse_device_config(text)
    assert shipped == parse_device_config(HAMI_DEVICE_CONFIG.read_text())
    assert shipped.warnings == ()
    assert not text.startswith("#")
    # as the webhook and the extender read it: every vendor's requests
    (tmp_path / "device-config.yaml").write_text(text)
    requests = with_vendors(RequestSettings(), str(tmp_path / "device-config.yaml"))
    names = [n for v in requests.vendors for n in v.all()]
    assert [*requests.resources.all(), *names] == vendor_resources()


@pytest.mark.parametrize("build", sorted(VENDOR_BUILDS))
def test_the_vendors_component_mounts_the_configuration_where_each_service_reads_it(
    builds: dict[str, Path], build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(builds[build])
    before = render(builds[VENDOR_BUILDS[build]])
    for deployment, name in VENDOR_SERVICES:
        container = container_of(objects, deployment, name)
        spec = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
        path = env_of(objects, deployment, name)["GPUSLICE_DEVICE_CONFIG"]
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True, deployment
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        config = find(objects, "ConfigMap", volume["configMap"]["name"])
        assert path.removeprefix(mount["mountPath"] + "/") in config["data"], deployment
        # the setting the service reads
        settings = settings_of(objects, deployment, monkeypatch, name)
        assert settings.device_config == path, deployment
        # and nothing of the build's own is lost
        old = container_of(before, deployment, name)
        old_spec = find(before, "Deployment", deployment)["spec"]["template"]["spec"]
        assert container["env"] == [*old["env"], {"name": "GPUSLICE_DEVICE_CONFIG", "value": path}]
        assert container["volumeMounts"] == [*old.get("volumeMounts", []), mount], deployment
        assert spec["volumes"] == [*old_spec.get("volumes", []), volume], deployment
        rest = {k: v for k, v in container.items() if k not in ("env", "volumeMounts")}
        assert rest == {k: v for k, v in old.items() if k not in ("env", "volumeMounts")}
    # the node agents read no device configuration: HAMi's vendor plugins announce those cards
    agent = find(objects, "DaemonSet", "gpuslice-deviceplugin")
    assert agent == find(before, "DaemonSet", "gpuslice-deviceplugin")


@pytest.mark.parametrize("build", sorted(VENDOR_BUILDS))
def test_the_vendors_component_adds_exactly_the_permissions_it_uses(
    builds: dict[str, Path], build: str
) -> None:
    objects = render(builds[build])
    before = render(builds[VENDOR_BUILDS[build]])
    accounts = ("gpuslice-webhook", "gpuslice-scheduler", "gpuslice-inventory")
    added = {
        a: rules_of(objects, a) - rules_of(before, a) for a in (*accounts, "gpuslice-deviceplugin")
    }
    # the inventory lists the nodes (VendorSync: kube.list_nodes), no watch
    assert added == {
        "gpuslice-webhook": set(),
        "gpuslice-scheduler": set(),
        "gpuslice-inventory": {("", "nodes", "list")},
        "gpuslice-deviceplugin": set(),
    }
    for account in accounts:
        assert rules_of(objects, account) >= rules_of(before, account)


@pytest.mark.parametrize("build", sorted(VENDOR_BUILDS))
def test_the_webhook_and_the_extender_know_every_vendor_resource(
    builds: dict[str, Path], build: str
) -> None:
    """The lists k8s/vendors writes are the device configuration's resources,
    NVIDIA's first: a vendor added to or renamed in the configuration without
    them fails here."""
    objects = render(builds[build])
    before = render(builds[VENDOR_BUILDS[build]])
    wanted = vendor_resources()
    hooks = find(objects, "MutatingWebhookConfiguration", "gpuslice")["webhooks"]
    old_hooks = find(before, "MutatingWebhookConfiguration", "gpuslice")["webhooks"]
    assert len(hooks) == len(old_hooks)
    for hook, old in zip(hooks, old_hooks, strict=True):
        (condition,) = hook["matchConditions"]
        assert listed_names(condition["expression"]) == wanted, hook["name"]
        (old_condition,) = old["matchConditions"]
        assert condition["name"] == old_condition["name"]
        # the rest of each entry as the build has it
        assert {**hook, "matchConditions": None} == {**old, "matchConditions": None}

    config = yaml.safe_load(find(objects, "ConfigMap", "gpuslice-scheduler")["data"]["config.yaml"])
    old_config = yaml.safe_load(
        find(before, "ConfigMap", "gpuslice-scheduler")["data"]["config.yaml"]
    )
    (extender,) = config["extenders"]
    (old_extender,) = old_config["extenders"]
    if "managedResources" in old_extender:  # k8s/: the extender manages them
        managed = extender.pop("managedResources")
        assert [r["name"] for r in managed] == wanted
        assert all(r["ignoredByScheduler"] is True for r in managed)
        old_extender.pop("managedResources")
    else:  # with k8s/cpu-pods: sent every pod, kube-scheduler ignores the resources
        assert "managedResources" not in extender
        (profile,) = config["profiles"]
        (fit,) = profile["pluginConfig"]
        assert fit["name"] == "NodeResourcesFit"
        assert fit["args"]["ignoredResources"] == wanted
        fit["args"]["ignoredResources"] = None
        (old_fit,) = old_config["profiles"][0]["pluginConfig"]
        old_fit["args"]["ignoredResources"] = None
    assert config == old_config  # everything else as the build has it


@pytest.mark.parametrize(
    "components",
    [
        ("vendors", "cpu-pods"),
        ("cpu-pods", "vendors"),
        ("vendors/cpu-pods",),
        ("vendors", "vendors/cpu-pods"),
        ("vendors/cpu-pods", "cpu-pods"),
    ],
)
def test_k8s_vendors_and_cpu_pods_combine_one_way_only(
    tmp_path: Path, components: tuple[str, ...]
) -> None:
    """Both rewrite the webhook condition and the scheduler configuration:
    another combination than cpu-pods then vendors/cpu-pods fails the build
    (their test steps) rather than lose one's change."""
    with pytest.raises(ValueError, match=r"^(test failed at|no) /"):
        render(overlay(tmp_path, K8S, *components))


# ---------------------------------------------------------------- install without hand work


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(object name, container) for every container of every workload, Jobs included."""
    for obj in objects:
        spec = obj.get("spec", {})
        if obj["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        elif obj["kind"] not in POD_SPEC_KINDS:
            continue
        pod = spec["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            yield obj["metadata"]["name"], container


# name:1.2.3 (a suffix such as -alpine allowed), v1.2.3, or a digest
PINNED = re.compile(r"^[a-z0-9./-]+(:v?\d+\.\d+\.\d+(-[a-z0-9.]+)?)?(@sha256:[0-9a-f]{64})?$")


@pytest.mark.parametrize("build", BUILDS)
def test_every_image_is_pinned_to_an_exact_version(builds: dict[str, Path], build: str) -> None:
    images = {c["image"] for _, c in containers(render(builds[build]))}
    for image in images:
        assert PINNED.match(image), image
        assert ":" in image.rsplit("/", 1)[-1] or "@sha256:" in image, f"{image}: no tag"
    names = {image.rsplit(":", 1)[0] for image in images}
    assert {"nats", "redis", "registry.k8s.io/kube-scheduler", "ghcr.io/gpuslice/gpuslice"} <= (
        names
    )
    assert len(names) == len(images), f"two versions of one image: {sorted(images)}"


def test_compose_runs_the_servers_k8s_pins() -> None:
    pins = {
        i["name"]: i["newTag"]
        for i in yaml.safe_load((K8S / "images" / "kustomization.yaml").read_text())["images"]
    }
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    images = {s["image"] for s in compose["services"].values()}
    assert f"nats:{pins['nats']}" in images
    assert f"redis:{pins['redis']}" in images


@pytest.mark.parametrize("version", ["1.30", "1.31", "1.33"])
def test_a_kube_scheduler_overlay_sets_the_cluster_s_minor_version(
    builds: dict[str, Path], version: str
) -> None:
    objects = render(builds[f"kube-scheduler-{version}"])
    spec = find(objects, "Deployment", "gpuslice-scheduler")["spec"]["template"]["spec"]
    (scheduler,) = [c for c in spec["containers"] if c["name"] == "kube-scheduler"]
    assert scheduler["image"].startswith(f"registry.k8s.io/kube-scheduler:v{version}.")
    # nothing else differs from k8s/
    base = render(K8S)
    scheduler["image"] = next(
        c["image"]
        for _, c in containers(base)
        if c["image"].startswith("registry.k8s.io/kube-scheduler:")
    )
    assert objects == base


def test_the_bootstrap_job_makes_the_credentials_with_no_more_rights_than_that(
    objects: list[dict[str, Any]],
) -> None:
    job = find(objects, "Job", "gpuslice-bootstrap")
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"][:3] == ["gpuslice", "install", "secrets"]
    assert spec["serviceAccountName"] == "gpuslice-bootstrap"
    assert rules_of(objects, "gpuslice-bootstrap") == {
        ("", "secrets", "get"),
        ("", "secrets", "update"),
        ("", "secrets", "create"),
    }
    (role,) = [
        o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "gpuslice-bootstrap"
    ]
    for rule in role["rules"]:
        if set(rule["verbs"]) & {"get", "update"}:
            assert rule["resourceNames"] == ["gpuslice-credentials"]
    bindings = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert not [b for b in bindings if b["subjects"][0]["name"] == "gpuslice-bootstrap"]
    # a Job finished long ago is gone, so the next apply runs it again
    assert job["spec"]["ttlSecondsAfterFinished"] <= 3600


def test_without_cert_manager_gpuslice_s_jobs_keep_the_secret_the_webhook_mounts(
    builds: dict[str, Path],
) -> None:
    from gpuslice_cli.install import WebhookTarget

    objects = render(builds["without-cert-manager"])
    assert not [o for o in objects if o["apiVersion"].startswith("cert-manager.io/")]
    config = find(objects, "MutatingWebhookConfiguration", "gpuslice")
    assert "annotations" not in config["metadata"]
    target = WebhookTarget()
    assert config["metadata"]["name"] == target.configuration
    service = config["webhooks"][0]["clientConfig"]["service"]
    assert (service["name"], service["namespace"]) == (target.service, target.namespace)
    spec = find(objects, "Deployment", "gpuslice-webhook")["spec"]["template"]["spec"]
    (volume,) = spec["volumes"]
    assert volume["secret"]["secretName"] == target.tls_secret
    job = find(objects, "Job", "gpuslice-webhook-cert")["spec"]["template"]["spec"]
    cron = find(objects, "CronJob", "gpuslice-webhook-cert")
    renewal = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    for pod in (job, renewal):
        (container,) = pod["containers"]
        assert container["command"][:3] == ["gpuslice", "install", "webhook-cert"]
        assert container["image"] == "ghcr.io/gpuslice/gpuslice:0.1.0"
        assert pod["serviceAccountName"] == "gpuslice-webhook-cert"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    # the two Secrets, and the one webhook configuration's caBundle: nothing else
    assert rules_of(objects, "gpuslice-webhook-cert") == {
        ("", "secrets", "get"),
        ("", "secrets", "update"),
        ("", "secrets", "create"),
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "get"),
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "update"),
    }
    for kind in ("Role", "ClusterRole"):
        role = find(objects, kind, "gpuslice-webhook-cert")
        for rule in role["rules"]:
            if set(rule["verbs"]) & {"get", "update"}:
                assert set(rule["resourceNames"]) <= {
                    target.tls_secret,
                    target.ca_secret,
                    target.configuration,
                }


# HAMi's knobs (its Helm values and device-plugin configuration), each a line
# of overlays/hami-settings
HAMI_KNOBS = [
    "defaultMem",
    "defaultCores",
    "defaultGPUNum",
    "nodeSchedulerPolicy",
    "gpuSchedulerPolicy",
    "resourceName",
    "resourceMem",
    "resourceMemPercentage",
    "resourceCores",
    "resourcePriority",
    "schedulerName",
    "deviceSplitCount",
    "deviceMemoryScaling",
    "deviceCoreScaling",
    "gpuCorePolicy",
    "libCudaLogLevel",
    "migStrategy",
    "migProfileAllowlist",
]


def test_every_hami_knob_is_one_documented_line_of_the_hami_settings_overlay(
    builds: dict[str, Path],
) -> None:
    from gpuslice_deviceplugin.nodeconfig import parse_node_config

    directory = OVERLAYS / "hami-settings"
    text = (directory / "kustomization.yaml").read_text() + (
        directory / "node-config.yaml"
    ).read_text()
    for knob in HAMI_KNOBS:
        assert re.search(rf"\b{knob}\b", text), f"{knob} is not in overlays/hami-settings"
    objects = render(builds["hami-settings"])
    data = find(objects, "ConfigMap", "gpuslice-settings")["data"]
    # HAMi's GPU policy: spread (gpuslice's default is fragmentation)
    assert data["GPUSLICE_REQUESTS__DEFAULT_GPU_POLICY"] == "spread"
    assert data["GPUSLICE_LOG_LEVEL"] == "INFO"  # k8s/'s own settings kept (merged)
    # the node configuration parses as the device plugin reads it
    node = find(objects, "ConfigMap", "gpuslice-node-config")["data"]["config.yaml"]
    config = parse_node_config(node, "gpu-node-1")
    assert (config.split_count, config.memory_scaling, config.core_scaling) == (10, 1.0, 1.0)
    # the services load the settings: the ones HAMi's knobs change
    for deployment, container in [
        ("gpuslice-webhook", "webhook"),
        ("gpuslice-scheduler", "extender"),
        ("gpuslice-inventory", "inventory"),
    ]:
        spec = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
        (found,) = [c for c in spec["containers"] if c["name"] == container]
        assert {"configMapRef": {"name": "gpuslice-settings"}} in found["envFrom"], deployment


@pytest.mark.parametrize("build", BUILDS)
def test_no_build_carries_a_secret(builds: dict[str, Path], build: str) -> None:
    """Passwords and keys are made in the cluster (gpuslice install), never shipped."""
    objects = render(builds[build])
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Secret"] == []
    for _, container in containers(objects):
        for entry in container.get("env", []):
            if "PASSWORD" in entry["name"] or entry["name"].endswith(("_SEED", "_AUTH")):
                assert "valueFrom" in entry, f"{container['name']}: {entry['name']} is a literal"


def settings_of(
    objects: list[dict[str, Any]],
    deployment: str,
    monkeypatch: pytest.MonkeyPatch,
    name: str | None = None,
) -> Any:
    """The settings the Deployment's service (its one container, or ``name``) starts with."""
    containers = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    (container,) = [c for c in containers if name is None or c["name"] == name]
    with monkeypatch.context() as patched:
        for key in [k for k in os.environ if k.startswith("GPUSLICE_")]:
            patched.delenv(key)
        for key, value in settings_env(objects, container).items():
            patched.setenv(key, value)
        return SETTINGS[container["command"][2]]()


def test_the_console_is_reached_by_port_forward_unless_tokens_are_asked_for(
    objects: list[dict[str, Any]], builds: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """k8s/: the console listens on the pod's loopback without authentication
    (kubectl port-forward); console-tokenreview: on the pod's address, behind
    TokenReview. Its port is named alike in the pod and the Service."""
    for build in (objects, render(builds["console-tokenreview"])):
        (container,) = find(build, "Deployment", "gpuslice-inventory")["spec"]["template"]["spec"][
            "containers"
        ]
        assert {"name": "console", "containerPort": 8090} in container["ports"]
        service = find(build, "Service", "gpuslice-inventory")
        assert {"name": "console", "port": 8090, "targetPort": "console"} in service["spec"][
            "ports"
        ]
    plain = settings_of(objects, "gpuslice-inventory", monkeypatch)
    assert (plain.console_port, plain.console_host, plain.console_auth) == (
        8090,
        "127.0.0.1",
        "none",
    )
    reviewed = settings_of(render(builds["console-tokenreview"]), "gpuslice-inventory", monkeypatch)
    assert (reviewed.console_host, reviewed.console_auth) == ("0.0.0.0", "tokenreview")
