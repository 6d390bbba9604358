"""The AdmissionReview wire format (admission.k8s.io v1 and v1beta1).

:func:`parse_review` reads a request body; :func:`answer` writes the response in
the version and kind the request came in, with ``response.uid`` equal to
``request.uid``. A body that is not an AdmissionReview with a request uid cannot
be answered as one: it raises :class:`ReviewError`, which the app turns into an
HTTP 400 naming what is wrong.

The pydantic models at the end describe the body for the OpenAPI document only;
requests are read by hand, which is faster and lets every problem be named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from gpuslice_webhook.patch import Patch

VERSIONS: Final = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
KIND: Final = "AdmissionReview"
MAX_WARNINGS: Final = 16
MAX_WARNING_LENGTH: Final = 256  # the API server may cut longer ones
MAX_MESSAGE_LENGTH: Final = 1024


class ReviewError(ValueError):
    """The body is not an AdmissionReview request; the message says why."""


@dataclass(frozen=True)
class Review:
    """What admission reads from an AdmissionReview request."""

    api_version: str
    uid: str
    operation: str
    namespace: str
    dry_run: bool
    is_pod: bool  # kind Pod (core/v1)
    sub_resource: str  # "" for the pod itself, e.g. "ephemeralcontainers"
    pod: Mapping[str, Any] | None  # request.object when it is an object
    old_pod: Mapping[str, Any] | None  # request.oldObject when it is an object


def _is_pod_kind(request: Mapping[str, Any]) -> bool:
    kind = request.get("kind")
    resource = request.get("resource")
    if isinstance(kind, Mapping) and "kind" in kind:
        return kind.get("group", "") == "" and kind.get("kind") == "Pod"
    if isinstance(resource, Mapping):
        return resource.get("group", "") == "" and resource.get("resource") == "pods"
    return False


def parse_review(body: bytes) -> Review:
    """Read an AdmissionReview request; raises ReviewError when it is not one."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ReviewError(f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ReviewError("the body must be a JSON object (an AdmissionReview)")
    version = doc.get("apiVersion")
    if version not in VERSIONS:
        raise ReviewError(f"apiVersion must be one of {', '.join(VERSIONS)}, got {version!r}")
    if doc.get("kind") != KIND:
        raise ReviewError(f"kind must be {KIND}, got {doc.get('kind')!r}")
    request = doc.get("request")
    if not isinstance(request, dict):
        raise ReviewError("request must be an object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ReviewError("request.uid must be a non-empty string")
    operation = request.get("operation")
    namespace = request.get("namespace")
    sub_resource = request.get("subResource")
    pod = request.get("object")
    old_pod = request.get("oldObject")
    return Review(
        api_version=version,
        uid=uid,
        operation=operation if isinstance(operation, str) else "",
        namespace=namespace if isinstance(namespace, str) else "",
        dry_run=request.get("dryRun") is True,
        is_pod=_is_pod_kind(request),
        sub_resource=sub_resource if isinstance(sub_resource, str) else "",
        pod=pod if isinstance(pod, dict) else None,
        old_pod=old_pod if isinstance(old_pod, dict) else None,
    )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def answer(
    review: Review,
    *,
    patch: Patch | None = None,
    warnings: Sequence[str] = (),
    denial: tuple[int, str, str] | None = None,
) -> bytes:
    """The AdmissionReview response; ``denial`` is (code, reason, message)."""
    response: dict[str, Any] = {"uid": review.uid, "allowed": denial is None}
    if denial is not None:
        code, reason, message = denial
        response["status"] = {
            "code": code,
            "reason": reason,
            "message": _clip(message, MAX_MESSAGE_LENGTH),
        }
    elif patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = patch.encoded()
    if warnings:
        response["warnings"] = [_clip(w, MAX_WARNING_LENGTH) for w in warnings[:MAX_WARNINGS]]
    return orjson.dumps({"apiVersion": review.api_version, "kind": KIND, "response": response})


# ---------------------------------------------------------------- OpenAPI description


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class GroupVersionKind(_Open):
    group: str = ""
    version: str = "v1"
    kind: str = "Pod"


class GroupVersionResource(_Open):
    group: str = ""
    version: str = "v1"
    resource: str = "pods"


class ResourceRequirements(_Open):
    limits: dict[str, str | int] | None = None
    requests: dict[str, str | int] | None = None


class EnvVar(_Open):
    name: str
    value: str | None = None


class Container(_Open):
    name: str
    image: str | None = None
    resources: ResourceRequirements | None = None
    env: list[EnvVar] | None = None


class PodSpec(_Open):
    containers: list[Container]
    initContainers: list[Container] | None = None  # the wire's names are camelCase
    schedulerName: str | None = None
    nodeName: str | None = None


class ObjectMeta(_Open):
    name: str | None = None
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class Pod(_Open):
    apiVersion: Literal["v1"] = "v1"
    kind: Literal["Pod"] = "Pod"
    metadata: ObjectMeta | None = None
    spec: PodSpec


class AdmissionRequest(_Open):
    uid: str = Field(min_length=1)
    kind: GroupVersionKind
    resource: GroupVersionResource
    subResource: str | None = None
    name: str | None = None
    namespace: str | None = None
    operation: Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]
    userInfo: dict[str, Any] | None = None
    object: Pod | None = None
    oldObject: dict[str, Any] | None = None
    dryRun: bool | None = None
    options: dict[str, Any] | None = None


class AdmissionReviewRequest(_Open):
    apiVersion: Literal["admission.k8s.io/v1", "admission.k8s.io/v1beta1"]
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest


class Status(BaseModel):
    code: int
    reason: str
    message: str


class AdmissionResponse(BaseModel):
    uid: str
    allowed: bool
    patchType: Literal["JSONPatch"] | None = None
    patch: str | None = None
    status: Status | None = None
    warnings: list[str] | None = None


class AdmissionReviewResponse(BaseModel):
    apiVersion: Literal["admission.k8s.io/v1", "admission.k8s.io/v1beta1"]
    kind: Literal["AdmissionReview"]
    response: AdmissionResponse


class Problem(BaseModel):
    """The answer to a body that is not an AdmissionReview."""

    error: str
