"""DRA mode: the webhook, over HTTP, turns HAMi-style GPU requests into a
ResourceClaimTemplate it creates through the dev API server (the real
Kubernetes client over HTTP, a LocalKubeApi behind it), and patches the pod
to reference it. Templates and patched pods are checked against Kubernetes
1.34's schemas."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import httpx
import kubernetes_validate
import pytest
from pydantic import ValidationError

from gpuslice_cli.dev.apiserver import DevApiServer
from gpuslice_common.config import WebhookSettings
from gpuslice_common.dra import API_VERSION, DEVICE_CLASS, DRIVER
from gpuslice_common.kube import KubeError, KubernetesApi, LocalKubeApi, ObjectRef
from gpuslice_common.models import DeviceSelector, GpuDevice
from gpuslice_common.requests import RequestError, parse_pod
from gpuslice_common.servers import free_port
from gpuslice_webhook.claims import (
    MODE_LABEL,
    TEMPLATES,
    CardSizes,
    card_sizes,
    claim_template,
    mib_quantity,
    ours_and_equal,
)
from gpuslice_webhook.mutation import Denied, Mutator
from gpuslice_webhook.service import Running, running
from tests.hami.cases import Case, all_cases, pod_manifest, request_settings
from tests.webhook.conftest import (
    CORES,
    GPU,
    MEM,
    MEM_PCT,
    applied,
    check_response,
    container,
    pod,
    review,
    settings,
)

NS = "team-a"
K8S = "1.34.0"
MANAGED = "app.kubernetes.io/managed-by=gpuslice"


@dataclass
class Stack:
    store: LocalKubeApi
    webhook: Running
    http: httpx.AsyncClient

    async def admit(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = await self.http.post("/mutate", json=body)
        assert answer.status_code == 200
        return check_response(body, answer.json())

    async def templates(self, namespace: str = NS) -> list[dict[str, Any]]:
        return list(await self.store.list_objects(TEMPLATES.in_namespace(namespace)))

    def counted(self, result: str) -> float:
        value = self.webhook.admission.metrics.dra_templates.labels(result)._value.get()
        return float(value)


@contextlib.asynccontextmanager
async def stack(
    tmp_path: Path, *, server: str | None = None, **overrides: Any
) -> AsyncIterator[Stack]:
    """The webhook (DRA mode unless overridden) on a free port, its Kubernetes API
    the dev API server over a LocalKubeApi (or ``server``, where nothing answers)."""
    store = LocalKubeApi()
    api = DevApiServer(store)
    async with api.serving():
        kube = KubernetesApi.connect(server or api.url, token=api.token, timeout=3)
        values: dict[str, Any] = {"dra": True, "listen_port": free_port(), "kube_timeout": 3}
        values.update(overrides)
        try:
            async with running(settings(**values), kube, None) as webhook:
                base = f"http://127.0.0.1:{webhook.port}"
                async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                    yield Stack(store, webhook, http)
        finally:
            await kube.close()


def valid(obj: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(obj, K8S, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{obj['kind']}: {exc}") from None


def claimed(patched: dict[str, Any]) -> str:
    """The template the patched pod's gpuslice claim names."""
    (claim,) = [c for c in patched["spec"]["resourceClaims"] if c["name"] == "gpuslice"]
    assert set(claim) == {"name", "resourceClaimTemplateName"}
    name = claim["resourceClaimTemplateName"]
    assert isinstance(name, str)
    return name


def gpu_pod(name: str = "trainer", **annotations: str) -> dict[str, Any]:
    return pod(
        container("main", {GPU: 2, MEM: 4000, CORES: 30}),
        container("logger"),
        init=[container("warmup", {GPU: 1, MEM: 1000})],
        name=name,
        annotations=dict(annotations) or None,
    )


# ---------------------------------------------------------------- translation


async def test_a_gpu_pod_becomes_one_template_and_references_it(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        sent = review(
            gpu_pod(
                **{
                    "nvidia.com/use-gputype": "A100,H100",
                    "nvidia.com/nouse-gputype": "MIG",
                    "nvidia.com/use-gpuuuid": "GPU-aaa,GPU-bbb",
                    "nvidia.com/nouse-gpuuuid": "GPU-ccc",
                    "nvidia.com/numa-bind": "true",
                }
            )
        )
        response = await s.admit(sent)
        assert response["allowed"] is True
        (template,) = await s.templates()
        assert s.counted("created") == 1
    valid(template)
    name = template["metadata"]["name"]
    assert name.startswith("gpuslice-")
    assert template["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gpuslice"}
    devices = template["spec"]["spec"]["devices"]
    requests = {r["name"]: r["exactly"] for r in devices["requests"]}
    assert list(requests) == ["warmup", "main"]  # init containers first, as parse_pod lists
    attrs = f'device.attributes["{DRIVER}"]'
    selectors = [
        f'{attrs}.model.lowerAscii().contains("a100") || '
        f'{attrs}.model.lowerAscii().contains("h100")',
        f'!{attrs}.model.lowerAscii().contains("mig")',
        f'{attrs}.uuid in ["GPU-aaa", "GPU-bbb"]',
        f'!({attrs}.uuid in ["GPU-ccc"])',
    ]
    assert requests["main"] == {
        "deviceClassName": DEVICE_CLASS,
        "allocationMode": "ExactCount",
        "count": 2,
        "selectors": [{"cel": {"expression": e}} for e in selectors],
        "capacity": {"requests": {"memory": "4000Mi", "cores": "30"}},
    }
    assert requests["warmup"]["count"] == 1
    assert requests["warmup"]["capacity"] == {"requests": {"memory": "1000Mi", "cores": "0"}}
    # two distinct cards for main, on one NUMA node
    assert devices["constraints"] == [
        {"requests": ["main"], "distinctAttribute": f"{DRIVER}/uuid"},
        {"requests": ["main"], "matchAttribute": f"{DRIVER}/numa"},
    ]
    patched = applied(sent["request"]["object"], response)
    valid(patched)
    assert claimed(patched) == name
    spec = patched["spec"]
    (main, logger), (warmup,) = spec["containers"], spec["initContainers"]
    # the GPU resources stay, stated in full (they route the pod to the extender)
    assert main["resources"] == {
        "limits": {GPU: 2, MEM: 4000, CORES: 30},
        "claims": [{"name": "gpuslice", "request": "main"}],
    }
    assert warmup["resources"]["limits"] == {GPU: 1, MEM: 1000, CORES: "0"}
    assert warmup["resources"]["claims"] == [{"name": "gpuslice", "request": "warmup"}]
    assert "resources" not in logger
    # the rest as in device-plugin mode: identity and priority, others hidden, routed
    env = {e["name"]: e for e in main["env"]}
    assert env["GPUSLICE_CONTAINER_NAME"]["value"] == "main"
    assert env["CUDA_TASK_PRIORITY"]["value"] == "1"
    assert logger["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]
    assert spec["schedulerName"] == "gpuslice-scheduler"


def test_a_translated_pod_translates_to_nothing_more() -> None:
    """The mutation of a pod it changed is empty: the kept GPU resources and the
    claim it gave are recognised, not refused as a claim of the pod's own."""
    manifest = gpu_pod()
    mutator = Mutator(settings(dra=True))
    first = mutator.mutate(manifest, NS, dra=True)
    assert first is not None
    once = applied(manifest, {"patch": first.patch.encoded()})
    again = mutator.mutate(once, NS, dra=True)
    assert again is not None
    assert again.template == first.template
    assert not again.patch


def test_the_type_selectors_match_as_hami_does() -> None:
    """The CEL a type annotation becomes, read as CEL reads it (the model lowered,
    a substring of it), agrees with DeviceSelector.admits on the same cards."""

    def lower_ascii(value: Any) -> Any:
        return celpy.celtypes.StringType(str(value).lower())

    models = ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "Tesla V100-PCIE-32GB"]
    for include, exclude in [(("a100",), ()), (("NVIDIA",), ("h100",)), ((), ("V100", "A1"))]:
        selector = DeviceSelector(include_types=include, exclude_types=exclude)
        manifest = pod(
            container("main", {GPU: 1}),
            annotations={
                k: ",".join(v)
                for k, v in (
                    ("nvidia.com/use-gputype", include),
                    ("nvidia.com/nouse-gputype", exclude),
                )
                if v
            },
        )
        request = parse_pod(manifest)
        assert request is not None
        template = claim_template(request, NS, consumable=True, names=settings().requests.resources)
        (entry,) = template.devices["requests"]
        expressions = [s["cel"]["expression"] for s in entry["exactly"]["selectors"]]
        env = celpy.Environment()
        for model in models:
            device = GpuDevice(uuid="GPU-1", index=0, model=model, memory_mib=1000)
            # CEL with the strings extension's lowerAscii, as Kubernetes has it
            attrs = {DRIVER: {"model": model, "uuid": "GPU-1"}}
            activation = {"device": celpy.json_to_cel({"attributes": attrs})}
            results = []
            for expression in expressions:
                prog = env.program(env.compile(expression), functions={"lowerAscii": lower_ascii})
                results.append(bool(prog.evaluate(activation)))
            assert all(results) == selector.admits(device), (model, include, exclude)


async def test_a_dry_run_creates_nothing(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        sent = review(gpu_pod(), dry_run=True)
        response = await s.admit(sent)
        assert response["allowed"] is True
        assert await s.templates() == []
        assert s.counted("dry_run") == 1
        # the pod is patched as it would be: the template's name is its content's
        patched = applied(sent["request"]["object"], response)
        await s.admit(review(gpu_pod()))
        (template,) = await s.templates()
        assert claimed(patched) == template["metadata"]["name"]


async def test_pods_of_one_shape_share_a_template(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        first = await s.admit(review(gpu_pod("a")))
        second = await s.admit(review(gpu_pod("b")))
        assert first["allowed"]
        assert second["allowed"]
        (template,) = await s.templates()
        assert s.counted("created") == 1
        assert s.counted("existing") == 1
        a = applied(review(gpu_pod("a"))["request"]["object"], first)
        b = applied(review(gpu_pod("b"))["request"]["object"], second)
        assert claimed(a) == claimed(b) == template["metadata"]["name"]
        # another shape, another template; another namespace, its own
        other = pod(container("main", {GPU: 1, MEM: 2000}), name="c")
        assert (await s.admit(review(other)))["allowed"]
        assert (await s.admit(review(gpu_pod("d"), namespace="team-b")))["allowed"]
        assert len(await s.templates()) == 2
        assert len(await s.templates("team-b")) == 1


async def test_a_foreign_template_under_our_name_is_refused(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        sent = review(gpu_pod(), dry_run=True)
        name = claimed(applied(sent["request"]["object"], await s.admit(sent)))
        ref = TEMPLATES.in_namespace(NS)
        foreign = {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "gpuslice"}},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "main",
                                "exactly": {"deviceClassName": DEVICE_CLASS, "count": 8},
                            }
                        ]
                    }
                }
            },
        }
        await s.store.create_object(ref, foreign)
        response = await s.admit(review(gpu_pod()))
        assert response["allowed"] is False
        assert response["status"]["code"] == 403
        assert f"ResourceClaimTemplate {name!r}" in response["status"]["message"]
        assert s.counted("foreign") == 1
        # the same content without our label is not ours either
        await s.store.delete_object(ref.named(name))
        body = copy.deepcopy(foreign)
        del body["metadata"]["labels"]
        dry = review(gpu_pod(), dry_run=True)
        body["spec"] = (await _template_of(s, dry))["spec"]
        await s.store.create_object(ref, body)
        response = await s.admit(review(gpu_pod()))
        assert response["allowed"] is False
        assert "that gpuslice did not make" in response["status"]["message"]


async def _template_of(s: Stack, sent: dict[str, Any]) -> dict[str, Any]:
    """The template a pod would get, made in a namespace of its own and read back."""
    probe = copy.deepcopy(sent)
    probe["request"]["namespace"] = "probe"
    probe["request"]["dryRun"] = False
    assert (await s.admit(probe))["allowed"]
    (template,) = await s.templates("probe")
    return template


async def test_the_api_down_refuses_the_pod(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    async with stack(tmp_path, server=nowhere) as s:
        sent = review(gpu_pod())
        response = await s.admit(sent)
        assert response["allowed"] is False
        assert response["status"]["code"] == 503
        assert "cannot read namespace" in response["status"]["message"]


async def test_a_failed_create_refuses_the_pod(tmp_path: Path) -> None:
    """The namespace can be read but the template cannot be created (the API
    server refuses it): the pod is refused, not admitted half-translated."""

    class Refusing(LocalKubeApi):
        async def create_object(self, ref: ObjectRef, body: Any) -> dict[str, Any]:
            raise KubeError("resourceclaimtemplates is forbidden", 403)

    store = Refusing()
    api = DevApiServer(store)
    async with api.serving():
        kube = KubernetesApi.connect(api.url, token=api.token, timeout=3)
        config = settings(dra=True, listen_port=free_port())
        try:
            async with (
                running(config, kube, None) as webhook,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{webhook.port}") as http,
            ):
                sent = review(gpu_pod())
                answer = (await http.post("/mutate", json=sent)).json()
        finally:
            await kube.close()
    response = check_response(sent, answer)
    assert response["allowed"] is False
    assert response["status"]["code"] == 503
    message = response["status"]["message"]
    assert "cannot create ResourceClaimTemplate team-a/gpuslice-" in message
    assert "forbidden" in message
    assert "patch" not in response


async def test_without_the_kubernetes_api_dra_mode_refuses(tmp_path: Path) -> None:
    config = settings(dra=True, listen_port=free_port())
    async with (
        running(config, None, None) as webhook,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{webhook.port}") as http,
    ):
        sent = review(gpu_pod())
        response = check_response(sent, (await http.post("/mutate", json=sent)).json())
    assert response["allowed"] is False
    assert "DRA mode needs the Kubernetes API" in response["status"]["message"]


async def test_a_pod_with_its_own_gpuslice_claim_and_hami_resources_is_refused(
    tmp_path: Path,
) -> None:
    async with stack(tmp_path) as s:
        own = {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": "mine"},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "g", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 1}}
                    ]
                }
            },
        }
        await s.store.create_object(ObjectRef(API_VERSION, "resourceclaims", NS), own)
        nic = copy.deepcopy(own)
        nic["metadata"]["name"] = "nic"
        nic["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "nic.example.com"
        await s.store.create_object(ObjectRef(API_VERSION, "resourceclaims", NS), nic)

        mixed = gpu_pod()
        mixed["spec"]["resourceClaims"] = [{"name": "extra", "resourceClaimName": "mine"}]
        response = await s.admit(review(mixed))
        assert response["allowed"] is False
        assert "its own resource claim 'extra'" in response["status"]["message"]
        assert await s.templates() == []
        # a claim of another class beside the GPUs is kept
        other = gpu_pod()
        other["spec"]["resourceClaims"] = [{"name": "net", "resourceClaimName": "nic"}]
        sent = review(other)
        response = await s.admit(sent)
        assert response["allowed"] is True
        patched = applied(sent["request"]["object"], response)
        names = [c["name"] for c in patched["spec"]["resourceClaims"]]
        assert names == ["net", "gpuslice"]
        # a claim already named gpuslice
        taken = gpu_pod()
        taken["spec"]["resourceClaims"] = [{"name": "gpuslice", "resourceClaimName": "nic"}]
        response = await s.admit(review(taken))
        assert response["allowed"] is False
        assert "named 'gpuslice'" in response["status"]["message"]


async def test_pods_with_their_own_claims_only_are_left_alone(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        mine = pod(container("main", None, resources={"claims": [{"name": "g"}]}))
        mine["spec"]["resourceClaims"] = [{"name": "g", "resourceClaimTemplateName": "t"}]
        response = await s.admit(review(mine))
        assert response["allowed"] is True
        assert "patch" not in response
        assert await s.templates() == []


GIB = 1024**3
MIB = 1024**2
SLICES = ObjectRef(API_VERSION, "resourceslices")


def resource_slice(node: str, *sizes: int, driver: str = DRIVER) -> dict[str, Any]:
    """A node's slice as the agent publishes it: one device per card, memory in bytes."""
    devices = [
        {
            "name": f"gpu-{node}-{i}",
            "attributes": {"uuid": {"string": f"GPU-{node}-{i}"}},
            "capacity": {"memory": {"value": str(size)}, "cores": {"value": "100"}},
        }
        for i, size in enumerate(sizes)
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


async def publish(store: LocalKubeApi, *slices: dict[str, Any]) -> None:
    for obj in slices:
        await store.create_object(SLICES, obj)


async def test_a_share_of_a_card_s_memory_is_sized_per_card(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        # no node publishes gpuslice's devices yet: nothing to size it by
        response = await s.admit(review(pod(container("main", {GPU: 1, MEM_PCT: 50}))))
        assert response["allowed"] is False
        message = response["status"]["message"]
        assert "50% of a card's memory" in message
        assert f"give the memory in MiB with {MEM}" in message
    async with stack(tmp_path / "2", kube_cache_ttl=0.001) as s:
        await publish(
            s.store,
            resource_slice("gpu-1", 80 * GIB, 80 * GIB),
            resource_slice("gpu-2", 24 * GIB),
            resource_slice("gpu-3", 80 * GIB, 24 * GIB),
            resource_slice("other", 7 * GIB, driver="gpu.example.com"),
        )
        sent = review(pod(container("main", {GPU: 2, MEM_PCT: 25, CORES: 10})))
        response = await s.admit(sent)
        assert response["allowed"] is True
        (template,) = await s.templates()
        valid(template)
        patched = applied(sent["request"]["object"], response)
        valid(patched)
        assert patched["spec"]["containers"][0]["resources"]["claims"] == [
            {"name": "gpuslice", "request": "main"}
        ]
    devices = template["spec"]["spec"]["devices"]
    (entry,) = devices["requests"]
    assert set(entry) == {"name", "firstAvailable"}
    memory = f'device.capacity["{DRIVER}"].memory'
    assert entry["firstAvailable"] == [
        {
            "name": name,
            "deviceClassName": DEVICE_CLASS,
            "allocationMode": "ExactCount",
            "count": 2,
            "selectors": [{"cel": {"expression": f'{memory}.compareTo(quantity("{size}")) == 0'}}],
            "capacity": {"requests": {"memory": share, "cores": "10"}},
        }
        for name, size, share in (
            ("mem-24576mi", 24 * GIB, "6Gi"),
            ("mem-81920mi", 80 * GIB, "20Gi"),
        )
    ]
    # distinct cards whichever size is chosen
    assert devices["constraints"] == [{"requests": ["main"], "distinctAttribute": f"{DRIVER}/uuid"}]


def test_card_policies_dra_cannot_express_are_warned_of() -> None:
    manifest = pod(
        container("main", {GPU: 1, MEM: 1000}),
        annotations={"hami.io/gpu-scheduler-policy": "binpack"},
    )
    mutation = Mutator(settings(dra=True)).mutate(manifest, NS, dra=True)
    assert mutation is not None
    assert any("without scoring" in w for w in mutation.warnings)
    plain = Mutator(settings(dra=True)).mutate(pod(container("main", {GPU: 1})), NS, dra=True)
    assert plain is not None
    assert not any("without scoring" in w for w in plain.warnings)


def test_card_sizes_are_the_most_widespread_ones() -> None:
    """A node publishing many sizes of its own adds none: a size counts once two
    nodes publish it."""
    honest = [resource_slice(f"n{i}", 80 * GIB, 40 * GIB) for i in range(3)]
    liar = resource_slice("liar", *[(i + 1) * GIB + 1 for i in range(20)])
    odd = [resource_slice(f"m{i}", 48 * GIB) for i in range(2)]  # two nodes are enough
    broken = resource_slice("n8", 16 * GIB)
    broken["spec"]["devices"][0]["capacity"]["memory"]["value"] = "lots"
    found = card_sizes([liar, *honest, *odd, broken])
    assert found == CardSizes((40 * GIB, 48 * GIB, 80 * GIB), left_out=20)
    assert card_sizes([]) == CardSizes(())
    # one node publishing: its sizes are all there is
    assert card_sizes([honest[0]]) == CardSizes((40 * GIB, 80 * GIB))


def test_one_node_cannot_push_out_the_real_sizes_through_its_own_pool() -> None:
    legit = [resource_slice(n, 80 * GIB) for n in ("n1", "n2")]
    legit += [resource_slice(n, 40 * GIB) for n in ("n3", "n4")]
    evil = resource_slice("evil", *[(2 + i) * MIB for i in range(8)])  # passes the VAP
    found = card_sizes([*legit, evil])
    assert found == CardSizes((40 * GIB, 80 * GIB), left_out=8)
    # as many sizes as fit, each on two nodes: ties keep the larger
    many = [resource_slice(f"t{n}", (2 + i) * MIB) for i in range(8) for n in range(2)]
    found = card_sizes([*legit, *many])
    assert found.sizes == (4 * MIB, 5 * MIB, 6 * MIB, 7 * MIB, 8 * MIB, 9 * MIB, 40 * GIB, 80 * GIB)
    assert found.left_out == 2


def test_a_kubelet_credential_cannot_count_as_many_nodes() -> None:
    """system:node:evil may write slices of nodeName evil with any pool name
    (NodeRestriction checks nodeName only): a slice counts for the node it names,
    and only when its pool is named after that node, as gpuslice's agents publish."""
    legit = [resource_slice(f"n{i}", 80 * GIB) for i in range(5)]
    evil = []
    for p in range(10):
        fake = resource_slice("evil", *[(2 + i) * MIB for i in range(8)])
        fake["spec"]["pool"]["name"] = f"fake-{p}"
        evil.append(fake)
    bare = resource_slice("n9", 3 * MIB)
    del bare["spec"]["nodeName"]  # a slice for no node (or all of them)
    found = card_sizes([*legit, *evil, bare, bare])
    assert found == CardSizes((80 * GIB,))


def test_configured_card_sizes_are_the_list() -> None:
    published = [resource_slice(f"n{i}", 80 * GIB) for i in range(3)]
    assert card_sizes(published, (16384, 40960)) == CardSizes((16 * GIB, 40 * GIB))
    assert card_sizes([], (81920,)) == CardSizes((80 * GIB,))


def test_card_sizes_setting_reads_comma_separated_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_DRA_CARD_MEMORY_MIB", "81920, 40960")
    assert WebhookSettings().dra_card_memory_mib == (40960, 81920)
    for bad in ("80Gi", "0", ",".join(str(i) for i in range(1, 10))):
        monkeypatch.setenv("GPUSLICE_DRA_CARD_MEMORY_MIB", bad)
        with pytest.raises(ValidationError, match="dra_card_memory_mib"):
            WebhookSettings()


async def test_configured_card_sizes_need_no_slices(tmp_path: Path) -> None:
    async with stack(tmp_path, dra_card_memory_mib=(16384,)) as s:
        # a node publishing a size of its own changes nothing
        await publish(s.store, resource_slice("evil", 3 * MIB))
        sent = review(pod(container("main", {GPU: 1, MEM_PCT: 50})))
        response = await s.admit(sent)
        assert response["allowed"] is True
        (template,) = await s.templates()
    (entry,) = template["spec"]["spec"]["devices"]["requests"]
    assert [
        (sub["name"], sub["capacity"]["requests"]["memory"]) for sub in entry["firstAvailable"]
    ] == [("mem-16384mi", "8Gi")]


async def test_sizes_one_node_alone_publishes_do_not_size_a_share(tmp_path: Path) -> None:
    async with stack(tmp_path, kube_cache_ttl=0.001) as s:
        await publish(s.store, resource_slice("n1", 80 * GIB), resource_slice("n2", 40 * GIB))
        response = await s.admit(review(pod(container("main", {GPU: 1, MEM_PCT: 50}))))
        assert response["allowed"] is False
        message = response["status"]["message"]
        assert "no card size is published by 2 nodes (set GPUSLICE_DRA_CARD_MEMORY_MIB)" in message


async def test_without_consumable_capacity_cards_are_whole(tmp_path: Path) -> None:
    async with stack(tmp_path, dra_consumable=False) as s:
        response = await s.admit(review(pod(container("main", {GPU: 2, MEM_PCT: 50}))))
        assert response["allowed"] is True
        assert any("whole cards" in w for w in response["warnings"])
        (template,) = await s.templates()
    valid(template)
    devices = template["spec"]["spec"]["devices"]
    assert "constraints" not in devices  # a whole card is never given twice
    (entry,) = devices["requests"]
    assert "capacity" not in entry["exactly"]


# ---------------------------------------------------------------- quotas and modes


async def test_quotas_still_refuse_and_count_translated_pods(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        s.store.add_resource_quota(
            NS, {"metadata": {"name": "gpu"}, "spec": {"hard": {f"limits.{MEM}": "10000"}}}
        )
        too_big = pod(container("main", {GPU: 1, MEM: 12000}))
        response = await s.admit(review(too_big))
        assert response["allowed"] is False
        assert "exceeded quota: gpu" in response["status"]["message"]
        assert await s.templates() == []
        # a translated pod counts once, from the resources it keeps: 2 x 4000 MiB
        # (its template, asking the same, is not counted again)
        sent = review(pod(container("main", {GPU: 2, MEM: 4000}), name="first"))
        response = await s.admit(sent)
        assert response["allowed"] is True
        first = applied(sent["request"]["object"], response)
        first["metadata"]["namespace"] = NS
        first["metadata"]["uid"] = "uid-first"
        first["status"] = {"phase": "Running"}
        s.store.add_pod(first)
        response = await s.admit(review(pod(container("main", {GPU: 1, MEM: 3000}), name="x")))
        assert response["allowed"] is False
        assert f"used: limits.{MEM}=8000" in response["status"]["message"]
        assert (await s.admit(review(pod(container("main", {MEM: 2000}), name="y"))))["allowed"]


async def test_the_namespace_label_chooses_the_mode(tmp_path: Path) -> None:
    async with stack(tmp_path, dra=False) as s:
        s.store.add_namespace(NS, {MODE_LABEL: "dra"})
        s.store.add_namespace("team-b", {MODE_LABEL: "device-plugin"})
        s.store.add_namespace("team-c", {MODE_LABEL: "sometimes"})
        sent = review(gpu_pod())
        patched = applied(sent["request"]["object"], await s.admit(sent))
        assert claimed(patched)
        assert len(await s.templates()) == 1
        # device-plugin mode: the resources stay, stated in full
        sent = review(gpu_pod(), namespace="team-b")
        patched = applied(sent["request"]["object"], await s.admit(sent))
        assert "resourceClaims" not in patched["spec"]
        assert patched["spec"]["containers"][0]["resources"]["limits"][GPU] == 2
        response = await s.admit(review(gpu_pod(), namespace="team-c"))
        assert response["allowed"] is False
        assert f"{MODE_LABEL}='sometimes'" in response["status"]["message"]
    async with stack(tmp_path / "on", dra=True) as s:
        s.store.add_namespace("team-b", {MODE_LABEL: "device-plugin"})
        sent = review(gpu_pod(), namespace="team-b")
        patched = applied(sent["request"]["object"], await s.admit(sent))
        assert "resourceClaims" not in patched["spec"]
        assert await s.templates("team-b") == []


async def test_a_selector_value_cel_cannot_hold_is_refused(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        bad = gpu_pod(**{"nvidia.com/use-gputype": 'A100") || true || ("'})
        response = await s.admit(review(bad))
        assert response["allowed"] is False
        assert response["status"]["code"] == 400
        assert "use-gputype" in response["status"]["message"]
        assert await s.templates() == []


# ---------------------------------------------------------------- HAMi's cases


def _hami_cases() -> list[Case]:
    return [c for c in all_cases() if c.kind == "mutate" and "quota" not in c.data]


async def test_hami_s_admission_cases_translate(tmp_path: Path) -> None:
    """Every HAMi admission case: refused in DRA mode where device-plugin mode
    refuses it, else translated into a template whose requests say what
    parse_pod read (a share of a card's memory per card size: 16 and 40 GiB)."""
    checked = shared = 0
    for index, case in enumerate(_hami_cases()):
        options: dict[str, Any] = dict(case.data.get("webhook") or {})
        requests = request_settings(case.data.get("settings"))
        manifest = pod_manifest(case.data["pod"])
        try:
            Mutator(settings(requests=requests, **options)).mutate(
                copy.deepcopy(manifest), "default"
            )
            plugin_refusal = None
        except Denied as denied:
            plugin_refusal = denied.message
        try:
            request = parse_pod(manifest, requests)
        except RequestError:
            request = None
        async with stack(tmp_path / str(index), requests=requests, **options) as s:
            await publish(s.store, resource_slice("gpu-1", 16 * GIB, 40 * GIB))
            sent = review(manifest, namespace="default")
            response = await s.admit(sent)
            made = await s.templates("default")
        label = case.source
        if plugin_refusal is not None:
            assert response["allowed"] is False, label
            assert response["status"]["message"] == plugin_refusal, label
            continue
        if request is None:
            assert response["allowed"] is True, label
            assert made == [], label
            continue
        assert response["allowed"] is True, f"{label}: {response.get('status')}"
        (template,) = made
        valid(template)
        patched = applied(sent["request"]["object"], response)
        valid(patched)
        assert claimed(patched) == template["metadata"]["name"], label
        entries = {r["name"]: r for r in template["spec"]["spec"]["devices"]["requests"]}
        assert list(entries) == [c.name for c in request.containers], label
        for c in request.containers:
            entry = entries[c.name]
            if c.memory.percent not in (None, 100):  # a share: priced per card size
                subrequests = entry["firstAvailable"]
                shares = [sub["capacity"]["requests"]["memory"] for sub in subrequests]
                wanted_shares = [mib_quantity(c.memory.on_card(g * 1024)) for g in (16, 40)]
                assert shares == wanted_shares, label
                assert {sub["count"] for sub in subrequests} == {c.count}, label
                shared += 1
                continue
            exactly = entry["exactly"]
            assert exactly["count"] == c.count, label
            wanted = {"cores": str(c.cores)}
            if c.memory.mib is not None:
                wanted["memory"] = mib_quantity(c.memory.mib)
            assert exactly["capacity"] == {"requests": wanted}, label
        names = requests.resources
        specs = [*patched["spec"].get("initContainers", ()), *patched["spec"]["containers"]]
        for c in request.containers:  # each keeps its request, stated in full
            (spec,) = [s for s in specs if s["name"] == c.name]
            limits = spec["resources"]["limits"]
            assert str(limits[names.gpu]) == str(c.count), label
            assert str(limits[names.cores]) == str(c.cores), label
            assert {"name": "gpuslice", "request": c.name} in spec["resources"]["claims"], label
        checked += 1
    assert checked >= 5
    assert shared >= 2


def test_the_templates_are_what_kubernetes_1_34_accepts() -> None:
    """Shapes the schema would refuse are caught here too (a sanity check of
    the validator: a field of v1beta1's shape is refused)."""
    wrong = {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "x"},
        "spec": {"spec": {"devices": {"requests": [{"name": "a", "deviceClassName": "c"}]}}},
    }
    with pytest.raises(AssertionError):
        valid(wrong)


def test_memory_is_written_as_the_api_server_writes_it_back() -> None:
    assert [mib_quantity(m) for m in (1, 1000, 1024, 1536, 80 * 1024, 1024**2)] == [
        "1Mi",
        "1000Mi",
        "1Gi",
        "1536Mi",
        "80Gi",
        "1Ti",
    ]
    manifest = pod(container("main", {GPU: 1, MEM: 2048, CORES: 50}))
    request = parse_pod(manifest)
    assert request is not None
    names = settings().requests.resources
    template = claim_template(request, NS, consumable=True, names=names)
    (entry,) = template.devices["requests"]
    assert entry["exactly"]["capacity"] == {"requests": {"memory": "2Gi", "cores": "50"}}
    # read back in another spelling of the same amounts, with empty parts dropped:
    # still ours; another amount is not
    stored = copy.deepcopy(template.body)
    (back,) = stored["spec"]["spec"]["devices"]["requests"]
    back["exactly"]["capacity"]["requests"] = {"memory": "2048Mi", "cores": "50"}
    back["exactly"]["tolerations"] = []
    assert ours_and_equal(stored, template)
    back["exactly"]["capacity"]["requests"]["memory"] = "2049Mi"
    assert not ours_and_equal(stored, template)
