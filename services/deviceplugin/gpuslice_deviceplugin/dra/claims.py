"""The agent's side of a DRA claim: prepared from the inventory's answer, as Allocate is.

kubelet names a claim; the agent asks the inventory (``prepare``, through
:class:`~gpuslice_deviceplugin.gateway.InventoryGateway`), which reads the claim
and its pod from the API server itself, checks them and records the grants in the
ledger. What comes back is the pod's placement and which device is whose; the
agent trusts no device kubelet or the claim names beyond it.

For each container of the placement the agent then does what the device plugin's
Allocate does for one (:func:`~gpuslice_deviceplugin.allocation.answer` and
:func:`~gpuslice_deviceplugin.allocation.grant`, the same code): its directory
under the host directory with owner record, grant, control and region, so the
enforcer, the driver's limits and telemetry hold it as any other; and, instead
of kubelet's Allocate answer, a CDI device carrying the same environment and
mounts. All of a claim's CDI devices are one spec file in ``cdi_dir``
(``gpuslice.io-<claim uid>.json``, kind :data:`~gpuslice_common.dra.CDI_KIND`,
one device ``<pod uid>-<container>`` per container); each container's first
device of the claim names its CDI device, so the runtime gives every container
its own edits.

A record per claim (``<host_dir>/dra/<claim uid>.json``: the claim and its pod),
written before anything else, lets an agent that restarted unprepare what it
prepared. Unprepare removes the CDI spec, has the inventory release the claim
and forgets the record; the container directories go as every pod's do, once the
ledger says the pod released (the agent's clean-up). Both are idempotent.

MIG instances are not prepared through DRA: a claim whose grant names one is
refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.dra import CDI_KIND, device_name
from gpuslice_common.grant import Grant
from gpuslice_common.models import ClaimRef
from gpuslice_common.nodeapi import AllocationReply, ClaimReply, NodeRequestError
from gpuslice_deviceplugin.allocation import answer, grant
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb
from gpuslice_deviceplugin.containers import (
    ContainerOwner,
    HostDir,
    check_container_name,
    check_pod_uid,
    write_atomic,
)
from gpuslice_deviceplugin.dra.contract import ClaimError, PreparedDevice
from gpuslice_deviceplugin.driverlimits import CardSupport
from gpuslice_deviceplugin.gateway import InventoryGateway
from gpuslice_deviceplugin.nodeconfig import NodeConfig

log = logging.getLogger(__name__)

CDI_VERSION: Final = "0.6.0"  # device names may start with a digit (0.5.0), a mount's type (0.4.0)
# the runtime (root) reads it; it carries the containers' telemetry tokens
CDI_MODE: Final = 0o600
RECORD_DIR: Final = "dra"
RECORD_MODE: Final = 0o600
RECORD_DIR_MODE: Final = 0o700
RECORD_MAX_BYTES: Final = 64 * 1024
TAG = re.compile(r"^[0-9a-f]{32}$")


def cdi_file(cdi_dir: Path, claim: ClaimRef) -> Path:
    return cdi_dir / f"gpuslice.io-{claim.uid}.json"


def cdi_name(pod_uid: str, container: str, tag: str) -> str:
    """The CDI device (within :data:`CDI_KIND`) of one container of a pod. ``tag``
    is the claim record's secret: a runtime that takes CDI devices from pod
    annotations must not let a tenant name a neighbour's (its grant, its region)."""
    return f"{pod_uid}-{container}-{tag}"


def cdi_id(pod_uid: str, container: str, tag: str) -> str:
    """The fully qualified CDI device name kubelet hands the runtime."""
    return f"{CDI_KIND}={cdi_name(pod_uid, container, tag)}"


def container_edits(response: pb.ContainerAllocateResponse) -> dict[str, Any]:
    """The CDI container edits of a device plugin's answer for one container."""
    edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(response.envs.items())]}
    mounts = [
        {
            "hostPath": m.host_path,
            "containerPath": m.container_path,
            "type": "bind",
            "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"],
        }
        for m in response.mounts
    ]
    if mounts:
        edits["mounts"] = mounts
    nodes = [
        {"path": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
        for d in response.devices
    ]
    if nodes:
        edits["deviceNodes"] = nodes
    return edits


@dataclass(frozen=True)
class Record:
    """What the agent keeps of a prepared claim."""

    claim: ClaimRef
    pod_uid: str
    tag: str = ""  # the CDI devices' secret suffix (cdi_name)

    def to_json(self) -> bytes:
        body = {
            "claim": self.claim.model_dump(mode="json"),
            "pod_uid": self.pod_uid,
            "tag": self.tag,
        }
        return json.dumps(body, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> Record:
        """ValueError names what is wrong."""
        try:
            body = json.loads(data)
            claim = ClaimRef.model_validate(body["claim"])
            pod_uid = body["pod_uid"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable claim record: {exc}") from None
        if not isinstance(pod_uid, str) or not pod_uid:
            raise ValueError("unreadable claim record: pod_uid is not a string")
        tag = body.get("tag", "")
        if not isinstance(tag, str) or not TAG.fullmatch(tag):
            raise ValueError("unreadable claim record: tag is not a hex string")
        return cls(claim, pod_uid, tag)


class Claims:
    """:class:`~gpuslice_deviceplugin.dra.contract.ClaimPreparer` of the node agent."""

    def __init__(
        self,
        settings: DevicePluginSettings,
        gateway: InventoryGateway,
        host: HostDir,
        config: Callable[[], NodeConfig],
        *,
        driver_support: Callable[[], Mapping[str, CardSupport]] | None = None,
    ) -> None:
        self.settings = settings
        self.gateway = gateway
        self.host = host
        self.config = config
        self.driver_support = driver_support
        self.cdi_dir = Path(settings.cdi_dir)
        self.records = host.root / RECORD_DIR
        # per claim UID: its lock and how many calls hold or wait for it (the
        # entry goes with the last, so the map stays as small as the calls)
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @property
    def node(self) -> str:
        return self.settings.node_name

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.settings.allocate_timeout.total_seconds()

    @contextlib.asynccontextmanager
    async def _lock(self, claim: ClaimRef) -> AsyncIterator[None]:
        """One prepare or unprepare of ``claim`` at a time."""
        lock, users = self._locks.get(claim.uid, (asyncio.Lock(), 0))
        self._locks[claim.uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[claim.uid]
            if users == 1:
                del self._locks[claim.uid]
            else:
                self._locks[claim.uid] = (lock, users - 1)

    def _record_path(self, claim: ClaimRef) -> Path:
        return self.records / f"{claim.uid}.json"

    # ------------------------------------------------------------ prepare

    async def prepare(self, claim: ClaimRef) -> Sequence[PreparedDevice]:
        async with self._lock(claim):
            try:
                reply = await self.gateway.prepare(claim, self._deadline())
            except NodeRequestError as exc:
                log.warning("claim %s not prepared: %s", claim, exc)
                kind = "" if exc.kind != "no-answer" else "inventory unavailable: "
                raise ClaimError(f"{kind}{exc}") from None
            self._check(claim, reply)
            try:
                return await self._prepare(claim, reply)
            except ClaimError:
                raise
            except Exception as exc:  # the ledger holds the claim; say why it fails here
                log.exception("claim %s: preparing on node %s failed", claim, self.node)
                raise ClaimError(
                    f"cannot prepare the claim's containers ({type(exc).__name__}): {exc}"
                ) from None

    def _check(self, claim: ClaimRef, reply: ClaimReply) -> None:
        """The inventory's answer is for this claim on this node and names only the
        placement's own grants (anything else is refused, nothing written)."""
        placement = reply.placement
        if reply.claim != claim or placement.claim not in (None, claim):
            raise ClaimError(f"the inventory answered for another claim than {claim}")
        if placement.node != self.node:
            raise ClaimError(f"the inventory placed claim {claim} on node {placement.node!r}")
        try:  # they name directories and CDI devices
            check_pod_uid(placement.pod.uid)
            for container in placement.containers:
                check_container_name(container.name)
        except ValueError as exc:
            raise ClaimError(f"claim {claim}: {exc}") from None
        grants = {c.name: {g.uuid: g for g in c.devices} for c in placement.containers}
        for device in reply.devices:
            held = grants.get(device.container, {})
            if device.uuid not in held:
                raise ClaimError(
                    f"device {device.device} of claim {claim}: container {device.container} "
                    f"holds no grant on {device.uuid}"
                )
            if device.pool != self.node or device.device != _name(device.uuid):
                raise ClaimError(
                    f"device {device.pool}/{device.device} of claim {claim} is not card "
                    f"{device.uuid} of node {self.node}"
                )
        for container in placement.containers:
            for g in container.devices:
                if g.mig is not None:
                    raise ClaimError(
                        f"claim {claim}: container {container.name} is granted a MIG instance "
                        f"on {g.uuid}; MIG instances are not prepared through DRA"
                    )
        named = {d.container for d in reply.devices}
        missing = [c.name for c in placement.containers if c.name not in named]
        if missing:
            raise ClaimError(
                f"claim {claim}: no device of the claim is for container(s) {', '.join(missing)}"
            )

    async def _prepare(self, claim: ClaimRef, reply: ClaimReply) -> list[PreparedDevice]:
        placement = reply.placement
        pod = placement.pod
        held = await asyncio.to_thread(self._read_record, claim)
        # the same tag when kubelet asks again for the same pod: the same answer
        tag = held.tag if held is not None and held.pod_uid == pod.uid and held.tag else ""
        record = Record(claim, pod.uid, tag or secrets.token_hex(16))
        config = self.config()  # once: the answers and the grants agree if it is reloaded
        support = self.driver_support() if self.driver_support is not None else None
        grants: list[tuple[ContainerOwner, Grant]] = []
        devices = []
        for index, container in enumerate(placement.containers):
            allocation = AllocationReply(
                placement=placement,
                container_index=index,
                telemetry_token=reply.telemetry_token,
            )
            # Always under the interposer: whether the card stays unshared is
            # kube-scheduler's to decide later, and the pod's own spec (which no
            # webhook may have checked: a hand-written claim) decides nothing.
            control = True
            response = answer(
                allocation,
                self.settings,
                config,
                self.host,
                control=control,
                driver_support=support,
            )
            owner = ContainerOwner(
                pod_uid=pod.uid,
                namespace=pod.namespace,
                pod_name=pod.name,
                container=container.name,
                devices=tuple(g.uuid for g in container.devices),
                allocated_at=time.time(),
            )
            grants.append((owner, grant(allocation, self.settings, config, control=control)))
            devices.append(
                {
                    "name": cdi_name(pod.uid, container.name, record.tag),
                    "containerEdits": container_edits(response),
                }
            )
        spec = {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}
        await asyncio.to_thread(self._write_all, record, grants, spec)
        log.info(
            "prepared claim %s for pod %s/%s: %s",
            claim,
            pod.namespace,
            pod.name,
            ", ".join(f"{d.container}:{d.uuid}" for d in reply.devices),
        )
        named: set[str] = set()
        prepared = []
        for device in reply.devices:
            first = device.container not in named
            named.add(device.container)
            prepared.append(
                PreparedDevice(
                    request_names=(device.request,),
                    pool=device.pool,
                    device=device.device,
                    cdi_ids=(cdi_id(pod.uid, device.container, record.tag),) if first else (),
                )
            )
        return prepared

    def _write_all(
        self,
        record: Record,
        grants: Sequence[tuple[ContainerOwner, Grant]],
        spec: Mapping[str, Any],
    ) -> None:
        """The claim's record first (unprepare names the pod from it), then each
        container's grant directory, then the CDI spec the runtime reads: in one
        thread. The record and the spec are not synced to disk: a crash of the
        agent keeps them (the page cache does), a crash of the host takes the
        containers too, and without a record unprepare finds the claim by itself."""
        self.records.mkdir(mode=RECORD_DIR_MODE, parents=True, exist_ok=True)
        write_atomic(self._record_path(record.claim), record.to_json(), RECORD_MODE, durable=False)
        for owner, limits in grants:
            self.host.prepare_container(owner, limits)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        data = json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n"
        write_atomic(cdi_file(self.cdi_dir, record.claim), data, CDI_MODE, durable=False)

    # ------------------------------------------------------------ unprepare

    async def unprepare(self, claim: ClaimRef) -> None:
        async with self._lock(claim):
            record = await asyncio.to_thread(self._read_record, claim)
            await asyncio.to_thread(_remove, cdi_file(self.cdi_dir, claim))
            pod_uid = record.pod_uid if record is not None else None
            try:
                await self.gateway.unprepare(claim, pod_uid, self._deadline())
            except NodeRequestError as exc:
                log.warning("claim %s not unprepared: %s", claim, exc)
                kind = "" if exc.kind != "no-answer" else "inventory unavailable: "
                raise ClaimError(f"{kind}{exc}") from None
            await asyncio.to_thread(_remove, self._record_path(claim))
            log.info("unprepared claim %s (pod %s)", claim, pod_uid or "unknown")

    def _read_record(self, claim: ClaimRef) -> Record | None:
        """The claim's record; None when there is none or it cannot be read (then the
        inventory finds the claim by itself)."""
        path = self._record_path(claim)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("claim record %s unreadable: %s", path, exc)
            return None
        try:
            record = Record.from_json(os.read(fd, RECORD_MAX_BYTES))
        except (OSError, ValueError) as exc:
            log.warning("claim record %s: %s", path, exc)
            return None
        finally:
            os.close(fd)
        if record.claim.uid != claim.uid:
            log.warning("claim record %s names claim %s", path, record.claim)
            return None
        return record


def _name(uuid: str) -> str | None:
    try:
        return device_name(uuid)
    except ValueError:
        return None


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


__all__ = ["CDI_VERSION", "Claims", "Record", "cdi_file", "cdi_id", "cdi_name", "container_edits"]
