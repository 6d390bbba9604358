"""The audit trail under the manifests' own NATS permissions: each event type is
published by its owner alone, and no credential deletes, purges or rewrites the
stream (real nats-server, the configuration k8s/ ships)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from nats.errors import Error as NatsError

from gpuslice_common.bus import Bus, flush_client
from gpuslice_common.config import CommonSettings
from gpuslice_common.events import (
    AllocationEvent,
    EnforcementEvent,
    EventType,
    PodAdmitted,
    PodDenied,
    make_event,
)
from gpuslice_common.models import PodRef
from gpuslice_common.servers import NatsServer
from tests.deploy.test_credentials import PASSWORDS, connect, role_nats

__all__ = ["role_nats"]  # the fixture, shared with test_credentials

STREAM = "gpuslice_audit"
# who may publish each event type, and no one else
OWNERS = {
    EventType.POD_ADMITTED: {"webhook"},
    EventType.POD_DENIED: {"webhook"},
    EventType.ALLOC_RESERVED: {"scheduler"},
    EventType.ALLOC_BOUND: {"scheduler"},
    EventType.ALLOC_FAILED: {"scheduler", "inventory"},
    EventType.ALLOC_PREEMPTED: {"scheduler"},
    EventType.ALLOC_ALLOCATED: {"inventory"},
    EventType.ALLOC_RELEASED: {"inventory", "scheduler"},  # the scheduler: pods gone per the API
    # node agents report enforcement to the inventory, which records it
    EventType.ENFORCE_MEMORY_KILL: {"inventory"},
    EventType.ENFORCE_THROTTLE: {"inventory"},
    EventType.ENFORCE_COMPUTE_KILL: {"inventory"},
    EventType.ENFORCE_UNGRANTED_KILL: {"inventory"},
}
SERVICE_ROLES = ("webhook", "scheduler", "inventory", "auditor", "admin")


def role_settings(server: NatsServer, role: str) -> CommonSettings:
    return CommonSettings(nats_url=server.url, nats_user=role, nats_password=PASSWORDS[role])


def an_event(event_type: EventType, by: str) -> bytes:
    pod = PodRef(uid=f"{by}-{event_type.suffix}".replace(".", "-"))
    payload: PodAdmitted | PodDenied | AllocationEvent | EnforcementEvent
    if event_type.suffix.startswith("enforce."):
        payload = EnforcementEvent(pod=pod, pod_uid=pod.uid, node="node-1", card="GPU-a")
    elif event_type == EventType.POD_ADMITTED:
        payload = PodAdmitted(pod=pod, containers=())
    elif event_type == EventType.POD_DENIED:
        payload = PodDenied(pod=pod, reason="forged?")
    else:
        payload = AllocationEvent(pod=pod, node="node-1", reason="forged?")
    return make_event(event_type, payload, source=f"/test/{by}").to_json()


@pytest.fixture
async def admin(role_nats: NatsServer) -> AsyncIterator[Bus]:
    """The install step: the admin credential makes the stream."""
    bus = await Bus.connect(role_settings(role_nats, "admin"), "admin")
    await bus.ensure_audit_stream(timedelta(days=1))
    yield bus
    await bus.close()


async def test_each_event_type_is_stored_only_from_its_owner(
    role_nats: NatsServer, admin: Bus
) -> None:
    errors: list[str] = []
    clients = {role: await connect(role_nats, role, errors) for role in SERVICE_ROLES}
    try:
        for role, client in clients.items():
            for event_type in EventType:
                await client.publish(
                    f"gpuslice.events.{event_type.suffix}", an_event(event_type, role)
                )
            await flush_client(client)
        wanted = Counter({t: len(owners) for t, owners in OWNERS.items()})
        auditor = await Bus.connect(role_settings(role_nats, "auditor"), "auditor")
        try:
            for _ in range(100):  # JetStream stores what came without an ack a little later
                if (await auditor.check_audit_stream()).state.messages >= wanted.total():
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # and nothing more arrives
            events = await auditor.read_audit(timeout=10)
        finally:
            await auditor.close()
        stored = {(e.source.removeprefix("/test/"), e.type) for e in events}
        assert stored == {(role, t) for t, owners in OWNERS.items() for role in owners}
        assert len(events) == wanted.total()
        # every refused publish was reported to its publisher
        assert sum("permissions violation" in e.lower() for e in errors) == (
            len(SERVICE_ROLES) * len(EventType) - wanted.total()
        ), errors
    finally:
        for client in clients.values():
            await client.close()


API = "$JS.API"
DESTRUCTIVE = {
    "delete the stream": f"{API}.STREAM.DELETE.{STREAM}",
    "purge the stream": f"{API}.STREAM.PURGE.{STREAM}",
    "delete a message": f"{API}.STREAM.MSG.DELETE.{STREAM}",
    "make a stream of the same name": f"{API}.STREAM.CREATE.{STREAM}",
    "change the stream": f"{API}.STREAM.UPDATE.{STREAM}",
}


@pytest.mark.parametrize("role", SERVICE_ROLES)
async def test_no_credential_deletes_purges_or_rewrites_the_stream(
    role_nats: NatsServer, admin: Bus, role: str
) -> None:
    settings = role_settings(role_nats, "inventory")
    inventory = await Bus.connect(settings, "inventory")
    try:
        for i in range(3):
            event = make_event(
                EventType.ALLOC_RELEASED,
                AllocationEvent(pod=PodRef(uid=f"p{i}"), node="node-1", reason="done"),
                source="test",
            )
            await inventory.publish_acked(event)
    finally:
        await inventory.close()
    errors: list[str] = []
    client = await connect(role_nats, role, errors)
    try:
        refused = []
        for what, subject in DESTRUCTIVE.items():
            if role == "admin" and subject.split(".")[3] in ("CREATE", "UPDATE"):
                continue  # the install step's own work; below: what it can change
            body = b'{"seq": 1}' if "MSG.DELETE" in subject else b"{}"
            try:
                reply = await client.request(subject, body, timeout=0.5)
            except (TimeoutError, NatsError):
                refused.append(what)  # no answer: the server dropped the request
                continue
            raise AssertionError(f"{role} could {what}: {reply.data!r}")
        assert refused, role
    finally:
        await client.close()
    info = await admin.check_audit_stream()
    assert info.state.messages == 3
    assert info.state.first_seq == 1
    assert sum("permissions violation" in e.lower() for e in errors) == len(refused), errors


async def test_the_admin_cannot_lift_the_stream_s_protection(admin: Bus) -> None:
    info = await admin.check_audit_stream()
    weaker = dataclasses.replace(info.config, deny_delete=False, deny_purge=False)
    with pytest.raises(NatsError, match="can not cancel deny message deletes"):
        await admin.js.update_stream(weaker)
    assert (await admin.check_audit_stream()).config.deny_delete
