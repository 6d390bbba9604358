"""The local stack in DRA mode: what Kubernetes' own controllers, kube-scheduler and
kubelet do with a pod's ResourceClaims, done against the dev API server.

* :func:`make_claims` is the resourceclaim controller: a ResourceClaim made from
  each ``resourceClaimTemplateName`` of the pod (named ``<pod>-<claim>-<suffix>``,
  owned by the pod), the names recorded in the pod's
  ``status.resourceClaimStatuses``; a claim named by ``resourceClaimName`` must
  exist;
* :func:`fits_on` is kube-scheduler's DRA filter on one node, :func:`allocate_on`
  its allocation there
  (:mod:`gpuslice_cli.dev.draalloc`, first fit on consumable capacity, with
  every other claim's allocation on the node counted), written back as the
  claim's ``status.allocation`` with the pod in ``status.reservedFor``;
* :func:`container_response` is what the container runtime makes of the CDI
  devices kubelet got from NodePrepareResources: the CDI specs in the node's CDI
  directory applied (environment, mounts, device nodes), in the device plugin
  API's shape so the driver runs the container as on the device-plugin path;
* :func:`release_claims` is the controller's cleanup after the pod: claims made
  from templates are deleted, those named by the pod lose their reservation.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuslice_cli.dev.draalloc import AllocationError, allocate
from gpuslice_common.dra import API_VERSION
from gpuslice_common.kube import Conflict, LocalKubeApi, NotFound, ObjectRef
from gpuslice_common.models import ClaimRef
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb

log = logging.getLogger(__name__)

CLAIMS = ObjectRef(API_VERSION, "resourceclaims")
TEMPLATES = ObjectRef(API_VERSION, "resourceclaimtemplates")
SLICES = ObjectRef(API_VERSION, "resourceslices")
CLASSES = ObjectRef(API_VERSION, "deviceclasses")
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
MAX_CDI_SPEC = 1 << 20


class DraError(Exception):
    """The pod's claims cannot be made, allocated or applied; the message says why."""


def uses_claims(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("spec") or {}).get("resourceClaims"))


async def make_claims(kube: LocalKubeApi, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's ResourceClaims, those of its templates made now (the
    resourceclaim controller); ``pod``'s status records their names."""
    meta = pod["metadata"]
    namespace = meta["namespace"]
    claims: list[dict[str, Any]] = []
    statuses: list[dict[str, str]] = []
    for entry in pod["spec"].get("resourceClaims") or []:
        name = entry.get("name")
        if entry.get("resourceClaimName"):
            ref = CLAIMS.in_namespace(namespace).named(str(entry["resourceClaimName"]))
            try:
                claims.append(await kube.get_object(ref))
            except NotFound:
                raise DraError(f"pod claim {name}: {ref} does not exist") from None
            continue
        template_name = entry.get("resourceClaimTemplateName")
        if not template_name:
            raise DraError(f"pod claim {name} names neither a claim nor a template")
        try:
            template = await kube.get_object(TEMPLATES.in_namespace(namespace).named(template_name))
        except NotFound:
            raise DraError(f"pod claim {name}: template {template_name} does not exist") from None
        spec = (template.get("spec") or {}).get("spec") or {}
        body = {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {
                "name": f"{meta['name']}-{name}-{secrets.token_hex(3)[:5]}",
                "namespace": namespace,
                "annotations": {POD_CLAIM_ANNOTATION: str(name)},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
        }
        made = await kube.create_object(CLAIMS.in_namespace(namespace), body)
        claims.append(made)
        statuses.append({"name": str(name), "resourceClaimName": made["metadata"]["name"]})
    if statuses:
        await kube.patch_pod_status(namespace, meta["name"], {"resourceClaimStatuses": statuses})
        pod.setdefault("status", {})["resourceClaimStatuses"] = statuses
    return claims


async def fits_on(kube: LocalKubeApi, claims: Sequence[dict[str, Any]], node: str) -> bool:
    """Can every one of ``claims`` be allocated on ``node`` (DynamicResources'
    filter)? Nothing is written."""
    return await _plan(kube, claims, node) is not None


async def _plan(
    kube: LocalKubeApi, claims: Sequence[dict[str, Any]], node: str
) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
    """Each claim with its allocation on ``node``, or None when they do not all
    fit; a claim allocated already fits only on the node of its devices."""
    slices = [
        s for s in await kube.list_objects(SLICES) if (s.get("spec") or {}).get("nodeName") == node
    ]
    classes = {c["metadata"]["name"]: c for c in await kube.list_objects(CLASSES)}
    taken = [
        c["status"]["allocation"]
        for c in await kube.list_objects(CLAIMS)
        if (c.get("status") or {}).get("allocation")
    ]
    planned: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation")
        if allocation is not None:
            results = (allocation.get("devices") or {}).get("results") or []
            if any(r.get("pool") != node for r in results):
                return None
        else:
            try:
                allocation = allocate(claim, node, slices, taken, classes)
            except AllocationError as exc:
                raise DraError(f"claim {claim['metadata']['name']}: {exc}") from None
            if allocation is None:
                return None
            taken.append(allocation)
        planned.append((claim, allocation))
    return planned


async def allocate_on(
    kube: LocalKubeApi, pod: Mapping[str, Any], claims: Sequence[dict[str, Any]], node: str
) -> list[dict[str, Any]] | None:
    """Allocate every one of ``claims`` on ``node`` and reserve them for ``pod``:
    the claims as stored, or None (nothing written) when they do not all fit."""
    planned = await _plan(kube, claims, node)
    if planned is None:
        return None
    meta = pod["metadata"]
    stored = []
    for claim, allocation in planned:
        status = dict(claim.get("status") or {})
        status["allocation"] = allocation
        reserved = [r for r in status.get("reservedFor") or [] if r.get("uid") != meta["uid"]]
        reserved.append({"resource": "pods", "name": meta["name"], "uid": meta["uid"]})
        status["reservedFor"] = reserved
        ref = CLAIMS.in_namespace(claim["metadata"]["namespace"]).named(claim["metadata"]["name"])
        try:
            body = {**claim, "status": status}
            stored.append(await kube.replace_object(ref, body, subresource="status"))
        except Conflict as exc:
            raise DraError(f"claim {claim['metadata']['name']} changed meanwhile: {exc}") from None
    return stored


def claim_refs(claims: Sequence[Mapping[str, Any]]) -> list[ClaimRef]:
    return [
        ClaimRef(
            namespace=c["metadata"]["namespace"],
            name=c["metadata"]["name"],
            uid=c["metadata"]["uid"],
        )
        for c in claims
    ]


def container_cdi_ids(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    claims: Sequence[Mapping[str, Any]],
    prepared: Mapping[str, Sequence[tuple[str, Sequence[str]]]],
) -> list[str]:
    """The CDI device IDs kubelet gives ``container``: those of the prepared
    devices of each claim it references (of the named request, or all).
    ``prepared``: claim UID -> (request name, CDI IDs) per device."""
    by_pod_claim: dict[str, Mapping[str, Any]] = {}
    statuses = {
        s.get("name"): s.get("resourceClaimName")
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    for entry in pod["spec"].get("resourceClaims") or []:
        claim_name = entry.get("resourceClaimName") or statuses.get(entry.get("name"))
        for claim in claims:
            if claim["metadata"]["name"] == claim_name:
                by_pod_claim[str(entry.get("name"))] = claim
    ids: list[str] = []
    for ref in (container.get("resources") or {}).get("claims") or []:
        referenced = by_pod_claim.get(str(ref.get("name")))
        if referenced is None:
            continue
        wanted = ref.get("request")
        for request, cdi in prepared.get(referenced["metadata"]["uid"], ()):
            if not wanted or request.split("/", 1)[0] == wanted:
                ids.extend(i for i in cdi if i not in ids)
    return ids


def container_response(cdi_dir: Path, ids: Sequence[str]) -> pb.ContainerAllocateResponse | None:
    """The container edits of the CDI devices ``ids`` (``<kind>=<name>``) as found in
    the JSON specs of ``cdi_dir``, merged; None for no IDs. Raises DraError for an
    ID no spec defines, as the runtime refuses to start such a container."""
    if not ids:
        return None
    devices: dict[str, Mapping[str, Any]] = {}
    for path in sorted(cdi_dir.glob("*.json")):
        try:
            with path.open("rb") as spec_file:
                spec = json.loads(spec_file.read(MAX_CDI_SPEC))
        except (OSError, ValueError) as exc:
            log.warning("CDI spec %s unreadable: %s", path, exc)
            continue
        kind = spec.get("kind") if isinstance(spec, dict) else None
        for device in (spec.get("devices") or []) if isinstance(kind, str) else []:
            devices[f"{kind}={device.get('name')}"] = device.get("containerEdits") or {}
    response = pb.ContainerAllocateResponse()
    for cdi_id in ids:
        edits = devices.get(cdi_id)
        if edits is None:
            raise DraError(f"CDI device {cdi_id} is in no spec of {cdi_dir}")
        for item in edits.get("env") or []:
            key, _, value = str(item).partition("=")
            response.envs[key] = value
        for mount in edits.get("mounts") or []:
            response.mounts.append(
                pb.Mount(
                    container_path=str(mount.get("containerPath")),
                    host_path=str(mount.get("hostPath")),
                    read_only="ro" in (mount.get("options") or []),
                )
            )
        for device_node in edits.get("deviceNodes") or []:
            device_path = str(device_node.get("path"))
            response.devices.append(
                pb.DeviceSpec(
                    container_path=device_path,
                    host_path=str(device_node.get("hostPath") or device_path),
                    permissions=str(device_node.get("permissions") or "rw"),
                )
            )
    return response


async def release_claims(kube: LocalKubeApi, pod: Mapping[str, Any]) -> None:
    """After the pod: the claims made for it deleted, those it named unreserved."""
    meta = pod["metadata"]
    for claim in await kube.list_objects(CLAIMS.in_namespace(meta["namespace"])):
        ref = CLAIMS.in_namespace(meta["namespace"]).named(claim["metadata"]["name"])
        owners = claim["metadata"].get("ownerReferences") or []
        try:
            if any(o.get("uid") == meta["uid"] for o in owners):
                await kube.delete_object(ref, uid=claim["metadata"]["uid"])
                continue
            status = claim.get("status") or {}
            reserved = status.get("reservedFor") or []
            if any(r.get("uid") == meta["uid"] for r in reserved):
                kept = [r for r in reserved if r.get("uid") != meta["uid"]]
                status = {**status, "reservedFor": kept}
                if not kept:  # the allocation goes with the last consumer
                    status.pop("allocation", None)
                await kube.replace_object(ref, {**claim, "status": status}, subresource="status")
        except (NotFound, Conflict) as exc:
            log.warning("claim %s not released: %s", ref, exc)
