"""Node agents and GPU containers prove who they are to NATS.

nats-server runs with k8s/nats.yaml's configuration; the inventory runs with its
auth callout; node agents' tokens are reviewed by the test API server. Each
identity may publish for its own node or pod and nothing else."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpuslice_common.bus import flush_client
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.models import (
    MAX_DEVICE_MEMORY_MIB,
    MAX_DEVICES,
    MAX_NAME_LENGTH,
    MAX_NUMA_NODE,
    MAX_SPLIT_COUNT,
    GpuDevice,
    NodeInventory,
)
from gpuslice_deviceplugin.service import connect_bus
from gpuslice_inventory.authcallout import (
    CONTAINER_MAX_PAYLOAD,
    NODE_AGENT_MAX_PAYLOAD,
    NODE_AGENT_MAX_SUBS,
)
from gpuslice_inventory.tokens import TelemetryTokens
from tests.conftest import make_inventory
from tests.deploy.roles import AUDIENCE, Roles, manifest_roles, until
from tests.test_ledger import placement

NODE_A, NODE_B = "gpu-a.example.com", "gpu-b"  # a dot: the subject token writes it as '_'
A, B = "gpu-a_example_com", "gpu-b"


@pytest.fixture
async def roles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> AsyncIterator[Roles]:
    async with manifest_roles(tmp_path, monkeypatch, redis_url) as found:
        yield found


class Seen:
    """What the inventory's user receives on some subjects."""

    def __init__(self) -> None:
        self.subjects: list[str] = []

    async def keep(self, msg: Any) -> None:
        self.subjects.append(msg.subject)


async def listen(roles: Roles, *subjects: str) -> Seen:
    seen = Seen()
    inventory = await roles.service("inventory")
    for subject in subjects:
        await inventory.subscribe(subject, cb=seen.keep)
    await flush_client(inventory)
    return seen


def violations(errors: list[str]) -> list[str]:
    return [e for e in errors if "permissions violation" in e.lower()]


async def test_a_node_agent_publishes_for_its_own_node_only(roles: Roles) -> None:
    seen = await listen(roles, "gpuslice.inventory.*")
    errors: list[str] = []
    agent = await roles.client(roles.node_token(NODE_A), errors, inbox_prefix=f"_INBOX.{A}")
    try:
        await agent.publish(f"gpuslice.inventory.{A}", b"{}")
        # its requests to the inventory (no service reads them yet: the server
        # would report a refusal as it does below)
        await agent.publish(f"gpuslice.node.{A}.allocate", b"{}")
        # another node's inventory and requests, events, telemetry: refused
        refused = (
            f"gpuslice.inventory.{B}",
            f"gpuslice.node.{B}.allocate",
            "gpuslice.events.alloc.allocated",
            "gpuslice.events.enforce.memory-kill",  # reported through the inventory only
            "gpuslice.telemetry.gpu-b.pod-1",
        )
        for subject in refused:
            await agent.publish(subject, b"{}")
        await flush_client(agent)
        await until(lambda: len(violations(errors)) == len(refused))
        # published after the refused ones: once it arrives, so would they have
        await agent.publish(f"gpuslice.inventory.{A}", b"{}")
        await flush_client(agent)
        await until(lambda: len(seen.subjects) == 2)
    finally:
        await agent.close()
    assert seen.subjects == [f"gpuslice.inventory.{A}"] * 2
    for subject, violation in zip(refused, violations(errors), strict=True):
        assert f'"{subject}"' in violation, (subject, violation)
    assert roles.callout.stats.accepted["node"] == 1


async def test_a_node_agent_reads_only_its_own_inbox(roles: Roles) -> None:
    errors: list[str] = []
    agent = await roles.client(roles.node_token(NODE_A), errors, inbox_prefix=f"_INBOX.{A}")
    try:
        await agent.subscribe(f"_INBOX.{A}.x.*")
        await flush_client(agent)
        assert violations(errors) == []
        for subject in ("_INBOX.>", f"_INBOX.{B}.>", "gpuslice.inventory.*", ">"):
            await agent.subscribe(subject)
            await flush_client(agent)
            quoted = f'"{subject.lower()}"'  # as the client reports it
            await until(lambda q=quoted: any(q in v for v in violations(errors)))
        assert len(violations(errors)) == 4, errors
    finally:
        await agent.close()


async def test_the_device_plugin_connects_with_its_token_file_and_its_inbox(
    roles: Roles, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(roles.node_token(NODE_A) + "\n")
    settings = DevicePluginSettings(
        node_name=NODE_A, nats_url=roles.server.url, nats_token_file=str(token_file)
    )
    seen = await listen(roles, "gpuslice.inventory.*")
    bus = await connect_bus(settings)
    try:
        assert bus.nc.new_inbox().startswith(f"_INBOX.{A}.")
        await bus.publish_model(bus.subjects.inventory(NODE_A), make_inventory(NODE_A, gpus=1))
        await bus.flush()
        await until(lambda: seen.subjects == [f"gpuslice.inventory.{A}"])
        # the inventory registered it
        await until(lambda: roles.ledger.node_gpus(NODE_A))
    finally:
        await bus.close()


async def test_an_inventory_naming_another_node_than_its_subject_is_not_registered(
    roles: Roles,
) -> None:
    agent = await roles.client(roles.node_token(NODE_A), inbox_prefix=f"_INBOX.{A}")
    try:
        posing: NodeInventory = make_inventory(NODE_B, gpus=1)
        await agent.publish(f"gpuslice.inventory.{A}", posing.model_dump_json().encode())
        await agent.publish(
            f"gpuslice.inventory.{A}", make_inventory(NODE_A, gpus=1).model_dump_json().encode()
        )
        await flush_client(agent)
        await until(lambda: roles.ledger.node_gpus(NODE_A))  # handled in order
    finally:
        await agent.close()
    assert await roles.ledger.node_gpus(NODE_B) == []
    assert roles.inventory.work.registrations == 1


@pytest.mark.parametrize(
    "case",
    ["wrong-audience", "expired", "unknown", "other-service-account", "other-namespace", "none"],
)
async def test_tokens_that_do_not_prove_a_node_agent_are_refused(roles: Roles, case: str) -> None:
    token = {
        "wrong-audience": lambda: roles.node_token(NODE_A, audiences=("https://kubernetes",)),
        "expired": lambda: roles.node_token(NODE_A, ttl_s=-1),
        "unknown": lambda: roles.node_token(NODE_A)[:-4] + "AAAA",
        "other-service-account": lambda: roles.node_token(NODE_A, service_account="default"),
        "other-namespace": lambda: roles.node_token(NODE_A, namespace="default"),
        "none": lambda: "",
    }[case]()
    why = await roles.refusal(token or None)
    assert "authorization violation" in why.lower(), why
    reasons = roles.callout.stats.refused
    expected = {
        "wrong-audience": "token-not-authenticated",
        "expired": "token-not-authenticated",
        "unknown": "token-not-authenticated",
        "other-service-account": "not-node-agent",
        "other-namespace": "not-node-agent",
        "none": "no-token",
    }[case]
    assert reasons == {expected: 1}, reasons
    assert roles.callout.stats.accepted == {}
    if token:  # the review asked for the node agents' audience
        reviews = [r for r in roles.api.requests if r.path.startswith("/apis/authentication")]
        assert reviews, "no TokenReview"
        assert reviews[-1].body["spec"]["audiences"] == [AUDIENCE]


async def test_a_container_publishes_telemetry_for_its_own_pod_only(roles: Roles) -> None:
    await roles.ledger.register_node(make_inventory(NODE_A, gpus=1), rebuilt=True)
    await roles.ledger.reserve(placement("pod-1", NODE_A, [[(0, 100, 1)]]))
    seen = await listen(roles, "gpuslice.telemetry.*.*")
    errors: list[str] = []
    container = await roles.client(roles.telemetry_token(NODE_A, "pod-1"), errors)
    try:
        await container.publish(f"gpuslice.telemetry.{A}.pod-1", b"{}")
        for subject in (
            f"gpuslice.telemetry.{A}.pod-2",
            f"gpuslice.telemetry.{B}.pod-1",
            f"gpuslice.inventory.{A}",
            "gpuslice.events.alloc.released",
        ):
            await container.publish(subject, b"{}")
        await flush_client(container)
        await until(lambda: len(violations(errors)) == 4)
        await container.subscribe(">")
        await flush_client(container)
        await until(lambda: len(violations(errors)) == 5)
        await container.publish(f"gpuslice.telemetry.{A}.pod-1", b"{}")
        await flush_client(container)
        await until(lambda: len(seen.subjects) == 2)
    finally:
        await container.close()
    assert seen.subjects == [f"gpuslice.telemetry.{A}.pod-1"] * 2
    assert roles.callout.stats.accepted == {"telemetry": 1}


def _tamper(token: str, **changes: Any) -> str:
    tag, claims, signature = token.split(".")
    body = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
    body.update(changes)
    encoded = base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")
    return f"{tag}.{encoded}.{signature}"


@pytest.mark.parametrize(
    "case", ["tampered", "other-key", "truncated", "released", "other-node", "never-placed"]
)
async def test_telemetry_tokens_not_for_a_live_pod_are_refused(roles: Roles, case: str) -> None:
    await roles.ledger.register_node(make_inventory(NODE_A, gpus=1), rebuilt=True)
    await roles.ledger.register_node(make_inventory(NODE_B, gpus=1), rebuilt=True)
    await roles.ledger.reserve(placement("pod-1", NODE_A, [[(0, 100, 1)]]))
    await roles.ledger.reserve(placement("pod-2", NODE_A, [[(0, 100, 1)]]))
    own = roles.telemetry_token(NODE_A, "pod-1")
    if case == "released":
        await roles.ledger.release("pod-1", "done")
    token = {
        "tampered": lambda: _tamper(own, p="pod-2"),
        "other-key": lambda: TelemetryTokens(Ed25519PrivateKey.generate()).issue(NODE_A, "pod-1"),
        "truncated": lambda: own[:-3],
        "released": lambda: own,
        "other-node": lambda: roles.telemetry_token(NODE_B, "pod-1"),
        "never-placed": lambda: roles.telemetry_token(NODE_A, "pod-9"),
    }[case]()
    why = await roles.refusal(token)
    assert "authorization violation" in why.lower(), why
    expected = {
        "tampered": "telemetry-token-invalid",
        "other-key": "telemetry-token-invalid",
        "truncated": "telemetry-token-invalid",
        "released": "pod-released",
        "other-node": "pod-not-placed",
        "never-placed": "pod-not-placed",
    }[case]
    assert roles.callout.stats.refused == {expected: 1}
    # the same pod's own token still connects
    if case not in ("released",):
        client = await roles.client(own)
        await client.close()


def _jwt_shaped(claims: dict[str, Any]) -> str:
    """A token shaped like a ServiceAccount JWT that no API server minted."""

    def b64(value: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{b64({'alg': 'RS256'})}.{b64(claims)}.{secrets.token_urlsafe(32)}"


async def test_a_node_agent_connects_while_junk_connects_wait_on_slow_reviews(
    roles: Roles,
) -> None:
    """Anyone who reaches NATS can make the callout review a token: many at once,
    each review slow, must not keep a real node agent out."""
    roles.api.review_delay = 0.5
    junk = [_jwt_shaped({"exp": int(time.time()) + 600, "sub": f"x{i}"}) for i in range(60)]
    junk += [f"eyJ{secrets.token_hex(8)}.x.y" for _ in range(20)]  # not even JWTs
    flood = [asyncio.create_task(roles.refusal(token)) for token in junk]
    try:
        # the flood is being reviewed when the agent comes
        await until(lambda: len(roles.api.reviews) >= 10)
        agent = await roles.client(roles.node_token(NODE_A), inbox_prefix=f"_INBOX.{A}")
        assert agent.is_connected
        answers = await asyncio.wait_for(asyncio.gather(*flood), timeout=60)
    finally:
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    assert all("authorization violation" in answer.lower() for answer in answers), answers
    assert roles.callout.stats.accepted == {"node": 1}
    assert roles.callout.stats.refused["token-malformed"] == 20
    # the ones that are not JWTs were never sent to the API server
    assert len(roles.api.reviews) == 61


async def test_a_token_is_reviewed_once_and_a_refusal_remembered(roles: Roles) -> None:
    token = roles.node_token(NODE_A)
    for _ in range(2):
        agent = await roles.client(token, inbox_prefix=f"_INBOX.{A}")
        await agent.close()
    assert len(roles.api.reviews) == 1
    assert roles.callout.stats.accepted == {"node": 2}
    unknown = _jwt_shaped({"exp": int(time.time()) + 600, "sub": "nobody"})
    for _ in range(2):
        assert "authorization violation" in (await roles.refusal(unknown)).lower()
    assert len(roles.api.reviews) == 2
    assert roles.callout.stats.refused == {"token-not-authenticated": 2}
    # another token is reviewed on its own
    agent = await roles.client(roles.node_token(NODE_A), inbox_prefix=f"_INBOX.{A}")
    await agent.close()
    assert len(roles.api.reviews) == 3


# ------------------------------------------------------------ what a container may send


def telemetry(node: str, uid: str, container: str, *uuids: str) -> bytes:
    devices = [{"uuid": u, "used_bytes": 10, "limit_bytes": 20} for u in uuids]
    doc = {"node": node, "pod_uid": uid, "container": container, "pid": 1}
    doc |= {"time": datetime.now(UTC).isoformat(), "devices": devices}
    return json.dumps(doc).encode()


async def test_callout_users_carry_limits_and_a_container_an_expiry(roles: Roles) -> None:
    await roles.ledger.register_node(make_inventory(NODE_A, gpus=1), rebuilt=True)
    await roles.ledger.reserve(placement("pod-1", NODE_A, [[(0, 100, 1)]]))
    container = await roles.callout.identify(roles.telemetry_token(NODE_A, "pod-1"))
    assert (container.payload, container.subs) == (CONTAINER_MAX_PAYLOAD, 0)
    session = roles.inventory.settings.telemetry_session.total_seconds()
    assert container.expires is not None
    assert time.time() + session <= container.expires <= time.time() + session + 2
    agent = await roles.callout.identify(roles.node_token(NODE_A))
    assert (agent.payload, agent.subs) == (NODE_AGENT_MAX_PAYLOAD, NODE_AGENT_MAX_SUBS)


def test_a_node_agent_may_send_its_largest_inventory_twice_over() -> None:
    """NODE_AGENT_MAX_PAYLOAD leaves headroom over the largest NodeInventory."""
    devices = tuple(
        GpuDevice(
            uuid=f"GPU-{i:04}-".ljust(MAX_NAME_LENGTH, "x"),
            index=i,
            model="M" * MAX_NAME_LENGTH,
            memory_mib=MAX_DEVICE_MEMORY_MIB,
            numa=MAX_NUMA_NODE,
            healthy=False,
        )
        for i in range(MAX_DEVICES)
    )
    name = ".".join(["n" * 63] * 3 + ["n" * 61])  # 253 characters
    largest = NodeInventory(
        node=name, devices=devices, split_count=MAX_SPLIT_COUNT, memory_scaling=1 / 3
    )
    assert 2 * len(largest.model_dump_json()) <= NODE_AGENT_MAX_PAYLOAD


async def test_the_store_keeps_only_the_pods_own_containers_and_cards(roles: Roles) -> None:
    """A container's credential publishes under its own pod's subject, and the
    inventory stores only what its placement holds: c0 on the node's one card."""
    await roles.ledger.register_node(make_inventory(NODE_A, gpus=1), rebuilt=True)
    await roles.ledger.reserve(placement("pod-1", NODE_A, [[(0, 100, 1)]]))
    card = f"GPU-{NODE_A}-0"
    store = roles.inventory.telemetry
    container = await roles.client(roles.telemetry_token(NODE_A, "pod-1"))
    subject = f"gpuslice.telemetry.{A}.pod-1"
    wide = [f"GPU-fake-{i:06}" for i in range(5000)]
    sent = [
        telemetry(NODE_A, "pod-1", "c0", *wide[:17]),  # more than a region holds
        telemetry(NODE_A, "pod-1", "c0", card, *wide[:15]),  # cards not granted to c0
        telemetry(NODE_A, "pod-1", "c1", card),  # no such container in the placement
        telemetry(NODE_A, "pod-1", "C0", card),  # no Kubernetes container name
    ]
    for payload in sent:
        before = store.stats.malformed + store.stats.dropped
        await container.publish(subject, payload)
        await flush_client(container)
        await until(lambda b=before: store.stats.malformed + store.stats.dropped == b + 1)
    await container.publish(subject, telemetry(NODE_A, "pod-1", "c0", card))
    await flush_client(container)
    await until(lambda: store.stats.stored == 1)
    assert store.stats.malformed == 2
    assert store.stats.dropped_by == {"foreign-device": 1, "foreign-container": 1}
    usage = await store.gpu_usage(NODE_A)
    assert list(usage) == [card]
    assert (usage[card].used_bytes, usage[card].containers) == (10, 1)


async def test_a_released_pods_late_samples_are_not_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    async with manifest_roles(
        tmp_path, monkeypatch, redis_url, telemetry_placement_cache="100ms"
    ) as roles:
        await roles.ledger.register_node(make_inventory(NODE_A, gpus=1), rebuilt=True)
        await roles.ledger.reserve(placement("pod-1", NODE_A, [[(0, 100, 1)]]))
        card = f"GPU-{NODE_A}-0"
        store = roles.inventory.telemetry
        container = await roles.client(roles.telemetry_token(NODE_A, "pod-1"))

        async def send() -> None:
            await container.publish(
                f"gpuslice.telemetry.{A}.pod-1", telemetry(NODE_A, "pod-1", "c0", card)
            )
            await flush_client(container)

        await send()
        await until(lambda: store.stats.stored == 1)
        await roles.ledger.release("pod-1", "done")

        async def refused() -> bool:  # the store has read the release
            await send()
            return store.stats.dropped_by["not-placed"] > 0

        await until(refused)
        stored = store.stats.stored
        dropped = store.stats.dropped_by["not-placed"]
        for more in range(1, 4):  # one flush at a time (a flush keeps one per container)
            await send()
            await until(lambda n=more: store.stats.dropped_by["not-placed"] == dropped + n)
        assert store.stats.stored == stored
