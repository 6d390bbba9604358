"""DRA: what a prepared ResourceClaim grants, read from the API server's objects.

A node's agent asks the inventory to prepare a claim kubelet named (namespace,
name, uid). The agent may lie, so nothing it says is taken: the inventory reads
the ResourceClaim and the pod it is reserved for from the API server itself and
:func:`claim_placement` checks them against the node the request's subject names
and the node's cards as the ledger holds them. It fails closed: anything it
cannot read or that does not add up raises :class:`ClaimRefused` naming the
field and what is wrong, and nothing is recorded.

A node may ask about any claim, so whether the claim is this node's is settled
first: the claim exists with the uid kubelet named, is allocated in this node's
pool (and node selector) and reserved for one pod bound to this node. Until it
is, every refusal is :class:`NotOnNode`, one message that repeats only what the
node sent (what was wrong goes to the inventory's log, never to the node): a
node learns nothing of other nodes' or tenants' claims by guessing names or
uids. Once the claim is the node's, refusals name what is wrong.

What it checks:

* the claim is the one kubelet named (a claim deleted and made again under the
  same name has another uid), and kube-scheduler allocated it;
* every result of driver :data:`~gpuslice_common.dra.DRIVER` (other drivers'
  results are theirs) lies in this node's pool, names one of this node's cards
  by its UUID-derived name, and consumes a share that parses and fits the card
  (``consumedCapacity`` memory in bytes, rounded up to MiB, and cores in percent;
  none given: the whole card); no admin access;
* the allocation's node selector, when there is one, selects this node by name
  and no other;
* the claim is reserved for exactly one consumer, a pod, and it is the pod given,
  bound to this node and not ended;
* each device goes to exactly one of the pod's containers (those whose
  ``resources.claims`` name the pod's entry for this claim, with or without a
  request), so that each container's grant is its own; a device no container
  uses is refused too, and so is a pod with a second gpuslice claim (the ledger
  keeps one placement per pod).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from gpuslice_common.dra import CORES, DRIVER, MEMORY, card_of, device_name
from gpuslice_common.kube import TERMINATED_PHASES
from gpuslice_common.models import (
    ClaimRef,
    ContainerAssignment,
    DeviceGrant,
    GpuState,
    Placement,
    PodRef,
    VgpuMode,
)
from gpuslice_common.nodeapi import MAX_DEVICES, ClaimDevice
from gpuslice_common.requests import RequestError, parse_quantity

POLICY = "dra"  # Placement.policy of a prepared claim
MIB = 1024 * 1024
MAX_CORES = 100
_SHOWN = 80  # characters of a value a reason quotes


class ClaimRefused(Exception):
    """The claim cannot be prepared on this node; ``reason`` (the node's answer)
    says what is wrong, ``detail`` (for the inventory's log) too."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or reason


def not_on_node(named: ClaimRef, node: str) -> str:
    """The one answer to a claim that is not (or cannot be shown to be) the node's."""
    return f"claim {named} is not allocated on node {node}"


class NotOnNode(ClaimRefused):
    """The claim is not shown to be this node's: the answer names only the claim
    as the node named it and the node; ``detail`` says why, for the log."""

    def __init__(self, named: ClaimRef, node: str, detail: str) -> None:
        super().__init__(not_on_node(named, node), detail)


@contextmanager
def _on_node(named: ClaimRef, node: str) -> Iterator[None]:
    """Refusals within become :class:`NotOnNode`."""
    try:
        yield
    except NotOnNode:
        raise
    except ClaimRefused as exc:
        raise NotOnNode(named, node, exc.detail) from None


@dataclass(frozen=True)
class PreparedClaim:
    """What preparing the claim records (``placement``, keyed by the pod) and
    which of the claim's devices is whose (``devices``, in the results' order)."""

    placement: Placement
    devices: tuple[ClaimDevice, ...]


@dataclass(frozen=True)
class _Result:
    """One result of our driver: which request, which device, which card, what share."""

    request: str
    device: str
    uuid: str
    memory_mib: int
    cores: int

    @property
    def base_request(self) -> str:
        """The request's name without a firstAvailable subrequest."""
        return self.request.split("/", 1)[0]


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def _obj(value: object, where: str, *, required: bool = True) -> Mapping[str, Any]:
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        missing = "is missing" if value is None else f"is {_kind(value)}, not an object"
        raise ClaimRefused(f"{where} {missing}")
    return value


def _seq(value: object, where: str) -> Sequence[Any]:
    """An optional list: absent or null reads as empty."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ClaimRefused(f"{where} is {_kind(value)}, not a list")
    return value


def _str(value: object, where: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise ClaimRefused(f"{where} is {_shown(value)}, not a name")
    return value


def claim_placement(
    claim: Mapping[str, Any],
    pod: Mapping[str, Any],
    node: str,
    cards: Sequence[GpuState],
    named: ClaimRef,
    *,
    other_claims: Sequence[Mapping[str, Any]] = (),
) -> PreparedClaim:
    """The placement preparing ``claim`` records and its devices' owners.

    ``claim`` and ``pod`` are the objects as the API server sent them (the pod
    the claim's ``status.reservedFor`` names); ``node`` is the node the request's
    subject names; ``cards`` the node's cards as the ledger holds them
    (:meth:`~gpuslice_common.ledger.Ledger.node_gpus`); ``named`` the claim
    kubelet asked for; ``other_claims`` the pod's other ResourceClaims as read
    (one of them with a result of our driver is refused). Raises
    :class:`ClaimRefused` (:class:`NotOnNode` while the claim is not shown to
    be the node's)."""
    ref = named
    pod_ref = pod_on_node(claim, pod, node, named)
    _, allocation, _ = _claim_on_node(claim, node, named)
    _check_running(pod, pod_ref)
    results = _results(allocation, node, cards, ref)
    for other in other_claims:
        _check_other(other, ref, pod_ref)
    containers, owners = _assign(pod, ref, pod_ref, results)
    try:
        placement = Placement(
            pod=pod_ref,
            node=node,
            containers=containers,
            policy=POLICY,
            claim=ref,
        )
        devices = tuple(
            ClaimDevice(request=r.request, pool=node, device=r.device, uuid=r.uuid, container=owner)
            for r, owner in zip(results, owners, strict=True)
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "placement"
        raise ClaimRefused(f"claim {ref} makes no valid placement: {where}: {err['msg']}") from None
    return PreparedClaim(placement, devices)


def reserved_pod(claim: Mapping[str, Any], named: ClaimRef, node: str) -> str:
    """The name of the pod (in the claim's namespace) ``claim`` is reserved for,
    once the claim is found to be the one named, allocated on ``node`` (every
    result of our driver in its pool, the node selector naming it), with exactly
    one consumer, a pod. Raises :class:`NotOnNode`."""
    _, _, (name, _) = _claim_on_node(claim, node, named)
    return name


def pod_on_node(
    claim: Mapping[str, Any], pod: Mapping[str, Any], node: str, named: ClaimRef
) -> PodRef:
    """The pod ``claim`` is reserved for, once it is found to be allocated on
    ``node`` (:func:`reserved_pod`) and ``pod`` to be its consumer bound to
    ``node``: from here on the claim is the node's. Raises :class:`NotOnNode`."""
    status, _, _ = _claim_on_node(claim, node, named)
    with _on_node(named, node):
        return _check_pod(status, pod, node, named)


def _claim_on_node(
    claim: Mapping[str, Any], node: str, named: ClaimRef
) -> tuple[Mapping[str, Any], Mapping[str, Any], tuple[str, str]]:
    """The claim's status, allocation and consumer, once the claim is the one
    named and allocated on ``node``. Raises :class:`NotOnNode`."""
    with _on_node(named, node):
        ref = _claim_ref(claim, named)
        status, allocation = _allocated(claim, ref)
        _check_node_selector(allocation.get("nodeSelector"), node, ref)
        _check_pools(allocation, node, ref)
        consumer = _consumer(status, ref)
    return status, allocation, consumer


def _check_pools(allocation: Mapping[str, Any], node: str, ref: ClaimRef) -> None:
    """Every result of our driver lies in ``node``'s pool, and there is one."""
    devices = _obj(allocation.get("devices"), f"claim {ref}: status.allocation.devices")
    where = f"claim {ref}: status.allocation.devices.results"
    ours = 0
    for i, result in enumerate(_seq(devices.get("results"), where)):
        at = f"{where}[{i}]"
        result = _obj(result, at)
        if result.get("driver") != DRIVER:
            continue
        ours += 1
        pool = _str(result.get("pool"), f"{at}.pool")
        if pool != node:
            device = result.get("device")
            raise ClaimRefused(
                f"{at}: device {_shown(device)} is in pool {_shown(pool)}, not {node}"
            )
    if not ours:
        raise ClaimRefused(f"claim {ref} allocates no device of driver {DRIVER}")


def claim_names(pod: Mapping[str, Any]) -> list[str]:
    """The names of the ResourceClaims the pod's ``spec.resourceClaims`` resolve to
    (directly, or made from a template as its status says); what cannot be read
    is left out (:func:`claim_placement` refuses it)."""
    try:
        spec = _obj(pod.get("spec"), "pod")
        made = _made(_obj(pod.get("status"), "pod", required=False), "pod")
        names = []
        for entry in _seq(spec.get("resourceClaims"), "pod"):
            if isinstance(entry, Mapping):
                direct = entry.get("resourceClaimName")
                name = entry.get("name")
                resolved = direct if isinstance(direct, str) else made.get(str(name))
                if isinstance(resolved, str) and resolved:
                    names.append(resolved)
        return names
    except ClaimRefused:
        return []


def _allocated(
    claim: Mapping[str, Any], ref: ClaimRef
) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The claim's status and its allocation; refused when not allocated."""
    status = _obj(claim.get("status"), f"claim {ref}: status")
    allocation = status.get("allocation")
    if allocation is None:
        raise ClaimRefused(f"claim {ref} is not allocated (status.allocation is missing)")
    return status, _obj(allocation, f"claim {ref}: status.allocation")


def _claim_ref(claim: Mapping[str, Any], named: ClaimRef) -> ClaimRef:
    if not isinstance(claim, Mapping):
        raise ClaimRefused(f"claim {named}: the API server sent {_kind(claim)}, not an object")
    metadata = _obj(claim.get("metadata"), f"claim {named}: metadata")
    uid = metadata.get("uid")
    if uid != named.uid:
        raise ClaimRefused(
            f"claim {named.namespace}/{named.name} was replaced: its uid is {_shown(uid)}, "
            f"not {named.uid}"
        )
    if metadata.get("namespace") != named.namespace or metadata.get("name") != named.name:
        raise ClaimRefused(
            f"claim {named}: the API server sent "
            f"{_shown(metadata.get('namespace'))}/{_shown(metadata.get('name'))}"
        )
    return named


def _check_node_selector(selector: object, node: str, ref: ClaimRef) -> None:
    """An allocation's node selector, when present, must pin this node by name:
    every term has ``matchFields`` ``metadata.name In [node]``."""
    if selector is None:
        return
    where = f"claim {ref}: status.allocation.nodeSelector"
    terms = _seq(_obj(selector, where).get("nodeSelectorTerms"), f"{where}.nodeSelectorTerms")
    if not terms:
        raise ClaimRefused(f"{where} has no terms")
    for i, term in enumerate(terms):
        at = f"{where}.nodeSelectorTerms[{i}]"
        fields = _seq(_obj(term, at).get("matchFields"), f"{at}.matchFields")
        names = [
            req.get("values")
            for req in fields
            if isinstance(req, Mapping)
            and req.get("key") == "metadata.name"
            and req.get("operator") == "In"
        ]
        if not names:
            raise ClaimRefused(f"{at} does not select node {node} by name")
        for values in names:
            if list(_seq(values, f"{at}.matchFields.values")) != [node]:
                raise ClaimRefused(f"{at} selects node(s) {_shown(values)}, not node {node}")


def _results(
    allocation: Mapping[str, Any], node: str, cards: Sequence[GpuState], ref: ClaimRef
) -> list[_Result]:
    devices = _obj(allocation.get("devices"), f"claim {ref}: status.allocation.devices")
    where = f"claim {ref}: status.allocation.devices.results"
    raw = _seq(devices.get("results"), where)
    by_uuid = {c.device.uuid: c for c in cards}
    uuids = list(by_uuid)
    results: list[_Result] = []
    for i, result in enumerate(raw):
        at = f"{where}[{i}]"
        result = _obj(result, at)
        if result.get("driver") != DRIVER:
            continue  # another driver's device: its own plugin prepares it
        if len(results) >= MAX_DEVICES:
            raise ClaimRefused(f"claim {ref} allocates more than {MAX_DEVICES} gpuslice devices")
        request = _str(result.get("request"), f"{at}.request")
        pool = _str(result.get("pool"), f"{at}.pool")
        device = _str(result.get("device"), f"{at}.device")
        if pool != node:
            raise ClaimRefused(
                f"{at}: device {_shown(device)} is in pool {_shown(pool)}, not {node}"
            )
        if result.get("adminAccess") not in (None, False):
            raise ClaimRefused(f"{at}: admin access to gpuslice devices is not granted")
        uuid = card_of(device, uuids)
        if uuid is None:
            raise ClaimRefused(f"device {_shown(device)} is not a card of node {node}")
        if device != device_name(uuid):
            raise ClaimRefused(
                f"{at}: device {device} is a MIG instance; gpuslice grants cards and shares of them"
            )
        card = by_uuid[uuid]
        if card.device.mode is VgpuMode.MIG:
            raise ClaimRefused(f"{at}: card {uuid} of node {node} is shared through MIG, not DRA")
        if not card.present:
            raise ClaimRefused(f"{at}: card {uuid} is no longer present on node {node}")
        memory, cores = _consumed(result.get("consumedCapacity"), card, at)
        results.append(_Result(request, device, uuid, memory, cores))
    if not results:
        raise ClaimRefused(f"claim {ref} allocates no device of driver {DRIVER}")
    return results


def _consumed(value: object, card: GpuState, at: str) -> tuple[int, int]:
    """(memory MiB, cores percent) a result takes on ``card``; none given: the whole card."""
    whole = card.capacity.memory_mib
    if value is None:
        return whole, MAX_CORES
    capacity = _obj(value, f"{at}.consumedCapacity")
    memory, cores = whole, MAX_CORES
    if MEMORY in capacity:
        where = f"{at}.consumedCapacity.{MEMORY}"
        amount = _quantity(capacity[MEMORY], where)
        if amount != amount.to_integral_value():
            raise ClaimRefused(
                f"{where} is {_shown(capacity[MEMORY])}: not a whole number of bytes"
            )
        if amount <= 0:
            raise ClaimRefused(f"{where} is {_shown(capacity[MEMORY])}: not above 0")
        memory = math.ceil(amount / MIB)
        if memory > whole:
            raise ClaimRefused(
                f"{where} is {_shown(capacity[MEMORY])} ({memory} MiB), more than card "
                f"{card.device.uuid} has ({whole} MiB)"
            )
    if CORES in capacity:
        where = f"{at}.consumedCapacity.{CORES}"
        amount = _quantity(capacity[CORES], where)
        if amount != amount.to_integral_value() or not 0 <= amount <= MAX_CORES:
            raise ClaimRefused(
                f"{where} is {_shown(capacity[CORES])}: not a whole percent from 0 to {MAX_CORES}"
            )
        cores = int(amount)
    return memory, cores


def _quantity(value: object, where: str) -> Decimal:
    if not isinstance(value, str):
        raise ClaimRefused(f"{where} is {_kind(value)}, not a quantity string")
    try:
        return parse_quantity(value)
    except RequestError as exc:
        raise ClaimRefused(f"{where}: {exc}") from None


def _consumer(status: Mapping[str, Any], ref: ClaimRef) -> tuple[str, str]:
    """(name, uid) of the claim's one consumer, which must be a pod."""
    where = f"claim {ref}: status.reservedFor"
    consumers = _seq(status.get("reservedFor"), where)
    if len(consumers) != 1:
        raise ClaimRefused(f"{where} names {len(consumers)} consumers, not exactly one pod")
    consumer = _obj(consumers[0], f"{where}[0]")
    if consumer.get("resource") != "pods" or consumer.get("apiGroup", "") not in ("", None):
        raise ClaimRefused(
            f"{where}[0] is {_shown(consumer.get('apiGroup'))}/{_shown(consumer.get('resource'))}, "
            "not a pod"
        )
    uid = _str(consumer.get("uid"), f"{where}[0].uid")
    name = _str(consumer.get("name"), f"{where}[0].name")
    return name, uid


def _check_pod(
    status: Mapping[str, Any], pod: Mapping[str, Any], node: str, ref: ClaimRef
) -> PodRef:
    """The pod the claim is reserved for, checked: the one and only consumer, bound here."""
    where = f"claim {ref}: status.reservedFor"
    name, uid = _consumer(status, ref)
    if not isinstance(pod, Mapping):
        raise ClaimRefused(f"pod {ref.namespace}/{name}: the API server sent {_kind(pod)}")
    metadata = _obj(pod.get("metadata"), f"pod {ref.namespace}/{name}: metadata")
    if metadata.get("uid") != uid:
        raise ClaimRefused(
            f"claim {ref} is reserved for pod {name} ({uid}), but that pod's uid is "
            f"{_shown(metadata.get('uid'))}"
        )
    if metadata.get("name") != name or metadata.get("namespace") != ref.namespace:
        raise ClaimRefused(
            f"claim {ref} is reserved for pod {ref.namespace}/{name}, not "
            f"{_shown(metadata.get('namespace'))}/{_shown(metadata.get('name'))}"
        )
    spec = _obj(pod.get("spec"), f"pod {ref.namespace}/{name}: spec")
    if spec.get("nodeName") != node:
        raise ClaimRefused(
            f"pod {ref.namespace}/{name} is bound to {_shown(spec.get('nodeName'))}, "
            f"not node {node}"
        )
    try:
        return PodRef(uid=uid, namespace=ref.namespace, name=name)
    except ValidationError:
        raise ClaimRefused(f"{where}[0].uid is {_shown(uid)}, not a pod uid") from None


def _check_running(pod: Mapping[str, Any], pod_ref: PodRef) -> None:
    status = _obj(
        pod.get("status"), f"pod {pod_ref.namespace}/{pod_ref.name}: status", required=False
    )
    phase = status.get("phase")
    if phase in TERMINATED_PHASES:
        raise ClaimRefused(f"pod {pod_ref.namespace}/{pod_ref.name} has ended ({phase})")


def _pod_claim_names(pod: Mapping[str, Any], claim_name: str, who: str) -> set[str]:
    """The names of the pod's ``spec.resourceClaims`` entries that resolve to the
    claim named ``claim_name``: directly, or made from a template (the pod's
    ``status.resourceClaimStatuses`` says which claim)."""
    spec = _obj(pod.get("spec"), f"{who}: spec")
    made = _made(_obj(pod.get("status"), f"{who}: status", required=False), who)
    names: set[str] = set()
    for i, entry in enumerate(_seq(spec.get("resourceClaims"), f"{who}: spec.resourceClaims")):
        entry = _obj(entry, f"{who}: spec.resourceClaims[{i}]")
        name = _str(entry.get("name"), f"{who}: spec.resourceClaims[{i}].name")
        direct = entry.get("resourceClaimName")
        resolved = direct if isinstance(direct, str) and direct else made.get(name)
        if resolved == claim_name:
            names.add(name)
    return names


def _made(status: Mapping[str, Any], who: str) -> dict[str, str]:
    """Pod claim name -> the claim made for it from a template (the pod's status)."""
    made: dict[str, str] = {}
    where = f"{who}: status.resourceClaimStatuses"
    for i, entry in enumerate(_seq(status.get("resourceClaimStatuses"), where)):
        entry = _obj(entry, f"{where}[{i}]")
        name, claim = entry.get("name"), entry.get("resourceClaimName")
        if isinstance(name, str) and isinstance(claim, str):
            made[name] = claim
    return made


def _check_other(other: Mapping[str, Any], ref: ClaimRef, pod: PodRef) -> None:
    """Another claim of the pod: refused when it holds a device of our driver."""
    if not isinstance(other, Mapping):
        return
    metadata = other.get("metadata")
    if isinstance(metadata, Mapping) and metadata.get("uid") == ref.uid:
        return
    allocation = (
        (other.get("status") or {}).get("allocation")
        if isinstance(other.get("status"), Mapping)
        else None
    )
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if isinstance(results, list) and any(
        isinstance(r, Mapping) and r.get("driver") == DRIVER for r in results
    ):
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        raise ClaimRefused(
            f"pod {pod.namespace}/{pod.name} has claims {ref.name} and {_shown(name)} of "
            f"driver {DRIVER}: gpuslice prepares one ResourceClaim per pod"
        )


def _assign(
    pod: Mapping[str, Any], ref: ClaimRef, pod_ref: PodRef, results: list[_Result]
) -> tuple[tuple[ContainerAssignment, ...], list[str]]:
    """Each container using the claim with its grants, and each result's container."""
    who = f"pod {pod_ref.namespace}/{pod_ref.name}"
    claim_names = _pod_claim_names(pod, ref.name, who)
    if not claim_names:
        raise ClaimRefused(f"{who} has no spec.resourceClaims entry for claim {ref.name}")
    spec = _obj(pod.get("spec"), f"{who}: spec")
    owners: list[str | None] = [None] * len(results)
    assignments: list[ContainerAssignment] = []
    for field, init in (("initContainers", True), ("containers", False)):
        for i, container in enumerate(_seq(spec.get(field), f"{who}: spec.{field}")):
            at = f"{who}: spec.{field}[{i}]"
            container = _obj(container, at)
            name = _str(container.get("name"), f"{at}.name")
            resources = _obj(container.get("resources"), f"{at}.resources", required=False)
            taken: list[int] = []
            for j, use in enumerate(_seq(resources.get("claims"), f"{at}.resources.claims")):
                use = _obj(use, f"{at}.resources.claims[{j}]")
                if _str(use.get("name"), f"{at}.resources.claims[{j}].name") not in claim_names:
                    continue
                request = _str(
                    use.get("request"), f"{at}.resources.claims[{j}].request", required=False
                )
                mine = [
                    k
                    for k, r in enumerate(results)
                    if not request or request in (r.request, r.base_request)
                ]
                if not mine:
                    raise ClaimRefused(
                        f"container {name} of {who} uses request {request!r} of claim "
                        f"{ref.name}, which has no gpuslice device allocated"
                    )
                taken.extend(mine)
            if not taken:
                continue
            for k in taken:
                if owners[k] is not None and owners[k] != name:
                    raise ClaimRefused(
                        f"device {results[k].device} of claim {ref.name} is used by containers "
                        f"{owners[k]} and {name}: each device goes to one container"
                    )
                owners[k] = name
            grants: dict[str, DeviceGrant] = {}
            for k in dict.fromkeys(taken):
                r = results[k]
                if r.uuid in grants:
                    raise ClaimRefused(
                        f"container {name} of {who} would get card {r.uuid} twice "
                        f"(claim {ref.name}): one share per card and container"
                    )
                grants[r.uuid] = DeviceGrant(uuid=r.uuid, memory_mib=r.memory_mib, cores=r.cores)
            sidecar = init and container.get("restartPolicy") == "Always"
            assignments.append(
                ContainerAssignment(
                    name=name, init=init, sidecar=sidecar, devices=tuple(grants.values())
                )
            )
    for r, owner in zip(results, owners, strict=True):
        if owner is None:
            raise ClaimRefused(
                f"device {r.device} (request {r.request}) of claim {ref.name} is used by no "
                f"container of {who}"
            )
    return tuple(assignments), [o for o in owners if o is not None]


__all__ = [
    "POLICY",
    "ClaimRefused",
    "NotOnNode",
    "PreparedClaim",
    "claim_names",
    "claim_placement",
    "not_on_node",
    "pod_on_node",
    "reserved_pod",
]
