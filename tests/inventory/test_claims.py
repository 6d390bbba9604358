"""The inventory's check of a DRA claim (gpuslice_inventory.claims): a ResourceClaim and
its pod as the API server sends them, against the node of the request and its cards."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from gpuslice_common.dra import DRIVER, device_name
from gpuslice_common.models import (
    ClaimRef,
    GpuCapacity,
    GpuDevice,
    GpuState,
    GpuUsage,
    MigPlacement,
    MigProfile,
    PodRef,
    VgpuMode,
)
from gpuslice_inventory.claims import ClaimRefused, NotOnNode, claim_placement, not_on_node

NODE = "node-a"
UUIDS = [f"GPU-{i:08x}-5a1c-4e2b-9d0f-0123456789ab" for i in range(3)]
DEV = [device_name(u) for u in UUIDS]
MIG_NAME = "mig-" + DEV[0].removeprefix("gpu-")  # the name a MIG instance of that UUID has
REF = ClaimRef(namespace="team", name="trainer-gpu-x1", uid="claim-1")
POD_UID = "pod-1"

Json = dict[str, Any]


def cards(memory_mib: int = 16384) -> list[GpuState]:
    return [
        GpuState(
            node=NODE,
            device=GpuDevice(uuid=u, index=i, model="NVIDIA A100", memory_mib=memory_mib),
            capacity=GpuCapacity(memory_mib=memory_mib, cores=100, slots=10),
            used=GpuUsage(),
        )
        for i, u in enumerate(UUIDS)
    ]


def result(
    device: str = DEV[0], request: str = "main", capacity: Json | None = None, **extra: Any
) -> Json:
    r: Json = {"request": request, "driver": DRIVER, "pool": NODE, "device": device, **extra}
    if capacity is not None:
        r["consumedCapacity"] = capacity
    return r


def claim(*results: Json) -> Json:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "team", "name": REF.name, "uid": REF.uid},
        "spec": {"devices": {"requests": [{"name": "main"}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": list(results) or [result(capacity={"memory": "4Gi", "cores": "30"})]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [NODE]}
                            ]
                        }
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": "trainer", "uid": POD_UID}],
        },
    }


def container(name: str, *uses: Json, **extra: Any) -> Json:
    return {"name": name, "image": "x", "resources": {"claims": list(uses)}, **extra}


def pod(*containers: Json, init: tuple[Json, ...] = ()) -> Json:
    spec: Json = {
        "nodeName": NODE,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "trainer-gpu"}],
        "containers": list(containers) or [container("main", {"name": "gpu", "request": "main"})],
    }
    if init:
        spec["initContainers"] = list(init)
    return {
        "metadata": {"namespace": "team", "name": "trainer", "uid": POD_UID},
        "spec": spec,
        "status": {
            "phase": "Pending",
            "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": REF.name}],
        },
    }


def prepare(c: Json, p: Json, node: str = NODE, **kw: Any) -> Any:
    return claim_placement(c, p, node, kw.pop("gpus", cards()), kw.pop("named", REF), **kw)


def test_a_share_of_one_card_goes_to_the_container_naming_its_request() -> None:
    prepared = prepare(claim(), pod())
    placement = prepared.placement
    assert placement.pod == PodRef(uid=POD_UID, namespace="team", name="trainer")
    assert (placement.node, placement.policy, placement.claim) == (NODE, "dra", REF)
    [main] = placement.containers
    assert main.name == "main"
    assert not main.init
    [grant] = main.devices
    assert (grant.uuid, grant.memory_mib, grant.cores) == (UUIDS[0], 4096, 30)
    [device] = prepared.devices
    assert (device.request, device.pool, device.device, device.uuid, device.container) == (
        "main",
        NODE,
        DEV[0],
        UUIDS[0],
        "main",
    )


def test_no_consumed_capacity_is_the_whole_card() -> None:
    prepared = prepare(claim(result()), pod())
    [grant] = prepared.placement.containers[0].devices
    assert (grant.memory_mib, grant.cores) == (16384, 100)


def test_memory_rounds_up_to_whole_mib_and_cores_default_to_the_whole_card() -> None:
    c = claim(result(capacity={"memory": "1048577"}))  # 1 MiB and a byte
    [grant] = prepare(c, pod()).placement.containers[0].devices
    assert (grant.memory_mib, grant.cores) == (2, 100)
    c = claim(result(capacity={"cores": "0"}))
    [grant] = prepare(c, pod()).placement.containers[0].devices
    assert (grant.memory_mib, grant.cores) == (16384, 0)


def test_devices_go_to_containers_by_request_init_and_sidecar_included() -> None:
    c = claim(
        result(DEV[0], "main", {"memory": "1Gi", "cores": "10"}),
        result(DEV[1], "side/small", {"memory": "2Gi", "cores": "20"}),  # firstAvailable
        result(DEV[2], "setup", {"memory": "3Gi", "cores": "30"}),
        {"request": "net", "driver": "net.example.com", "pool": "x", "device": "eth0"},
    )
    p = pod(
        container("main", {"name": "gpu", "request": "main"}),
        container("plain"),
        init=(
            container("setup", {"name": "gpu", "request": "setup"}),
            container("side", {"name": "gpu", "request": "side"}, restartPolicy="Always"),
        ),
    )
    prepared = prepare(c, p)
    got = {
        a.name: (a.init, a.sidecar, [(g.uuid, g.memory_mib, g.cores) for g in a.devices])
        for a in prepared.placement.containers
    }
    assert got == {
        "setup": (True, False, [(UUIDS[2], 3072, 30)]),
        "side": (True, True, [(UUIDS[1], 2048, 20)]),
        "main": (False, False, [(UUIDS[0], 1024, 10)]),
    }
    # init containers first, in the pod's order: the ledger's footprint reads phases so
    assert [a.name for a in prepared.placement.containers] == ["setup", "side", "main"]
    assert [(d.request, d.container) for d in prepared.devices] == [
        ("main", "main"),
        ("side/small", "side"),
        ("setup", "setup"),
    ]


def test_a_container_naming_no_request_gets_every_device_of_the_claim() -> None:
    c = claim(result(DEV[0], "a"), result(DEV[1], "b", {"memory": "1Gi"}))
    p = pod(container("main", {"name": "gpu"}))
    [main] = prepare(c, p).placement.containers
    assert [g.uuid for g in main.devices] == UUIDS[:2]


def test_a_container_may_name_the_subrequest_kube_scheduler_chose() -> None:
    """resources.claims[].request may name a firstAvailable subrequest
    ("main/large") as well as its request ("main")."""
    c = claim(result(DEV[0], "main/mem-16384mi", {"memory": "16Gi", "cores": "10"}))
    for request in ("main/mem-16384mi", "main"):
        p = pod(container("main", {"name": "gpu", "request": request}))
        [main] = prepare(c, p).placement.containers
        assert [(g.uuid, g.memory_mib) for g in main.devices] == [(UUIDS[0], 16384)]
    p = pod(container("main", {"name": "gpu", "request": "main/mem-8192mi"}))
    with pytest.raises(ClaimRefused, match="uses request 'main/mem-8192mi' of claim"):
        prepare(c, p)


def test_a_claim_named_directly_by_the_pod_resolves_without_a_status() -> None:
    p = pod()
    p["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": REF.name}]
    del p["status"]["resourceClaimStatuses"]
    assert prepare(claim(), p).placement.containers[0].name == "main"


def test_another_driver_s_claim_of_the_pod_is_no_concern() -> None:
    other = {
        "metadata": {"name": "net", "uid": "n1"},
        "status": {"allocation": {"devices": {"results": [{"driver": "net.example.com"}]}}},
    }
    assert prepare(claim(), pod(), other_claims=[other]).placement.claim == REF


Mutation = Callable[[Json, Json], None]


def _set(path: str, value: Any) -> Mutation:
    """Set (or, with ``...``, delete) ``claim.`` / ``pod.`` path; numbers index lists."""

    def mutate(c: Json, p: Json) -> None:
        target: Any = c if path.startswith("claim.") else p
        parts = path.split(".")[1:]
        for part in parts[:-1]:
            target = target[int(part)] if part.isdigit() else target[part]
        last: Any = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
        if value is ...:
            del target[last]
        elif isinstance(target, list) and last == len(target):
            target.append(value)
        else:
            target[last] = value

    return mutate


RESULT = "claim.status.allocation.devices.results.0"
CONSUMED = RESULT + ".consumedCapacity"
SELECTOR = "claim.status.allocation.nodeSelector"
RESERVED = "claim.status.reservedFor"

BAD: list[tuple[str, Mutation, str]] = [
    ("replaced", _set("claim.metadata.uid", "claim-2"), "was replaced: its uid is 'claim-2'"),
    ("no uid", _set("claim.metadata.uid", ...), "was replaced"),
    ("not allocated", _set("claim.status.allocation", ...), "is not allocated"),
    ("no status", _set("claim.status", ...), "status is missing"),
    ("allocation a list", _set("claim.status.allocation", []), "status.allocation is a list"),
    ("results not a list", _set("claim.status.allocation.devices.results", {}), "not a list"),
    ("no results", _set("claim.status.allocation.devices.results", []), "allocates no device"),
    ("only others", _set(RESULT + ".driver", "other.example.com"), "allocates no device"),
    ("other pool", _set(RESULT + ".pool", "node-b"), "is in pool 'node-b', not node-a"),
    ("unknown device", _set(RESULT + ".device", "gpu-elsewhere"), "is not a card of node"),
    (
        "mig name",
        _set(RESULT + ".device", MIG_NAME),
        "is a MIG instance",
    ),
    ("device not str", _set(RESULT + ".device", 7), ".device is 7, not a name"),
    ("request empty", _set(RESULT + ".request", ""), ".request is '', not a name"),
    ("admin access", _set(RESULT + ".adminAccess", True), "admin access"),
    ("memory zero", _set(CONSUMED + ".memory", "0"), "memory is '0': not above 0"),
    ("memory negative", _set(CONSUMED + ".memory", "-1Gi"), "memory is '-1Gi': not above 0"),
    ("memory fraction", _set(CONSUMED + ".memory", "0.5"), "not a whole number of bytes"),
    ("memory milli", _set(CONSUMED + ".memory", "1500m"), "not a whole number of bytes"),
    ("memory too big", _set(CONSUMED + ".memory", "17Gi"), "more than card"),
    ("memory huge", _set(CONSUMED + ".memory", "1e400"), "consumedCapacity.memory:"),
    ("memory garbage", _set(CONSUMED + ".memory", "4 GiB"), "consumedCapacity.memory:"),
    ("memory number", _set(CONSUMED + ".memory", 4096), "memory is a number, not a quantity"),
    ("memory null", _set(CONSUMED + ".memory", None), "memory is null, not a quantity"),
    ("cores 101", _set(CONSUMED + ".cores", "101"), "cores is '101': not a whole percent"),
    ("cores negative", _set(CONSUMED + ".cores", "-1"), "cores is '-1': not a whole percent"),
    ("cores fraction", _set(CONSUMED + ".cores", "500m"), "cores is '500m': not a whole"),
    ("cores bool", _set(CONSUMED + ".cores", True), "cores is a boolean, not a quantity"),
    ("consumed list", _set(CONSUMED, ["memory"]), "consumedCapacity is a list, not an object"),
    (
        "selector other node",
        _set(SELECTOR + ".nodeSelectorTerms.0.matchFields.0.values", ["node-b"]),
        "selects node(s) ['node-b'], not node node-a",
    ),
    (
        "selector two nodes",
        _set(SELECTOR + ".nodeSelectorTerms.0.matchFields.0.values", [NODE, "node-b"]),
        "not node node-a",
    ),
    (
        "selector by label",
        _set(SELECTOR + ".nodeSelectorTerms.0", {"matchExpressions": [{"key": "a"}]}),
        "does not select node node-a by name",
    ),
    ("selector no terms", _set(SELECTOR + ".nodeSelectorTerms", []), "has no terms"),
    ("no consumer", _set(RESERVED, []), "names 0 consumers, not exactly one pod"),
    (
        "two consumers",
        _set(RESERVED + ".1", {"resource": "pods", "name": "b", "uid": "u2"}),
        "not exactly one pod",
    ),
    ("not a pod", _set(RESERVED + ".0.resource", "jobs"), "not a pod"),
    ("api group", _set(RESERVED + ".0.apiGroup", "batch"), "not a pod"),
    ("other pod uid", _set("pod.metadata.uid", "pod-2"), "but that pod's uid is 'pod-2'"),
    ("other pod name", _set("pod.metadata.name", "imposter"), "not 'team'/'imposter'"),
    ("pod elsewhere", _set("pod.spec.nodeName", "node-b"), "is bound to 'node-b', not node"),
    ("pod unbound", _set("pod.spec.nodeName", ...), "is bound to None"),
    ("pod ended", _set("pod.status.phase", "Succeeded"), "has ended (Succeeded)"),
    ("pod failed", _set("pod.status.phase", "Failed"), "has ended (Failed)"),
    (
        "pod without the claim",
        _set("pod.status.resourceClaimStatuses.0.resourceClaimName", "other"),
        "has no spec.resourceClaims entry for claim",
    ),
    (
        "no container uses it",
        _set("pod.spec.containers.0.resources.claims", []),
        "is used by no container of pod team/trainer",
    ),
    (
        "unknown request",
        _set("pod.spec.containers.0.resources.claims.0.request", "nope"),
        "uses request 'nope' of claim",
    ),
    ("containers not a list", _set("pod.spec.containers", {}), "spec.containers is an object"),
]


# Until the claim is shown to be the node's (the uid named, allocated in its pool and
# selector, reserved for one pod bound to it), the node is answered one message that
# repeats what it sent; what was wrong is for the inventory's log only.
NOT_ON_NODE = {
    "replaced",
    "no uid",
    "not allocated",
    "no status",
    "allocation a list",
    "results not a list",
    "no results",
    "only others",
    "other pool",
    "selector other node",
    "selector two nodes",
    "selector by label",
    "selector no terms",
    "no consumer",
    "two consumers",
    "not a pod",
    "api group",
    "other pod uid",
    "other pod name",
    "pod elsewhere",
    "pod unbound",
}
GENERIC = f"claim team/{REF.name} ({REF.uid}) is not allocated on node {NODE}"


@pytest.mark.parametrize(("what", "mutate", "reason"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_claim_is_refused_naming_what_is_wrong(
    what: str, mutate: Mutation, reason: str
) -> None:
    c, p = claim(), pod()
    mutate(c, p)
    with pytest.raises(ClaimRefused) as refused:
        prepare(c, p)
    assert reason in refused.value.detail, refused.value.detail
    if what in NOT_ON_NODE:
        assert isinstance(refused.value, NotOnNode)
        assert refused.value.reason == GENERIC == not_on_node(REF, NODE)
    else:
        assert not isinstance(refused.value, NotOnNode)
        assert reason in refused.value.reason, refused.value.reason


def test_what_is_not_the_node_s_is_answered_without_the_server_s_values() -> None:
    """A node guessing another node's claim learns nothing: not its uid, pool, pod,
    where the pod is bound; only what it sent comes back."""
    c = claim()
    c["metadata"]["uid"] = "real-uid-of-someone-else"
    c["status"]["allocation"]["devices"]["results"][0]["pool"] = "node-secret"
    guess = ClaimRef(namespace="team", name=REF.name, uid="guess")
    p = pod()
    p["spec"]["nodeName"] = "node-secret"
    for named, node in [(guess, NODE), (REF, NODE), (REF, "node-b")]:
        with pytest.raises(NotOnNode) as refused:
            prepare(c, p, named=named, node=node)
        answer = refused.value.reason
        assert answer == f"claim {named} is not allocated on node {node}"
        for secret in ("real-uid", "node-secret", POD_UID, "'trainer'"):
            assert secret not in answer


def test_a_device_two_containers_use_is_refused() -> None:
    p = pod(
        container("a", {"name": "gpu", "request": "main"}),
        container("b", {"name": "gpu"}),
    )
    with pytest.raises(ClaimRefused, match="is used by containers a and b"):
        prepare(claim(), p)


def test_a_device_no_container_uses_is_refused() -> None:
    c = claim(result(DEV[0], "main"), result(DEV[1], "spare"))
    with pytest.raises(ClaimRefused, match=rf"device {DEV[1]} \(request spare\).*no container"):
        prepare(c, pod())


def test_one_container_with_two_shares_of_one_card_is_refused() -> None:
    c = claim(result(DEV[0], "main", {"memory": "1Gi"}), result(DEV[0], "main", {"memory": "1Gi"}))
    with pytest.raises(ClaimRefused, match=f"would get card {UUIDS[0]} twice"):
        prepare(c, pod())


def test_two_containers_may_each_take_a_share_of_one_card() -> None:
    c = claim(result(DEV[0], "a", {"memory": "1Gi"}), result(DEV[0], "b", {"memory": "2Gi"}))
    p = pod(
        container("a", {"name": "gpu", "request": "a"}),
        container("b", {"name": "gpu", "request": "b"}),
    )
    got = [(a.name, a.devices[0].memory_mib) for a in prepare(c, p).placement.containers]
    assert got == [("a", 1024), ("b", 2048)]


def test_a_second_gpuslice_claim_of_the_pod_is_refused() -> None:
    other = {
        "metadata": {"name": "more-gpu", "uid": "claim-9"},
        "status": {"allocation": {"devices": {"results": [result(DEV[1])]}}},
    }
    with pytest.raises(ClaimRefused, match="gpuslice prepares one ResourceClaim per pod"):
        prepare(claim(), pod(), other_claims=[other])


def test_the_node_is_the_request_s_whatever_the_claim_says() -> None:
    # the claim's pool, selector and pod are node-a's: a request on node-b is refused
    gpus = [g.model_copy(update={"node": "node-b"}) for g in cards()]
    generic = f"claim {REF} is not allocated on node node-b"
    with pytest.raises(NotOnNode) as refused:
        prepare(claim(), pod(), node="node-b", gpus=gpus)
    assert refused.value.reason == generic
    assert "selects node(s) ['node-a'], not node node-b" in refused.value.detail
    c = claim()
    del c["status"]["allocation"]["nodeSelector"]  # a selector is optional: the pool decides
    with pytest.raises(NotOnNode) as refused:
        prepare(c, pod(), node="node-b", gpus=gpus)
    assert refused.value.reason == generic
    assert "is in pool 'node-a', not node-b" in refused.value.detail
    c["status"]["allocation"]["devices"]["results"][0]["pool"] = "node-b"
    p = pod()
    with pytest.raises(NotOnNode) as refused:
        prepare(c, p, node="node-b", gpus=gpus)
    assert refused.value.reason == generic
    assert "is bound to 'node-a', not node node-b" in refused.value.detail


def test_the_named_claim_must_be_the_one_sent() -> None:
    other = ClaimRef(namespace="team", name="someone-else", uid=REF.uid)
    with pytest.raises(NotOnNode) as refused:
        prepare(claim(), pod(), named=other)
    assert refused.value.reason == f"claim {other} is not allocated on node {NODE}"
    assert "the API server sent 'team'/'trainer-gpu-x1'" in refused.value.detail


def test_cards_that_are_gone_or_shared_by_mig_are_refused() -> None:
    gone = cards()
    gone[0] = gone[0].model_copy(update={"present": False})
    with pytest.raises(ClaimRefused, match="no longer present"):
        prepare(claim(), pod(), gpus=gone)
    mig = cards()
    profile = MigProfile(
        name="1g.10gb",
        memory_mib=9984,
        cores=14,
        slices=1,
        placements=(MigPlacement(start=0, size=1),),
    )
    device = mig[0].device.model_copy(
        update={"mig": True, "mode": VgpuMode.MIG, "mig_profiles": (profile,)}
    )
    mig[0] = mig[0].model_copy(update={"device": device})
    with pytest.raises(ClaimRefused, match="shared through MIG"):
        prepare(claim(), pod(), gpus=mig)


def test_whole_card_is_the_ledger_s_schedulable_memory() -> None:
    gpus = [
        g.model_copy(update={"capacity": GpuCapacity(memory_mib=8000, cores=100, slots=10)})
        for g in cards()
    ]
    [grant] = prepare(claim(result()), pod(), gpus=gpus).placement.containers[0].devices
    assert grant.memory_mib == 8000
    with pytest.raises(ClaimRefused, match="more than card"):
        prepare(claim(result(capacity={"memory": "8001Mi"})), pod(), gpus=gpus)


def test_not_objects_at_all_are_refused_without_a_traceback() -> None:
    for c, p in [([], pod()), (claim(), []), ({"metadata": []}, pod())]:
        with pytest.raises(ClaimRefused):
            prepare(c, p)  # type: ignore[arg-type]


def test_too_many_devices_are_refused() -> None:
    c = claim(*[result(DEV[0], f"r{i}", {"memory": "1Mi"}) for i in range(65)])
    with pytest.raises(ClaimRefused, match="more than 64"):
        prepare(c, pod())


def test_inputs_are_left_as_they_were() -> None:
    c, p = claim(), pod()
    before = copy.deepcopy((c, p))
    prepare(c, p)
    assert (c, p) == before
