"""Reconciliation of placements prepared from DRA claims (real Redis, LocalKubeApi):
released when the pod or the claim no longer holds them, never restored from nor
released for a placement annotation, which such pods do not carry."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from gpuslice_common.dra import API_VERSION, DRIVER, device_name
from gpuslice_common.kube import KubeError, Listing, LocalKubeApi, ObjectRef
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import ClaimRef, GpuDevice, NodeInventory, Placement, PlacementState
from gpuslice_inventory.reconcile import (
    CLAIM_DEALLOCATED,
    CLAIM_DELETED,
    CLAIM_NOT_RESERVED,
    CLAIM_REPLACED,
    claim_ended,
)
from tests.conftest import make_inventory
from tests.inventory.test_reconcile import reconciler
from tests.test_ledger import placement

NODE = "gpu-1"
NS = "ns"
CLAIMS = ObjectRef(API_VERSION, "resourceclaims", NS)


def dra_pod(uid: str, phase: str = "Running") -> dict[str, Any]:
    """A pod using a claim: no placement annotation."""
    return {
        "metadata": {"name": uid, "namespace": NS, "uid": uid},
        "spec": {"nodeName": NODE, "containers": [{"name": "c0"}]},
        "status": {"phase": phase},
    }


async def claim_for(kube: LocalKubeApi, uid: str, *, reserved: bool = True) -> ClaimRef:
    name = f"{uid}-gpu"
    stored = await kube.create_object(CLAIMS, {"metadata": {"name": name}, "spec": {}})
    status: dict[str, Any] = {"allocation": {"devices": {"results": []}}}
    if reserved:
        status["reservedFor"] = [{"resource": "pods", "name": uid, "uid": uid}]
    await kube.replace_object(CLAIMS.named(name), {"status": status}, subresource="status")
    return ClaimRef(namespace=NS, name=name, uid=stored["metadata"]["uid"])


async def prepared(ledger: Ledger, uid: str, card: int, claim: ClaimRef) -> Placement:
    record = placement(uid, NODE, [[(card, 1000, 10)]]).model_copy(
        update={"claim": claim, "policy": "dra"}
    )
    return (await ledger.record_claim(record)).placement


async def test_prepared_claims_are_released_as_their_claims_end(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=2, dra=True), rebuilt=True)
    kube = LocalKubeApi()
    claims = {uid: await claim_for(kube, uid) for uid in ("kept", "deleted", "replaced", "freed")}
    claims["unreserved"] = await claim_for(kube, "unreserved", reserved=False)
    for uid, claim in claims.items():
        kube.add_pod(dra_pod(uid))
        await prepared(ledger, uid, 0, claim)
    await kube.delete_object(CLAIMS.named("deleted-gpu"))
    await kube.delete_object(CLAIMS.named("replaced-gpu"))
    await kube.create_object(CLAIMS, {"metadata": {"name": "replaced-gpu"}, "spec": {}})
    await kube.replace_object(
        CLAIMS.named("freed-gpu"), {"status": {"reservedFor": []}}, subresource="status"
    )
    result = await reconciler(ledger, kube).run_once()
    assert result.released_by == {
        CLAIM_DELETED: 1,
        CLAIM_REPLACED: 1,
        CLAIM_DEALLOCATED: 1,
        CLAIM_NOT_RESERVED: 1,
    }
    assert (result.restored, result.conflicts) == (0, 0)
    live = [p.pod.uid for p in await ledger.node_placements(NODE) if p.state != "released"]
    assert live == ["kept"]
    assert await ledger.check_node(NODE) == []
    again = await reconciler(ledger, kube).run_once()
    assert (again.released, again.restored) == (0, 0)


async def test_a_claim_pod_that_ended_is_released_and_none_is_restored(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=2, dra=True), rebuilt=True)
    kube = LocalKubeApi()
    done = await claim_for(kube, "done")
    kube.add_pod(dra_pod("done", "Succeeded"))
    await prepared(ledger, "done", 0, done)
    # a running pod with a claim the ledger does not hold: no annotation, nothing restored
    await claim_for(kube, "unheld")
    kube.add_pod(dra_pod("unheld"))
    result = await reconciler(ledger, kube).run_once()
    assert result.released_by == {"pod succeeded": 1}
    assert (result.restored, result.failed) == (0, 0)
    assert await ledger.placement("unheld") is None
    assert [(g.used.memory_mib, g.used.slots) for g in await ledger.node_gpus(NODE)] == [
        (0, 0),
        (0, 0),
    ]


class NoClaims(LocalKubeApi):
    """An API server that serves no resource.k8s.io (or refuses the list)."""

    async def list_objects(self, ref: ObjectRef, *, label_selector: str = "") -> Listing:
        raise KubeError("the server could not find the requested resource", 404)


async def test_claims_that_cannot_be_listed_are_judged_another_pass(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1, dra=True), rebuilt=True)
    kube = NoClaims()
    kube.add_pod(dra_pod("p"))
    ref = ClaimRef(namespace=NS, name="p-gpu", uid="c1")
    await prepared(ledger, "p", 0, ref)
    result = await reconciler(ledger, kube).run_once()
    assert result.released == 0
    held = await ledger.placement("p")
    assert held is not None
    assert held.state is PlacementState.ALLOCATED


def test_claim_ended_reads_what_the_api_server_sends() -> None:
    ref = ClaimRef(namespace=NS, name="c", uid="u1")
    ok = {
        "metadata": {"uid": "u1"},
        "status": {"allocation": {}, "reservedFor": [{"resource": "pods", "uid": "p"}]},
    }
    assert claim_ended(ref, "p", {(NS, "c"): ok}) == ""
    assert claim_ended(ref, "other-pod", {(NS, "c"): ok}) == CLAIM_NOT_RESERVED
    assert claim_ended(ref, "p", {}) == CLAIM_DELETED
    bad: Any
    for bad in ({"metadata": []}, {"metadata": {"uid": "u1"}, "status": "x"}, []):
        assert claim_ended(ref, "p", {(NS, "c"): bad}) != ""


async def test_a_claim_is_the_durable_record_after_redis_lost_everything(
    ledger: Ledger, redis_url: str
) -> None:
    uuids = [f"GPU-{i:08x}-5a1c-4e2b-9d0f-0123456789ab" for i in range(2)]
    inventory = NodeInventory(
        node=NODE,
        devices=tuple(
            GpuDevice(uuid=u, index=i, model="NVIDIA A100", memory_mib=16384)
            for i, u in enumerate(uuids)
        ),
        dra=True,
    )
    await ledger.register_node(inventory, rebuilt=True)
    kube = LocalKubeApi()
    ref = await claim_for(kube, "trainer")
    results = [
        {
            "request": "main",
            "driver": DRIVER,
            "pool": NODE,
            "device": device_name(uuids[1]),
            "consumedCapacity": {"memory": "2Gi", "cores": "20"},
        }
    ]
    await kube.replace_object(
        CLAIMS.named(ref.name),
        {
            "status": {
                "allocation": {"devices": {"results": results}},
                "reservedFor": [{"resource": "pods", "name": "trainer", "uid": "trainer"}],
            }
        },
        subresource="status",
    )
    pod = dra_pod("trainer", "Pending")  # kubelet may not have prepared it yet
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": ref.name}]
    pod["spec"]["containers"] = [{"name": "c0", "resources": {"claims": [{"name": "gpu"}]}}]
    kube.add_pod(pod)
    client: Redis = Redis.from_url(redis_url)
    await client.flushall()  # Redis lost its data
    await client.aclose()
    await ledger.register_node(inventory)  # the next heartbeat: not yet rebuilt
    result = await reconciler(ledger, kube).run_once()
    assert (result.restored, result.stamped, result.conflicts) == (1, 1, 0)
    restored = await ledger.placement("trainer")
    assert restored is not None
    assert (restored.claim, restored.state) == (ref, PlacementState.ALLOCATED)
    assert [(g.used.memory_mib, g.used.cores) for g in await ledger.node_gpus(NODE)] == [
        (0, 0),
        (2048, 20),
    ]
    # kubelet's prepare now finds it recorded: the same placement, counted once
    record = restored.model_copy(update={"state": PlacementState.RESERVED})
    again = await ledger.record_claim(record)
    assert not again.created
    assert again.placement.claim == ref
    assert await ledger.check_node(NODE) == []
    second = await reconciler(ledger, kube).run_once()
    assert (second.restored, second.released) == (0, 0)
