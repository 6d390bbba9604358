"""One admission review from body to answer.

Order of decisions for a pod being created:

1. no container asks for a GPU (none names a GPU resource, or only to ask for
   none: ``nvidia.com/gpu: 0``) -> allowed unchanged, as any pod without GPUs;
2. the pod, then its namespace, is labelled ``gpuslice.io/webhook: ignore`` or
   ``hami.io/webhook: ignore`` -> allowed unchanged;
3. :class:`~gpuslice_webhook.mutation.Mutator` checks the request and builds the patch
   (in DRA mode, ``GPUSLICE_DRA`` or the namespace's ``gpuslice.io/mode`` label,
   the patch references a ResourceClaimTemplate instead: see
   :mod:`gpuslice_webhook.claims`);
4. the namespace's GPU quotas are checked (translated pods keep their GPU
   resources: they count as in device-plugin mode);
5. DRA mode: a pod that also has a claim of its own on gpuslice's device class is
   refused; the template is created in the pod's namespace (not on a dry run),
   or one of its name found there must be gpuslice's and equal; any failure
   refuses the pod (503), which is never admitted half-translated;
6. ``pod.admitted`` or ``pod.denied`` is handed to the outbox (never awaited) and
   the answer goes back.

Ephemeral containers added to a GPU pod (``kubectl debug``) get its GPUs hidden
too. Other operations and other kinds are allowed unchanged. A failure to read
the namespace or its quotas within ``kube_timeout`` denies the pod with 503 and
publishes nothing (it says nothing about the pod); an unexpected error denies
it with 500 and is logged, never shown as a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import orjson

from gpuslice_common.config import WebhookSettings
from gpuslice_common.dra import DEVICE_CLASS
from gpuslice_common.events import EventError, EventType, PodAdmitted, PodDenied, make_event
from gpuslice_common.kube import Conflict, KubeApi, KubeError, NotFound
from gpuslice_common.models import PodRef
from gpuslice_common.requests import RequestError, asks_for_gpus, pod_ref
from gpuslice_webhook.claims import (
    CLAIM_NAME,
    CLAIMS,
    SLICES,
    TEMPLATES,
    CardSizes,
    ClaimTemplate,
    NeedCardSizes,
    card_sizes,
    claimed_classes,
    dra_mode,
    ours_and_equal,
)
from gpuslice_webhook.metrics import Metrics
from gpuslice_webhook.mutation import Denied, Mutation, Mutator, ignored
from gpuslice_webhook.namespaces import NamespaceCache
from gpuslice_webhook.quota import (
    Demand,
    QuotaLimit,
    check,
    gpu_limits,
    namespace_usage,
    request_demand,
)
from gpuslice_webhook.review import Review, ReviewError, answer, parse_review

if TYPE_CHECKING:
    from gpuslice_common.outbox import Outbox

log = logging.getLogger(__name__)

SOURCE: Final = "gpuslice/webhook"
EPHEMERAL: Final = "ephemeralcontainers"
UNAVAILABLE: Final = 503
T = TypeVar("T")


class Admission:
    """Answers AdmissionReview bodies; shared by every request the app serves."""

    def __init__(
        self,
        settings: WebhookSettings,
        metrics: Metrics,
        *,
        namespaces: NamespaceCache | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.namespaces = namespaces
        self.outbox = outbox
        self.mutator = Mutator(settings)

    async def handle(self, body: bytes) -> tuple[int, bytes]:
        """(HTTP status, body) for one request body."""
        started = time.perf_counter()
        try:
            review = parse_review(body)
        except ReviewError as exc:
            self._count("invalid", started)
            return 400, orjson.dumps({"error": str(exc)})
        try:
            outcome, reply = await self._review(review)
        except Exception as exc:  # a bug must not become a 500 with a traceback
            log.exception("admission review %s failed unexpectedly", review.uid)
            message = f"gpuslice webhook internal error ({type(exc).__name__}); see its log"
            outcome, reply = "error", answer(review, denial=(500, "InternalError", message))
        self._count(outcome, started)
        return 200, reply

    def _count(self, outcome: str, started: float) -> None:
        self.metrics.admissions.labels(outcome).inc()
        self.metrics.latency.observe(time.perf_counter() - started)

    async def _review(self, review: Review) -> tuple[str, bytes]:
        if review.is_pod and review.operation == "UPDATE" and review.sub_resource == EPHEMERAL:
            return self._ephemeral(review)
        if review.operation != "CREATE" or not review.is_pod or review.sub_resource:
            return "skipped", answer(review)
        pod = review.pod
        if pod is None:
            reply = answer(review, denial=(400, "BadRequest", "request.object must be the Pod"))
            return "denied", reply
        if not asks_for_gpus(pod, self.settings.requests):
            if self.settings.route_cpu_pods:
                return await self._route_cpu_pod(review, pod)
            return "skipped", answer(review)
        metadata = pod.get("metadata")
        metadata = metadata if isinstance(metadata, Mapping) else {}
        namespace = review.namespace or str(metadata.get("namespace") or "default")
        try:
            if ignored(metadata.get("labels")):
                return "ignored", answer(review)
            labels = await self._namespace_labels(namespace)
            if ignored(labels):
                return "ignored", answer(review)
            dra = dra_mode(self.settings.dra, labels)
            try:
                mutation = self.mutator.mutate(pod, namespace, dra=dra)
            except NeedCardSizes:
                sizes = await self._card_sizes()
                mutation = self.mutator.mutate(pod, namespace, dra=dra, sizes=sizes)
            if mutation is None:  # asks for no GPU after all (asks_for_gpus said it does)
                routed = self.mutator.route(pod) if self.settings.route_cpu_pods else None
                if routed is None:
                    return "skipped", answer(review)
                return "routed", answer(review, patch=routed)
            await self._check_quota(namespace, metadata, mutation)
            if mutation.template is not None:
                await self._own_claims(pod, namespace, mutation.template)
                await self._create_template(mutation.template, review.dry_run)
        except Denied as denied:
            reply = answer(review, denial=(denied.code, denied.reason, denied.message))
            if denied.code == UNAVAILABLE:  # not a decision about the pod: no event
                return "unavailable", reply
            if not review.dry_run:
                self._publish_denied(_ref(metadata, namespace, review.uid), denied.message)
            return "denied", reply
        if not review.dry_run:
            self._publish_admitted(mutation)
        return "admitted", answer(review, patch=mutation.patch, warnings=mutation.warnings)

    async def _route_cpu_pod(self, review: Review, pod: Mapping[str, Any]) -> tuple[str, bytes]:
        """A pod without GPUs goes to gpuslice's scheduler, under the rules a GPU
        pod's routing follows; nothing else of it changes and no event is sent.

        Nothing is refused here: where the namespace's labels cannot be read the
        pod is admitted unchanged (the default scheduler places it as it would
        without gpuslice), never routed against an ignore label."""
        metadata = pod.get("metadata")
        metadata = metadata if isinstance(metadata, Mapping) else {}
        namespace = review.namespace or str(metadata.get("namespace") or "default")
        if ignored(metadata.get("labels")):
            return "ignored", answer(review)
        try:
            if await self._namespace_ignored(namespace):
                return "ignored", answer(review)
        except Denied as denied:
            log.warning("pod without GPUs admitted unchanged: %s", denied.message)
            return "unavailable", answer(review)
        patch = self.mutator.route(pod)
        if patch is None:
            return "skipped", answer(review)
        return "routed", answer(review, patch=patch)

    def _ephemeral(self, review: Review) -> tuple[str, bytes]:
        """Debug containers added to a GPU pod get its GPUs hidden too."""
        if review.pod is None:
            return "skipped", answer(review)
        spec = (review.old_pod or {}).get("spec")
        old = spec.get("ephemeralContainers") if isinstance(spec, Mapping) else None
        existing = {
            c["name"]
            for c in old or ()
            if isinstance(c, Mapping) and isinstance(c.get("name"), str)
        }
        try:
            patch = self.mutator.hide_from_ephemeral(review.pod, {str(n) for n in existing})
        except Denied as denied:
            return "denied", answer(review, denial=(denied.code, denied.reason, denied.message))
        return ("admitted" if patch else "skipped"), answer(review, patch=patch)

    # ------------------------------------------------------------ the API server

    async def _within_deadline(self, read: Awaitable[T], what: str) -> T:
        """``read`` within the Kubernetes deadline; a failure or a timeout is Denied
        503 (NotFound and Conflict are the caller's to read)."""
        seconds = self.settings.kube_timeout.total_seconds()
        try:
            return await asyncio.wait_for(read, seconds)
        except (NotFound, Conflict):
            raise
        except KubeError as exc:
            raise _unavailable(f"cannot {what}: {exc}") from None
        except TimeoutError:
            message = f"cannot {what}: the Kubernetes API did not answer within {seconds:g}s"
            raise _unavailable(message) from None

    async def _namespace_ignored(self, namespace: str) -> bool:
        return ignored(await self._namespace_labels(namespace))

    async def _namespace_labels(self, namespace: str) -> dict[str, str]:
        if self.namespaces is None:
            return {}
        try:
            return await self._within_deadline(
                self.namespaces.labels(namespace), f"read namespace {namespace!r}"
            )
        except NotFound:
            return {}  # the API server refuses the pod itself

    # ------------------------------------------------------------ DRA mode

    def _kube(self, what: str) -> KubeApi:
        if self.namespaces is None:
            raise _unavailable(f"cannot {what}: DRA mode needs the Kubernetes API (kube_api)")
        return self.namespaces.kube

    async def _card_sizes(self) -> CardSizes:
        """The memory sizes of the cards: configured, or as gpuslice's nodes
        publish them (ResourceSlices)."""
        configured = self.settings.dra_card_memory_mib
        if configured:
            return card_sizes((), configured)
        what = "read the cluster's ResourceSlices (the cards' memory sizes)"
        self._kube(what)
        assert self.namespaces is not None
        slices = await self._within_deadline(self.namespaces.cluster_objects(SLICES), what)
        return card_sizes(slices)

    async def _own_claims(
        self, pod: Mapping[str, Any], namespace: str, template: ClaimTemplate
    ) -> None:
        """Refuse a pod asking for GPUs both with NVIDIA's resources and with a
        claim of its own on gpuslice's device class (two paths to the same cards);
        the claim this translation gives (a pod translated before) is not its own."""
        spec = pod.get("spec")
        claims = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
        if not isinstance(claims, list) or not claims:
            return
        what = f"read the resource claims of a pod in namespace {namespace!r}"
        kube = self._kube(what)
        for claim in claims:
            if not isinstance(claim, Mapping) or claim == {
                "name": CLAIM_NAME,
                "resourceClaimTemplateName": template.name,
            }:
                continue
            for field, ref in (
                ("resourceClaimName", CLAIMS),
                ("resourceClaimTemplateName", TEMPLATES),
            ):
                name = claim.get(field)
                if not isinstance(name, str) or not name:
                    continue
                try:
                    found = await self._within_deadline(
                        kube.get_object(ref.in_namespace(namespace).named(name)), what
                    )
                except NotFound:
                    continue  # the claim cannot be made: the pod does not start
                if DEVICE_CLASS in claimed_classes([found]):
                    raise Denied(
                        f"the pod asks for GPUs with {self.settings.requests.resources.gpu} "
                        f"and with its own resource claim {claim.get('name')!r} "
                        f"({field} {name!r}) of device class {DEVICE_CLASS!r}; use one or the other"
                    )

    async def _create_template(self, template: ClaimTemplate, dry_run: bool) -> None:
        """Create the pod's ResourceClaimTemplate (not on a dry run); one of the
        same name already there must be ours and equal. Fails closed."""
        namespace = template.body["metadata"]["namespace"]
        ref = TEMPLATES.in_namespace(namespace)
        what = f"create ResourceClaimTemplate {namespace}/{template.name}"
        kube = self._kube(what)
        counted = self.metrics.dra_templates
        if dry_run:
            counted.labels("dry_run").inc()
            return
        try:
            await self._within_deadline(kube.create_object(ref, template.body), what)
            counted.labels("created").inc()
            return
        except Conflict:
            pass
        except Denied:
            counted.labels("failed").inc()
            raise
        try:
            found = await self._within_deadline(kube.get_object(ref.named(template.name)), what)
        except NotFound:  # deleted between the two calls
            counted.labels("failed").inc()
            raise _unavailable(f"cannot {what}: it was deleted while being created") from None
        except Denied:
            counted.labels("failed").inc()
            raise
        if not ours_and_equal(found, template):
            counted.labels("foreign").inc()
            raise Denied(
                f"namespace {namespace!r} holds a ResourceClaimTemplate {template.name!r} "
                "that gpuslice did not make or that differs from the one this pod needs; "
                "delete it (gpuslice names its templates after their content)"
            )
        counted.labels("existing").inc()

    async def _check_quota(
        self, namespace: str, metadata: Mapping[str, Any], mutation: Mutation
    ) -> None:
        if self.namespaces is None:
            return
        requests = self.settings.requests
        what = f"check the GPU quota of namespace {namespace!r}"
        quotas = await self._within_deadline(self.namespaces.quotas(namespace), what)
        limits = gpu_limits(quotas, requests)
        if not limits:
            return
        pods = await self._within_deadline(self.namespaces.pods(namespace), what)
        name = metadata.get("name")
        skip = name if isinstance(name, str) else ""
        used = namespace_usage(pods, requests, skip=skip)
        wanted = request_demand(mutation.request.containers)
        try:
            check(limits, wanted, used.get(wanted.vendor, Demand()), namespace)
        except Denied:
            self._record_quota(namespace, limits, used)
            raise
        self._record_quota(namespace, limits, used, wanted)

    def _record_quota(
        self,
        namespace: str,
        limits: Sequence[QuotaLimit],
        used: Mapping[str, Demand],
        added: Demand | None = None,
    ) -> None:
        """The namespace's use of each GPU quota (in the key's unit), this pod
        counted when it is admitted."""
        for limit in limits:
            held = [used.get(limit.vendor, Demand())]
            if added is not None and added.vendor == limit.vendor:
                held.append(added)
            amount = limit.amount(
                Demand(sum(d.memory_mib for d in held), sum(d.cores for d in held))
            )
            self.metrics.quota(namespace, limit.quota, limit.key, amount, limit.hard)

    # ------------------------------------------------------------ events

    def _publish_admitted(self, mutation: Mutation) -> None:
        request = mutation.request
        payload = PodAdmitted(
            pod=request.pod, containers=request.containers, warnings=mutation.warnings
        )
        self._submit(EventType.POD_ADMITTED, payload, request.pod)

    def _publish_denied(self, pod: PodRef, reason: str) -> None:
        self._submit(EventType.POD_DENIED, PodDenied(pod=pod, reason=reason), pod)

    def _submit(self, kind: EventType, payload: PodAdmitted | PodDenied, pod: PodRef) -> None:
        if self.outbox is None:
            return
        try:
            event = make_event(kind, payload, source=SOURCE, subject=f"{pod.namespace}/{pod.name}")
        except EventError as exc:
            log.error("cannot record %s: %s", kind.value, exc)
            return
        self.outbox.submit(event)


def _unavailable(message: str) -> Denied:
    return Denied(message, UNAVAILABLE, "ServiceUnavailable")


def _ref(metadata: Mapping[str, Any], namespace: str, review_uid: str) -> PodRef:
    """Who a refused pod was; a pod whose metadata cannot be read is named by its review."""
    try:
        return pod_ref({**metadata, "namespace": namespace})
    except (RequestError, ValueError):
        return PodRef(uid=review_uid[:128], namespace=namespace)
