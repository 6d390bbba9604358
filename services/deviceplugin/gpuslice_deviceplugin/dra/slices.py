"""The node's cards as ResourceSlices (``resource.k8s.io/v1``), kept in step with them.

One pool per node, named after it, of driver :data:`~gpuslice_common.dra.DRIVER`:
a device per healthy card, named :func:`~gpuslice_common.dra.device_name` of its
UUID, with its facts as attributes (``uuid``, ``model``, ``index``, ``numa``
where known, ``vendor``, ``mode``) and its capacity as the ledger counts it
(:meth:`NodeInventory.capacity`, after the node's scaling): ``memory`` in bytes,
``cores`` in percent of a card. kube-scheduler then allocates nothing the ledger
would refuse at prepare.

With consumable capacity (``dra_consumable``: the cluster runs
DRAConsumableCapacity) a device allows multiple allocations and each capacity has a
request policy: ``memory`` defaults to the whole card (a claim that names no
memory takes the card's, as the inventory counts an allocation without consumed
capacity), between 1 MiB and the card's, in MiB; ``cores`` defaults to 0, HAMi's
"no core limit" (the card's time is shared), between 0 and 100 in whole percent.
Without it the devices are whole cards.

Left out, each with its reason (:attr:`Offer.left_out`): unhealthy cards, cards
in MIG mode (gpuslice makes MIG instances only at the device plugin's Allocate;
the instances of a statically partitioned card stay with the static MIG device
plugins, :mod:`gpuslice_deviceplugin.static_mig`, which need no ledger: a MIG
instance is never offered on both paths, and the inventory's prepare maps a
device only to a card of the ledger), and a card whose UUID makes no device name.

A slice holds at most 128 devices (the API's limit); a node with more publishes
several slices of the pool, each naming the count. Every write of the pool
carries a higher ``pool.generation``; :class:`SlicePublisher` makes the API
server's slices of this node match the inventory, retrying with backoff, and
deletes this node's slices that are no longer wanted. It never touches a slice of
another node or driver; a slice of another's that holds one of this node's names
(:func:`slice_name`) keeps the node from publishing, and is logged as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpuslice_common.dra import API_VERSION, CORES, DRIVER, MEMORY, device_name
from gpuslice_common.kube import Conflict, KubeApi, KubeError, NotFound, ObjectRef
from gpuslice_common.models import GpuDevice, NodeInventory, VgpuMode

log = logging.getLogger(__name__)

RESOURCE: Final = ObjectRef(API_VERSION, "resourceslices")
KIND: Final = "ResourceSlice"
# the label the node's slices carry, for listing them (the node's name where it
# is a valid label value, else a digest of it)
NODE_LABEL: Final = "gpuslice.io/node"
MAX_DEVICES_PER_SLICE: Final = 128  # ResourceSliceSpec.devices: "Must not have more than 128"
MAX_ATTRIBUTE_LENGTH: Final = 64  # DeviceAttribute.string: "Must not be longer than 64"
MAX_NAME: Final = 253  # a DNS subdomain
MAX_SLICE_INDEX: Final = 999  # the policy's bound: -1 ... -999 after the first
# the longest node name whose every slice name fits
MAX_NODE_NAME: Final = MAX_NAME - len(f"-{DRIVER}-{MAX_SLICE_INDEX}")
MIB: Final = 1 << 20
WHOLE_CARD_CORES: Final = 100

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))
_DECIMAL = (("E", 18), ("P", 15), ("T", 12), ("G", 9), ("M", 6), ("k", 3))


def binary_quantity(value: int) -> str:
    """``value`` as a Quantity in its canonical binary form (``80Gi``, ``1536Mi``),
    as the API server writes it back."""
    for suffix, shift in _BINARY:
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def decimal_quantity(value: int) -> str:
    """``value`` as a Quantity in its canonical decimal form (``100``, ``1k``)."""
    for suffix, exponent in _DECIMAL:
        if value and value % 10**exponent == 0:
            return f"{value // 10**exponent}{suffix}"
    return str(value)


def _digest(text: str, length: int = 12) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def slice_name(node: str, index: int = 0) -> str:
    """The name of the node's ``index``-th slice: ``<node>-gpu.gpuslice.io``, then
    ``...-1``, ``...-2`` up to ``...-999``. The admission policy
    gpuslice-agent-writes-its-own-slice (k8s/dra) lets an agent create only these
    names of its own node, so no node takes another's name first. ValueError
    for a name that does not fit a ResourceSlice's (:func:`check_node_name`)."""
    if not 0 <= index <= MAX_SLICE_INDEX:
        raise ValueError(f"slice index {index} of node {node!r} is not in 0..{MAX_SLICE_INDEX}")
    name = f"{node}-{DRIVER}" + (f"-{index}" if index else "")
    if len(name) > MAX_NAME:
        raise ValueError(
            f"node name {node!r} is {len(node)} characters: its ResourceSlice names "
            f"(<node>-{DRIVER}-<n>) must fit {MAX_NAME}, so DRA mode needs node names "
            f"of at most {MAX_NODE_NAME} characters"
        )
    return name


def check_node_name(node: str) -> None:
    """ValueError when one of ``node``'s slice names would not fit (a node name
    longer than :data:`MAX_NODE_NAME`): the agent cannot publish its slices."""
    slice_name(node, MAX_SLICE_INDEX)


def node_label(node: str) -> str:
    """The :data:`NODE_LABEL` value of ``node``'s slices."""
    return node if _LABEL_VALUE.fullmatch(node) else f"digest-{_digest(node, 32)}"


@dataclass(frozen=True)
class Offer:
    """The devices a node's pool offers, and the cards left out with why."""

    devices: tuple[dict[str, Any], ...]
    left_out: tuple[tuple[str, str], ...] = ()  # (card UUID, reason)


def _attributes(card: GpuDevice) -> dict[str, dict[str, Any]]:
    attributes: dict[str, dict[str, Any]] = {
        "uuid": {"string": card.uuid[:MAX_ATTRIBUTE_LENGTH]},
        "model": {"string": card.model[:MAX_ATTRIBUTE_LENGTH]},
        "index": {"int": card.index},
        "vendor": {"string": card.vendor},
        "mode": {"string": card.mode.value},
    }
    if card.numa is not None:
        attributes["numa"] = {"int": card.numa}
    return attributes


def _memory(total_bytes: int, consumable: bool) -> dict[str, Any]:
    capacity: dict[str, Any] = {"value": binary_quantity(total_bytes)}
    if consumable:
        policy: dict[str, Any] = {"default": binary_quantity(total_bytes)}
        if total_bytes >= 2 * MIB:  # the API wants min + step within the capacity
            policy["validRange"] = {
                "min": binary_quantity(MIB),
                "max": binary_quantity(total_bytes),
                "step": binary_quantity(MIB),
            }
        capacity["requestPolicy"] = policy
    return capacity


def _cores(total: int, consumable: bool) -> dict[str, Any]:
    capacity: dict[str, Any] = {"value": decimal_quantity(total)}
    if consumable:
        policy: dict[str, Any] = {"default": "0"}
        if total >= 1:
            policy["validRange"] = {
                "min": "0",
                "max": decimal_quantity(min(total, WHOLE_CARD_CORES)),
                "step": "1",
            }
        capacity["requestPolicy"] = policy
    return capacity


def card_device(inventory: NodeInventory, card: GpuDevice, *, consumable: bool) -> dict[str, Any]:
    """The slice's device for one card of ``inventory`` (ValueError: no device name)."""
    capacity = inventory.capacity(card)
    device: dict[str, Any] = {
        "name": device_name(card.uuid),
        "attributes": _attributes(card),
        "capacity": {
            MEMORY: _memory(capacity.memory_mib * MIB, consumable),
            CORES: _cores(capacity.cores, consumable),
        },
    }
    if consumable:
        device["allowMultipleAllocations"] = True
    return device


def offer(inventory: NodeInventory, *, consumable: bool) -> Offer:
    """What the node's pool offers (see the module's docstring), in card index order."""
    devices: list[dict[str, Any]] = []
    left_out: list[tuple[str, str]] = []
    for card in sorted(inventory.devices, key=lambda d: d.index):
        if not card.healthy:
            left_out.append((card.uuid, "unhealthy"))
        elif card.mode is VgpuMode.MIG:
            left_out.append((card.uuid, "in MIG mode: gpuslice makes its instances at Allocate"))
        elif card.mig:
            left_out.append(
                (card.uuid, "statically MIG-partitioned: its instances stay with the device plugin")
            )
        else:
            try:
                devices.append(card_device(inventory, card, consumable=consumable))
            except ValueError as exc:
                left_out.append((card.uuid, str(exc)))
    return Offer(tuple(devices), tuple(left_out))


def resource_slices(
    inventory: NodeInventory, *, consumable: bool, generation: int
) -> list[dict[str, Any]]:
    """The node's ResourceSlices: one per :data:`MAX_DEVICES_PER_SLICE` devices (one
    with none when the node offers none), all of pool generation ``generation``."""
    devices = offer(inventory, consumable=consumable).devices
    return _slices(inventory.node, devices, generation)


def _slices(node: str, devices: Sequence[dict[str, Any]], generation: int) -> list[dict[str, Any]]:
    parts = [
        list(devices[i : i + MAX_DEVICES_PER_SLICE])
        for i in range(0, len(devices), MAX_DEVICES_PER_SLICE)
    ] or [[]]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": slice_name(node, i), "labels": {NODE_LABEL: node_label(node)}},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": generation, "resourceSliceCount": len(parts)},
                "devices": part,
            },
        }
        for i, part in enumerate(parts)
    ]


def _content(spec: Mapping[str, Any]) -> Any:
    """A slice's spec without the pool's generation, for comparing two."""
    pool = dict(spec.get("pool") or {})
    pool.pop("generation", None)
    return {**spec, "pool": pool}


def _generation(obj: Mapping[str, Any]) -> int:
    value = ((obj.get("spec") or {}).get("pool") or {}).get("generation")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


FIRST_RETRY_S: Final = 1.0
LAST_RETRY_S: Final = 60.0
RESYNC_S: Final = 300.0


@dataclass
class SlicePublisher:
    """Keeps this node's ResourceSlices equal to what ``inventory()`` offers.

    :meth:`sync` makes one pass; :meth:`run` calls it every ``interval`` seconds
    (a pass that finds nothing changed since the last write asks nothing of the
    API server, except every ``resync`` seconds, when it reads the slices back and
    repairs what someone changed), and after a failure again after a backoff.
    """

    kube: KubeApi
    node: str
    inventory: Callable[[], NodeInventory]
    consumable: bool
    interval: float = 5.0
    resync: float = RESYNC_S
    first_retry: float = FIRST_RETRY_S
    last_retry: float = LAST_RETRY_S
    generation: int | None = None  # the pool's, as last written or found
    published: asyncio.Event = field(default_factory=asyncio.Event)  # set once written
    failures: int = 0  # passes that failed, in all
    _written: Any = None  # the content of the last write (or of what was found equal)
    _stale: bool = True  # read the API server's slices back at the next pass
    _told: set[tuple[str, str]] = field(default_factory=set)  # reasons logged
    _squatted: set[str] = field(default_factory=set)  # names found taken, logged

    async def sync(self) -> bool:
        """One pass; True when it wrote. Raises :class:`KubeError` (nothing is
        assumed written: the next pass reads the slices again)."""
        inventory = self.inventory()
        found = offer(inventory, consumable=self.consumable)
        self._tell(found.left_out)
        wanted = _slices(self.node, found.devices, 0)
        content = [(s["metadata"]["name"], _content(s["spec"])) for s in wanted]
        if content == self._written and not self._stale:
            return False
        try:
            wrote = await self._apply(wanted, content)
        except BaseException:
            self._stale = True
            raise
        self._written, self._stale = content, False
        self.published.set()
        return wrote

    async def _apply(self, wanted: list[dict[str, Any]], content: Any) -> bool:
        existing = {s["metadata"]["name"]: s for s in await self.mine()}
        generations = {_generation(s) for s in existing.values()}
        held = sorted(
            (name, _content(s.get("spec") or {}), s.get("metadata", {}).get("labels"))
            for name, s in existing.items()
        )
        labels = wanted[0]["metadata"]["labels"]
        if len(generations) == 1 and held == sorted((n, c, labels) for n, c in content):
            self.generation = generations.pop()  # as wanted already (an agent restart)
            return False
        generation = max([self.generation or 0, *generations]) + 1
        for body in wanted:
            body["spec"]["pool"]["generation"] = generation
            name = body["metadata"]["name"]
            ref = RESOURCE.named(name)
            if name in existing:
                version = existing[name].get("metadata", {}).get("resourceVersion")
                body["metadata"]["resourceVersion"] = version
                await self.kube.replace_object(ref, body)
            else:
                await self._create(body)
        self.generation = generation
        for name in sorted(set(existing) - {b["metadata"]["name"] for b in wanted}):
            uid = existing[name].get("metadata", {}).get("uid") or ""
            with contextlib.suppress(NotFound):  # gone already
                await self.kube.delete_object(RESOURCE.named(name), uid=uid)
            log.info("deleted ResourceSlice %s, no longer of node %s's pool", name, self.node)
        log.info(
            "ResourceSlices of node %s at generation %d: %d device(s)",
            self.node,
            generation,
            sum(len(b["spec"]["devices"]) for b in wanted),
        )
        return True

    async def _create(self, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        try:
            await self.kube.create_object(RESOURCE, body)
        except Conflict:
            # a slice of this name that is not this node's (another driver's, or
            # written before the admission policies): the agent cannot delete it
            if name not in self._squatted:
                log.error(
                    "ResourceSlice %s, the name of node %s's slice, is taken by a slice that "
                    "is not this node's (%s): node %s's GPUs are not offered through DRA "
                    "until an administrator deletes it",
                    name,
                    self.node,
                    await self._describe(name),
                    self.node,
                )
                self._squatted.add(name)
            raise
        self._squatted.discard(name)

    async def _describe(self, name: str) -> str:
        """Who a slice of ``name`` says it is, for the log."""
        try:
            found = await self.kube.get_object(RESOURCE.named(name))
        except KubeError as exc:
            return f"not readable: {exc}"
        spec = found.get("spec") or {}
        return (
            f"driver {spec.get('driver')!r}, node {spec.get('nodeName')!r}, "
            f"pool {(spec.get('pool') or {}).get('name')!r}"
        )

    async def mine(self) -> list[dict[str, Any]]:
        """This node's slices of this driver as the API server has them."""
        listed = await self.kube.list_objects(
            RESOURCE, label_selector=f"{NODE_LABEL}={node_label(self.node)}"
        )
        return [
            s
            for s in listed
            if (s.get("spec") or {}).get("nodeName") == self.node
            and (s.get("spec") or {}).get("driver") == DRIVER
            and isinstance((s.get("metadata") or {}).get("name"), str)
        ]

    def _tell(self, left_out: Sequence[tuple[str, str]]) -> None:
        for uuid, reason in left_out:
            if (uuid, reason) not in self._told:
                log.warning("GPU %s not offered through DRA: %s", uuid, reason)
        self._told = set(left_out)

    async def run(self) -> None:
        """Pass after pass until cancelled."""
        loop = asyncio.get_running_loop()
        delay = self.first_retry
        next_resync = loop.time() + self.resync
        while True:
            if loop.time() >= next_resync:
                self._stale = True
                next_resync = loop.time() + self.resync
            try:
                await self.sync()
            except KubeError as exc:
                self.failures += 1
                log.warning(
                    "ResourceSlices of node %s not written (%s); again in %.0f s",
                    self.node,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.last_retry)
                continue
            delay = self.first_retry
            await asyncio.sleep(self.interval)


__all__ = [
    "KIND",
    "MAX_DEVICES_PER_SLICE",
    "MAX_NODE_NAME",
    "MAX_SLICE_INDEX",
    "NODE_LABEL",
    "RESOURCE",
    "Offer",
    "SlicePublisher",
    "binary_quantity",
    "card_device",
    "check_node_name",
    "decimal_quantity",
    "node_label",
    "offer",
    "resource_slices",
    "slice_name",
]
