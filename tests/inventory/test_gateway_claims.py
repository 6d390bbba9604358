"""DRA claims prepared and unprepared through the inventory's node gateway: real NATS and
Redis, the API server's objects in LocalKubeApi. Requests are sent as a node agent
sends them, on ``<prefix>.node.<node>.prepare|unprepare``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpuslice_common.bus import Bus
from gpuslice_common.dra import API_VERSION, DRIVER, device_name
from gpuslice_common.events import AllocationEvent, CloudEvent, EventType
from gpuslice_common.kube import KubeError, LocalKubeApi, ObjectRef
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    ClaimRef,
    ContainerAssignment,
    DeviceGrant,
    GpuDevice,
    NodeInventory,
    Placement,
    PlacementState,
    PodRef,
)
from gpuslice_common.nodeapi import (
    AllocationReply,
    ClaimReply,
    Done,
    ErrorKind,
    ErrorReply,
)
from gpuslice_common.servers import NatsServer
from gpuslice_inventory.gateway import NO_KUBE, Budgets
from gpuslice_inventory.service import Running, running
from tests.inventory.conftest import settings_for, until
from tests.inventory.test_gateway import ask

A, B, PLUGIN = "node-a", "node-b", "node-c"
NS = "team"
CLAIMS = ObjectRef(API_VERSION, "resourceclaims", NS)


def uuid_of(node: str, i: int) -> str:
    n = [A, B, PLUGIN].index(node)
    return f"GPU-{n:02x}{i:06x}-5a1c-4e2b-9d0f-0123456789ab"


def inventory_of(node: str, dra: bool = True) -> NodeInventory:
    devices = tuple(
        GpuDevice(uuid=uuid_of(node, i), index=i, model="NVIDIA A100", memory_mib=16384)
        for i in range(2)
    )
    return NodeInventory(node=node, devices=devices, dra=dra)


class FlakyKube(LocalKubeApi):
    """The API server as it is, until ``down``: then every read fails as an
    unreachable one does. With a ``gate``, each read waits for it (``waiting``
    counts those that do)."""

    down = False
    gate: asyncio.Event | None = None
    waiting = 0

    async def get_object(self, ref: ObjectRef) -> dict[str, Any]:
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
        if self.down:
            raise KubeError("connection refused")
        return await super().get_object(ref)


@pytest.fixture
def kube() -> FlakyKube:
    return FlakyKube()


@pytest.fixture
async def ledger_of_prefix(redis_url: str, prefix: str) -> AsyncIterator[Ledger]:
    led = Ledger.from_url(redis_url, prefix)
    for node in (A, B):
        await led.register_node(inventory_of(node), rebuilt=True)
    await led.register_node(inventory_of(PLUGIN, dra=False), rebuilt=True)
    yield led
    await led.close()


@pytest.fixture
async def inventory(
    nats_server: NatsServer, redis_url: str, prefix: str, bus: Bus, kube: FlakyKube
) -> AsyncIterator[Running]:
    settings = settings_for(nats_server, redis_url, prefix)
    issued: list[tuple[str, str]] = []

    def issue(node: str, pod_uid: str) -> str:
        issued.append((node, pod_uid))
        return f"token-{node}-{pod_uid}"

    async with running(
        settings, bus, kube=kube, serve_http=False, issue_telemetry_token=issue
    ) as state:
        state.issued = issued  # type: ignore[attr-defined]
        await bus.flush()
        yield state


async def make_claim(
    kube: LocalKubeApi,
    pod: str,
    node: str,
    results: list[dict[str, Any]],
    *,
    reserve: bool = True,
) -> ClaimRef:
    """A ResourceClaim allocated as kube-scheduler does, and its pod bound to ``node``."""
    name = f"{pod}-gpu"
    stored = await kube.create_object(
        CLAIMS, {"metadata": {"name": name}, "spec": {"devices": {"requests": [{"name": "main"}]}}}
    )
    pod_uid = f"uid-{pod}"
    status: dict[str, Any] = {"allocation": {"devices": {"results": results}}}
    if reserve:
        status["reservedFor"] = [{"resource": "pods", "name": pod, "uid": pod_uid}]
    await kube.replace_object(CLAIMS.named(name), {"status": status}, subresource="status")
    kube.add_pod(
        {
            "metadata": {"namespace": NS, "name": pod, "uid": pod_uid},
            "spec": {
                "nodeName": node,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [
                    {"name": "main", "resources": {"claims": [{"name": "gpu"}]}},
                ],
            },
            "status": {"phase": "Pending"},
        }
    )
    return ClaimRef(namespace=NS, name=name, uid=stored["metadata"]["uid"])


def result(node: str, card: int, memory: str = "4Gi", cores: str = "25") -> dict[str, Any]:
    return {
        "request": "main",
        "driver": DRIVER,
        "pool": node,
        "device": device_name(uuid_of(node, card)),
        "consumedCapacity": {"memory": memory, "cores": cores},
    }


def prepare(ref: ClaimRef) -> dict[str, Any]:
    return {"claim": ref.model_dump()}


async def usage(ledger: Ledger, node: str) -> list[tuple[int, int, int]]:
    return [(g.used.memory_mib, g.used.cores, g.used.slots) for g in await ledger.node_gpus(node)]


async def test_a_claim_is_prepared_recorded_and_announced_with_its_claim(
    inventory: Running,
    kube: FlakyKube,
    ledger_of_prefix: Ledger,
    bus: Bus,
    events: list[CloudEvent],
) -> None:
    ref = await make_claim(kube, "trainer", A, [result(A, 1)])
    reply = await ask(bus, A, "prepare", prepare(ref))
    assert isinstance(reply, ClaimReply), reply
    assert reply.claim == ref
    assert reply.telemetry_token == "token-node-a-uid-trainer"
    [device] = reply.devices
    assert (device.device, device.uuid, device.container, device.pool) == (
        device_name(uuid_of(A, 1)),
        uuid_of(A, 1),
        "main",
        A,
    )
    placement = reply.placement
    assert placement.pod == PodRef(uid="uid-trainer", namespace=NS, name="trainer")
    assert (placement.claim, placement.state, placement.policy) == (
        ref,
        PlacementState.ALLOCATED,
        "dra",
    )
    assert await usage(ledger_of_prefix, A) == [(0, 0, 0), (4096, 25, 1)]
    await until(lambda: any(e.type == EventType.ALLOC_ALLOCATED for e in events))
    [event] = [e for e in events if e.type == EventType.ALLOC_ALLOCATED]
    payload = event.payload()
    assert isinstance(payload, AllocationEvent)
    assert payload.claim == ref
    assert payload.pod is not None
    assert (payload.pod.uid, payload.node) == ("uid-trainer", A)
    assert [c.name for c in payload.containers] == ["main"]

    # the same claim again: the same answer, counted once
    again = await ask(bus, A, "prepare", prepare(ref))
    assert isinstance(again, ClaimReply)
    assert again.placement == placement
    assert again.devices == reply.devices
    assert await usage(ledger_of_prefix, A) == [(0, 0, 0), (4096, 25, 1)]

    # unprepare naming another claim of the pod's: nothing released
    other = ref.model_copy(update={"uid": "someone-else"})
    done = await ask(bus, A, "unprepare", {"claim": other.model_dump(), "pod_uid": "uid-trainer"})
    assert isinstance(done, Done)
    assert await usage(ledger_of_prefix, A) == [(0, 0, 0), (4096, 25, 1)]
    # another node cannot unprepare it
    done = await ask(bus, B, "unprepare", {"claim": ref.model_dump(), "pod_uid": "uid-trainer"})
    assert isinstance(done, Done)
    held = await ledger_of_prefix.placement("uid-trainer")
    assert held is not None
    assert held.state is PlacementState.ALLOCATED
    # its own node can, once or many times
    for _ in range(2):
        done = await ask(bus, A, "unprepare", {"claim": ref.model_dump(), "pod_uid": "uid-trainer"})
        assert isinstance(done, Done)
    assert await usage(ledger_of_prefix, A) == [(0, 0, 0), (0, 0, 0)]
    await until(lambda: any(e.type == EventType.ALLOC_RELEASED for e in events))
    [released] = [e.payload() for e in events if e.type == EventType.ALLOC_RELEASED]
    assert isinstance(released, AllocationEvent)
    assert (released.claim, released.reason) == (ref, "claim unprepared")


async def test_unprepare_without_the_pod_finds_the_claim_on_the_node(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    ref = await make_claim(kube, "trainer", A, [result(A, 0)])
    assert isinstance(await ask(bus, A, "prepare", prepare(ref)), ClaimReply)
    assert isinstance(await ask(bus, B, "unprepare", {"claim": ref.model_dump()}), Done)
    assert await usage(ledger_of_prefix, A) == [(4096, 25, 1), (0, 0, 0)]
    assert isinstance(await ask(bus, A, "unprepare", {"claim": ref.model_dump()}), Done)
    assert await usage(ledger_of_prefix, A) == [(0, 0, 0), (0, 0, 0)]


async def test_a_node_cannot_prepare_another_node_s_claim(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    ref = await make_claim(kube, "trainer", A, [result(A, 0)])
    reply = await ask(bus, B, "prepare", prepare(ref))
    assert isinstance(reply, ErrorReply)
    assert (reply.error, reply.message) == (
        ErrorKind.BAD_CLAIM,
        f"claim {ref} is not allocated on node {B}",
    )
    assert await ledger_of_prefix.placement("uid-trainer") is None
    assert await usage(ledger_of_prefix, B) == [(0, 0, 0), (0, 0, 0)]


async def test_a_node_learns_nothing_of_other_nodes_claims(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    """Guessing names and uids: every answer about a claim that is not the node's is
    the same one, repeating what the node sent; not the claim's uid, pool, pod, nor
    where the pod is bound, nor whether the claim exists."""
    ref = await make_claim(kube, "secret-trainer", A, [result(A, 1)])
    unbound = await make_claim(kube, "elsewhere", A, [result(B, 1)])  # pod bound to A
    asked = [
        ref.model_copy(update={"uid": "guess"}),  # the right name, a wrong uid
        ref,  # the right uid, another node's pool
        unbound,  # this node's pool, a pod bound elsewhere
        ClaimRef(namespace=NS, name="no-such-claim", uid="guess"),
    ]
    for named in asked:
        reply = await ask(bus, B, "prepare", prepare(named))
        assert isinstance(reply, ErrorReply)
        assert (reply.error, reply.message) == (
            ErrorKind.BAD_CLAIM,
            f"claim {named} is not allocated on node {B}",
        )
        for secret in (ref.uid, unbound.uid, A, "uid-secret-trainer", "secret-trainer'"):
            if secret not in str(named):
                assert secret not in reply.message
    assert await ledger_of_prefix.node_placements(B) == []


async def test_pods_kube_scheduler_placed_by_summing_shares_are_prepared(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    """kube-scheduler sums consumed capacity: all cores and then no cores fit a card,
    so do 50 + 50 + 0; memory past the card's is still refused."""
    first = await make_claim(kube, "greedy", A, [result(A, 1, memory="1Mi", cores="100")])
    assert isinstance(await ask(bus, A, "prepare", prepare(first)), ClaimReply)
    second = await make_claim(kube, "quiet", A, [result(A, 1, memory="1Mi", cores="0")])
    reply = await ask(bus, A, "prepare", prepare(second))
    assert isinstance(reply, ClaimReply), reply
    for pod, cores in [("half1", "50"), ("half2", "50"), ("none", "0")]:
        ref = await make_claim(kube, pod, A, [result(A, 0, memory="1Gi", cores=cores)])
        reply = await ask(bus, A, "prepare", prepare(ref))
        assert isinstance(reply, ClaimReply), reply
    assert await usage(ledger_of_prefix, A) == [(3072, 100, 3), (2, 100, 2)]
    big = await make_claim(kube, "big", A, [result(A, 0, memory="14Gi", cores="0")])
    reply = await ask(bus, A, "prepare", prepare(big))
    assert isinstance(reply, ErrorReply)
    assert reply.error == ErrorKind.BAD_CLAIM
    assert "CardInsufficientMemory" in reply.message
    assert await ledger_of_prefix.placement("uid-big") is None
    assert await ledger_of_prefix.check_node(A) == []


async def test_a_node_asking_past_its_budget_is_told_to_ask_again(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    ref = await make_claim(kube, "trainer", A, [result(A, 0)])
    inventory.gateway.claim_budget = Budgets(3, 0.0)  # no refill within the test
    for _ in range(3):
        assert isinstance(await ask(bus, A, "prepare", prepare(ref)), ClaimReply)
    reply = await ask(bus, A, "prepare", prepare(ref))
    assert isinstance(reply, ErrorReply)
    assert reply.error == ErrorKind.BUSY
    assert reply.error.transient
    assert f"node {A} asks to prepare claims more than" in reply.message
    # another node's budget is its own
    other = await make_claim(kube, "other", B, [result(B, 0)])
    assert isinstance(await ask(bus, B, "prepare", prepare(other)), ClaimReply)
    assert inventory.gateway.stats.claims_throttled == 1
    # an unprepare reads nothing and only frees room: it needs no token
    assert isinstance(await ask(bus, A, "unprepare", {"claim": ref.model_dump()}), Done)
    held = await ledger_of_prefix.placement("uid-trainer")
    assert held is not None
    assert held.state is PlacementState.RELEASED


async def test_a_node_has_so_many_claims_in_flight_at_most(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    ref = await make_claim(kube, "trainer", A, [result(A, 0)])
    other = await make_claim(kube, "other", B, [result(B, 0)])
    inventory.gateway.claims_in_flight = 1
    kube.gate = asyncio.Event()
    first = asyncio.create_task(ask(bus, A, "prepare", prepare(ref)))
    await until(lambda: kube.waiting == 1)
    reply = await ask(bus, A, "prepare", prepare(ref))
    assert isinstance(reply, ErrorReply)
    assert reply.error == ErrorKind.BUSY
    assert f"node {A} has 1 claims being prepared or unprepared" in reply.message
    elsewhere = asyncio.create_task(ask(bus, B, "prepare", prepare(other)))
    await until(lambda: kube.waiting == 2)  # node B's request is not held up by A's
    kube.gate.set()
    assert isinstance(await first, ClaimReply)
    assert isinstance(await elsewhere, ClaimReply)
    # the place is free again
    assert isinstance(await ask(bus, A, "prepare", prepare(ref)), ClaimReply)


async def test_refusals_name_what_is_wrong_and_write_nothing(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    missing = ClaimRef(namespace=NS, name="nothing", uid="x")
    reply = await ask(bus, A, "prepare", prepare(missing))
    assert isinstance(reply, ErrorReply)
    assert (reply.error, reply.message) == (
        ErrorKind.BAD_CLAIM,
        f"claim {missing} is not allocated on node {A}",
    )
    # a claim not shown to be this node's: the same answer, whatever is wrong
    ref = await make_claim(kube, "trainer", A, [result(A, 0)])
    replaced = ref.model_copy(update={"uid": "old-uid"})
    unreserved = await make_claim(kube, "lonely", A, [result(A, 0)], reserve=False)
    for named in (replaced, unreserved):
        reply = await ask(bus, A, "prepare", prepare(named))
        assert isinstance(reply, ErrorReply)
        assert (reply.error, reply.message) == (
            ErrorKind.BAD_CLAIM,
            f"claim {named} is not allocated on node {A}",
        )
    # the node's own claim: refusals say what is wrong
    too_big = await make_claim(kube, "greedy", A, [result(A, 0, memory="17Gi")])
    reply = await ask(bus, A, "prepare", prepare(too_big))
    assert isinstance(reply, ErrorReply)
    assert "more than card" in reply.message
    on_plugin = await make_claim(kube, "misplaced", PLUGIN, [result(PLUGIN, 0)])
    reply = await ask(bus, PLUGIN, "prepare", prepare(on_plugin))
    assert isinstance(reply, ErrorReply)
    assert (reply.error, reply.message) == (
        ErrorKind.BAD_CLAIM,
        f"node {PLUGIN} is not in DRA mode: its cards are granted by the device plugin, "
        "never by a claim",
    )
    # nothing of the refused ones is written (the trainer's claim holds: the
    # inventory's reconciliation may restore its pod meanwhile)
    for pod in ("lonely", "greedy", "misplaced"):
        assert await ledger_of_prefix.placement(f"uid-{pod}") is None
    assert await usage(ledger_of_prefix, PLUGIN) == [(0, 0, 0), (0, 0, 0)]
    assert await ledger_of_prefix.node_placements(PLUGIN) == []
    assert all(p.pod.name == "trainer" for p in await ledger_of_prefix.node_placements(A))


async def test_a_card_a_device_plugin_pod_holds_whole_takes_no_claim(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    # the pod was placed before the node turned to DRA mode
    await ledger_of_prefix.register_node(inventory_of(A, dra=False))
    old = Placement(
        pod=PodRef(uid="uid-old", namespace=NS, name="old"),
        node=A,
        containers=(
            ContainerAssignment(
                name="main", devices=(DeviceGrant(uuid=uuid_of(A, 0), memory_mib=1000, cores=100),)
            ),
        ),
    )
    await ledger_of_prefix.reserve(old)
    kube.add_pod({"metadata": {"namespace": NS, "name": "old", "uid": "uid-old"}, "spec": {}})
    await ledger_of_prefix.register_node(inventory_of(A))
    ref = await make_claim(kube, "trainer", A, [result(A, 0)])
    reply = await ask(bus, A, "prepare", prepare(ref))
    assert isinstance(reply, ErrorReply)
    assert reply.error == ErrorKind.BAD_CLAIM
    assert f"cannot reserve {uuid_of(A, 0)} on {A}: ExclusiveDeviceAllocateConflict" in (
        reply.message
    )
    assert await ledger_of_prefix.placement("uid-trainer") is None
    # and kubelet's Allocate on the DRA node hands out nothing
    allocate = await ask(bus, A, "allocate", {"request_id": "r1", "count": 1})
    assert isinstance(allocate, ErrorReply)
    assert allocate.error == ErrorKind.NOT_RESERVED
    assert "serves GPUs through DRA" in allocate.message
    assert not isinstance(allocate, AllocationReply)


async def test_a_second_gpuslice_claim_of_a_pod_is_refused(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    ref = await make_claim(kube, "trainer", A, [result(A, 0)])
    second = await kube.create_object(CLAIMS, {"metadata": {"name": "more"}, "spec": {}})
    await kube.replace_object(
        CLAIMS.named("more"),
        {"status": {"allocation": {"devices": {"results": [result(A, 1)]}}}},
        subresource="status",
    )
    pod = await kube.get_pod(NS, "trainer")
    pod["spec"]["resourceClaims"].append({"name": "more", "resourceClaimName": "more"})
    kube.add_pod(pod)
    reply = await ask(bus, A, "prepare", prepare(ref))
    assert isinstance(reply, ErrorReply)
    assert "gpuslice prepares one ResourceClaim per pod" in reply.message
    assert second["metadata"]["name"] == "more"
    assert await ledger_of_prefix.placement("uid-trainer") is None


async def test_an_api_server_that_does_not_answer_is_asked_again(
    inventory: Running, kube: FlakyKube, ledger_of_prefix: Ledger, bus: Bus
) -> None:
    ref = await make_claim(kube, "trainer", A, [result(A, 0)])
    kube.down = True
    reply = await ask(bus, A, "prepare", prepare(ref))
    assert isinstance(reply, ErrorReply)
    assert reply.error == ErrorKind.KUBE_UNAVAILABLE
    assert reply.error.transient
    assert reply.message == "the Kubernetes API failed"  # what failed is for the log
    assert await ledger_of_prefix.placement("uid-trainer") is None
    kube.down = False
    assert isinstance(await ask(bus, A, "prepare", prepare(ref)), ClaimReply)


async def test_without_a_kubernetes_api_every_claim_is_refused(
    nats_server: NatsServer,
    redis_url: str,
    prefix: str,
    bus: Bus,
    ledger_of_prefix: Ledger,
) -> None:
    settings = settings_for(nats_server, redis_url, prefix, kube_api="none")
    async with running(settings, bus, serve_http=False):
        await bus.flush()
        ref = ClaimRef(namespace=NS, name="trainer-gpu", uid="u1")
        reply = await ask(bus, A, "prepare", prepare(ref))
        assert isinstance(reply, ErrorReply)
        assert (reply.error, reply.message) == (ErrorKind.BAD_CLAIM, NO_KUBE)
        # unprepare needs no API server: nothing held is done
        assert isinstance(await ask(bus, A, "unprepare", {"claim": ref.model_dump()}), Done)
    await asyncio.sleep(0)
