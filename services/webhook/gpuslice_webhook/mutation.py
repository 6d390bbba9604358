"""What admission does to one pod: check its GPU request, write its defaults, route it.

The request is read by :func:`gpuslice_common.requests.parse_pod`, the same code
the scheduler and the device plugin use, so the three never disagree. For a pod
that asks for a GPU, :meth:`Mutator.mutate` either raises :class:`Denied` or
returns the patch that:

* states each GPU container's request in full in ``resources.limits`` (count,
  memory, cores), so ``defaultGPUNum``, the whole card of a bare count,
  ``defaultMem`` and ``defaultCores`` are visible in the pod and kubelet asks the
  device plugin for the count it defaulted;
* gives GPU containers ``CUDA_TASK_PRIORITY``, the configured core policy, and
  their identity (pod name, namespace and UID and node through the downward
  API, container name) for the interposer's telemetry;
* hides the node's GPUs from the pod's other containers
  (``NVIDIA_VISIBLE_DEVICES=none``);
* sets ``spec.schedulerName``.

A pod asking for another vendor's cards is routed the same way; its vendor
containers get what HAMi's webhook writes for that vendor
(:mod:`gpuslice_webhook.vendors`), and a vendor resource stated in a
container's requests alone is stated in its limits too: the API server
refuses an extended resource requested without a limit (requests must equal
limits), and fills requests from limits by itself, key by key, so only that
direction is ever missing (HAMi's Enflame webhook copies both ways).

In DRA mode each GPU container also names its request of the pod's claim
``gpuslice`` (``resources.claims``), made from the ResourceClaimTemplate the
mutation carries (:mod:`gpuslice_webhook.claims`); the rest is the same. Its
GPU resources stay in its limits, stated in full as above: they are what has
kube-scheduler call gpuslice's extender (``managedResources``), which chooses
the node by fragmentation, and what namespace quotas count. They are never
granted twice:

* kube-scheduler's NodeResourcesFit does not count them: every resource an
  extender manages with ``ignoredByScheduler: true`` becomes its
  ``ignoredResources`` (``buildExtenders`` in kubernetes
  ``pkg/scheduler/scheduler.go``; ``fitsRequest`` in
  ``pkg/scheduler/framework/plugins/noderesources/fit.go`` skips them);
* kubelet admits the pod on a DRA node, where no device plugin advertises them:
  ``removeMissingExtendedResources`` (``pkg/kubelet/lifecycle/predicate.go``)
  drops extended-resource requests missing from the node's allocatable before
  its fit check, and the device manager allocates only resources a device
  plugin registered (``isDevicePluginResource`` in
  ``pkg/kubelet/cm/devicemanager/manager.go``), so its cards come from the
  claim alone.

Running it on a pod it has already changed gives an empty patch: the variables
gpuslice sets are accepted when they hold exactly what gpuslice would write, and
refused otherwise, since a container's own environment overrides what the device
plugin gives it and would lift its limits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpuslice_common.config import VendorResources, WebhookSettings
from gpuslice_common.models import (
    DRIVER_LIMIT_ENV,
    DRIVER_REQUEST_ENV,
    NVIDIA,
    ContainerGpuRequest,
    PodGpuRequest,
)
from gpuslice_common.requests import RequestError, has_gpu_request, parse_pod, parse_quantity
from gpuslice_webhook import vendors
from gpuslice_webhook.claims import CLAIM_NAME, CardSizes, ClaimTemplate, claim_template
from gpuslice_webhook.denial import Denied, bad_request
from gpuslice_webhook.patch import Patch

__all__ = ["IGNORE_LABELS", "Denied", "Mutation", "Mutator", "ignored"]

IGNORE_LABELS: Final = ("gpuslice.io/webhook", "hami.io/webhook")
IGNORE_VALUE: Final = "ignore"
DEFAULT_SCHEDULER: Final = "default-scheduler"

VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
PRIORITY: Final = "CUDA_TASK_PRIORITY"
CORE_POLICY: Final = "GPU_CORE_UTILIZATION_POLICY"
DISABLE_CONTROL: Final = "CUDA_DISABLE_CONTROL"
CORE_POLICIES: Final = ("default", "force", "disable")
# Values of NVIDIA_VISIBLE_DEVICES under which the NVIDIA runtime exposes no GPU.
NO_GPU_VALUES: Final = ("none", "void", "")

# Variables the device plugin sets for the interposer: limits, region, identity,
# telemetry credentials. A container's own value would win over the plugin's.
RESERVED: Final = frozenset(
    {
        VISIBLE_DEVICES,
        PRIORITY,
        "CUDA_DEVICE_MEMORY_LIMIT",
        "CUDA_DEVICE_SM_LIMIT",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE",
        DRIVER_LIMIT_ENV,
        DRIVER_REQUEST_ENV,
    }
)
RESERVED_PREFIXES: Final = ("CUDA_DEVICE_MEMORY_LIMIT_", "CUDA_DEVICE_SM_LIMIT_", "GPUSLICE_")

# Identity given to GPU containers through the downward API.
FIELD_ENV: Final = (
    ("GPUSLICE_POD_NAME", "metadata.name"),
    ("GPUSLICE_POD_NAMESPACE", "metadata.namespace"),
    ("GPUSLICE_POD_UID", "metadata.uid"),
    ("GPUSLICE_NODE_NAME", "spec.nodeName"),
)
CONTAINER_ENV: Final = "GPUSLICE_CONTAINER_NAME"


@dataclass(frozen=True)
class Mutation:
    request: PodGpuRequest
    patch: Patch
    warnings: tuple[str, ...]
    # DRA mode: the ResourceClaimTemplate the patched pod references
    template: ClaimTemplate | None = None


def ignored(labels: object) -> bool:
    """True when ``labels`` (a pod's or a namespace's) say the webhook stays out."""
    return isinstance(labels, Mapping) and any(
        labels.get(key) == IGNORE_VALUE for key in IGNORE_LABELS
    )


def _is_true(value: str) -> bool:
    """The interposer's reading of a boolean variable."""
    return value.lower() in ("true", "yes") or value == "1"


def _field_ref(path: str) -> dict[str, Any]:
    return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}


@dataclass(frozen=True)
class _Container:
    """One container of the pod, where it sits, and what it asks for."""

    path: tuple[str | int, ...]  # ("spec", "containers", 0)
    spec: Mapping[str, Any]
    name: str
    request: ContainerGpuRequest | None

    @property
    def label(self) -> str:
        return f"container {self.name!r}"


class Mutator:
    """Admission's decisions; pure (no I/O), so it is tested and fuzzed directly."""

    def __init__(self, settings: WebhookSettings) -> None:
        self.settings = settings
        self.names = settings.requests.resources
        self.vendors = {v.vendor: v for v in settings.requests.vendors}

    def mutate(
        self,
        pod: Mapping[str, Any],
        namespace: str,
        *,
        dra: bool = False,
        sizes: CardSizes | None = None,
    ) -> Mutation | None:
        """The change for a GPU pod, or None when it asks for no GPU. Raises Denied.

        With ``dra`` an NVIDIA request becomes a ResourceClaimTemplate (the
        mutation's ``template``, not created here) that the patch makes the pod
        reference, besides its GPU resources; a share of a card's memory
        needs the cluster's card ``sizes`` (NeedCardSizes without them)."""
        request = self._parse(pod, namespace)
        if request is None:
            return None
        spec = pod["spec"]  # parse_pod found containers, so spec is an object
        node = spec.get("nodeName")
        if node:
            raise Denied(
                f"the pod sets spec.nodeName ({node!r}), which skips scheduling: GPU pods "
                f"are placed by {self.settings.scheduler_name}, which reserves their GPUs. "
                "Remove spec.nodeName and choose nodes with a nodeSelector or node affinity"
            )
        template = None
        warnings = list(request.warnings)
        if dra and request.vendor == NVIDIA:  # another vendor's cards keep their plugin
            template = claim_template(
                request,
                namespace,
                consumable=self.settings.dra_consumable,
                names=self.names,
                sizes=sizes,
            )
            warnings.extend(template.warnings)
        patch = Patch()
        vendor = self.vendors.get(request.vendor)
        for container in self._containers(spec, request):
            env = self._env(container)
            if container.request is None or container.request.vendor != NVIDIA:
                if container.request is not None and vendor is not None:
                    self._write_vendor_resources(container, vendor, patch)
                # NVIDIA's cards are hidden from another vendor's container too
                self._hide_gpus(container, env, patch)
                continue
            self._check_gpu_container(container, env)
            self._write_resources(container, patch)
            if template is not None:
                self._claim_devices(container, patch)
            self._write_env(container, env, patch)
        if template is not None:
            self._reference(spec, template, patch)
        if vendor is not None:
            self._annotate(pod, vendor, request, patch)
        warnings.extend(self._route(spec, patch))
        return Mutation(request=request, patch=patch, warnings=tuple(warnings), template=template)

    def route(self, pod: Mapping[str, Any]) -> Patch | None:
        """For a pod that asks for no GPU (``route_cpu_pods``): point it at
        gpuslice's scheduler and change nothing else; None where nothing is to
        change (it names gpuslice's scheduler already, or another one that is
        kept, or sets spec.nodeName and is not scheduled at all)."""
        spec = pod.get("spec")
        if not isinstance(spec, Mapping) or spec.get("nodeName"):
            return None
        patch = Patch()
        self._route(spec, patch)  # its warnings are about GPU containers: none here
        return patch or None

    # ------------------------------------------------------------ reading

    def _parse(self, pod: Mapping[str, Any], namespace: str) -> PodGpuRequest | None:
        metadata = pod.get("metadata")
        if isinstance(metadata, Mapping) and not metadata.get("namespace"):
            # At creation the namespace comes with the request, not in the object.
            pod = {**pod, "metadata": {**metadata, "namespace": namespace}}
        try:
            return parse_pod(pod, self.settings.requests)
        except RequestError as exc:
            raise bad_request(str(exc)) from None

    def _containers(self, spec: Mapping[str, Any], request: PodGpuRequest) -> Iterator[_Container]:
        by_name = {c.name: c for c in request.containers}
        for field in ("initContainers", "containers"):
            for index, container in enumerate(spec.get(field) or ()):
                name = container["name"]  # checked by parse_pod
                yield _Container(("spec", field, index), container, name, by_name.get(name))

    def _env(self, container: _Container) -> Sequence[Mapping[str, Any]]:
        env = container.spec.get("env")
        if env is None:
            return ()
        if not isinstance(env, list):
            raise bad_request(f"{container.label}: env must be a list")
        for index, var in enumerate(env):
            if not isinstance(var, Mapping) or not isinstance(var.get("name"), str):
                raise bad_request(f"{container.label}: env[{index}] needs a name")
        return env

    # ------------------------------------------------------------ checks

    def _check_gpu_container(self, container: _Container, env: Sequence[Mapping[str, Any]]) -> None:
        request = container.request
        assert request is not None
        shares = request.cores < 100  # below 100 % the card takes neighbours
        security = container.spec.get("securityContext")
        if shares and isinstance(security, Mapping) and security.get("privileged") is True:
            raise Denied(
                f"{container.label} is privileged and asks for a share of a GPU: a "
                "privileged container sees every GPU of the node, beyond any limit. "
                f"Ask for whole cards ({self.names.gpu} alone) or drop privileged"
            )
        wanted = {var["name"]: var for var in self._wanted_env(container)}
        for var in env:
            name = var["name"]
            if name in wanted and _same_var(var, wanted[name]):
                continue
            if name in RESERVED or name.startswith(RESERVED_PREFIXES):
                raise Denied(f"{container.label}: {_reserved_message(name, self.names.priority)}")
            if name == CORE_POLICY:
                self._check_core_policy(container, var, shares)
            elif name == DISABLE_CONTROL:
                self._check_opt_out(container, var, shares, "turns the interposer off")

    def _check_core_policy(
        self, container: _Container, var: Mapping[str, Any], shares: bool
    ) -> None:
        value = var.get("value")
        if "valueFrom" not in var and (
            not isinstance(value, str) or value.lower() not in CORE_POLICIES
        ):
            raise bad_request(
                f"{container.label}: {CORE_POLICY} must be one of "
                f"{', '.join(CORE_POLICIES)}, got {value!r}"
            )
        self._check_opt_out(container, var, shares, "lifts its compute limit")

    def _check_opt_out(
        self, container: _Container, var: Mapping[str, Any], shares: bool, effect: str
    ) -> None:
        """CUDA_DISABLE_CONTROL=true and the disable policy lift a container's limits."""
        if not shares or self.settings.allow_limit_opt_out:
            return
        name, value = var["name"], var.get("value")
        if "valueFrom" in var:
            setting = f"{name} from valueFrom (which admission cannot read)"
        else:
            is_on = _is_true if name == DISABLE_CONTROL else (lambda v: v.lower() == "disable")
            if not isinstance(value, str) or not is_on(value):
                return
            setting = f"{name}={value}"
        raise Denied(
            f"{container.label} shares a GPU and sets {setting}, which {effect} and would "
            f"take what its neighbours were promised. Remove it, or ask for whole cards "
            f"({self.names.gpu} alone)"
        )

    # ------------------------------------------------------------ writing

    def _write_resources(self, container: _Container, patch: Patch) -> None:
        """State count, memory and cores in limits (and in requests when it lists GPU
        resources), writing only what is missing or a "not set" memory of 0."""
        request = container.request
        assert request is not None
        names = self.names
        explicit: dict[str, str] = {names.gpu: str(request.count), names.cores: str(request.cores)}
        if request.memory.mib is not None:
            explicit[names.memory] = str(request.memory.mib)
        else:
            explicit[names.memory_percentage] = str(request.memory.percent)
        memory = (names.memory, names.memory_percentage)
        self._state(
            container, explicit, names.all(), patch, lambda have, key: _unset(have, key, memory)
        )

    def _write_vendor_resources(
        self, container: _Container, vendor: VendorResources, patch: Patch
    ) -> None:
        """State in limits (and in requests when they list the vendor's resources)
        what HAMi's webhook states for ``vendor``, and what requests alone state."""
        request = container.request
        assert request is not None
        resources = container.spec.get("resources")
        assert isinstance(resources, Mapping)  # the container asks for the vendor's cards
        limits, requests = resources.get("limits"), resources.get("requests")
        limited = limits if isinstance(limits, Mapping) else {}
        wanted: dict[str, Any] = {}
        if isinstance(requests, Mapping):  # read by parse_pod: quantities, as written
            stated = [n for n in vendor.all() if n in requests and n not in limited]
            wanted = {n: str(requests[n]) for n in stated}
        wanted.update((k, str(v)) for k, v in vendors.container_limits(vendor, request).items())

        def differs(have: Mapping[str, Any], key: str) -> bool:
            return key not in have or parse_quantity(have[key]) != parse_quantity(wanted[key])

        self._state(container, wanted, vendor.all(), patch, differs)

    def _state(
        self,
        container: _Container,
        values: Mapping[str, Any],
        names: Collection[str],
        patch: Patch,
        needed: Callable[[Mapping[str, Any], str], bool],
    ) -> None:
        """Write each of ``values`` where ``needed(current, key)`` says so, into the
        container's limits and into its requests when they list any of ``names``
        (else the API server fills them from the limits, key by key)."""
        resources = container.spec.get("resources")
        assert isinstance(resources, Mapping)  # the container asks for cards
        for part in ("limits", "requests"):
            current = resources.get(part)
            if part == "requests" and not (
                isinstance(current, Mapping) and any(n in current for n in names)
            ):
                continue
            have = current if isinstance(current, Mapping) else {}
            missing = {key: value for key, value in values.items() if needed(have, key)}
            path = (*container.path, "resources", part)
            if not missing:
                continue
            if not isinstance(current, Mapping):
                patch.set(path, missing, exists=current is not None)
                continue
            for key, value in missing.items():
                patch.put(path, current, key, value)

    def _annotate(
        self, pod: Mapping[str, Any], vendor: VendorResources, request: PodGpuRequest, patch: Patch
    ) -> None:
        """Set the pod annotations ``vendor``'s plugin reads, where they differ."""
        metadata = pod.get("metadata")
        current = metadata.get("annotations") if isinstance(metadata, Mapping) else None
        have: Mapping[str, Any] = current if isinstance(current, Mapping) else {}
        wanted = vendors.pod_annotations(vendor, request, have)
        missing = {key: value for key, value in wanted.items() if have.get(key) != value}
        if not missing:
            return
        if not isinstance(metadata, Mapping):
            patch.set(("metadata",), {"annotations": missing}, exists=metadata is not None)
        elif not isinstance(current, Mapping):
            patch.set(("metadata", "annotations"), missing, exists=current is not None)
        else:
            for key, value in missing.items():
                patch.put(("metadata", "annotations"), current, key, value)

    def _claim_devices(self, container: _Container, patch: Patch) -> None:
        """DRA mode: the container names its request of the pod's claim (once)."""
        resources = container.spec.get("resources")
        assert isinstance(resources, Mapping)  # the container asks for a GPU
        entry = {"name": CLAIM_NAME, "request": container.name}
        claims = resources.get("claims")
        if claims is not None and not isinstance(claims, list):
            raise bad_request(f"{container.label}: resources.claims must be a list")
        if claims and entry in claims:
            return  # translated before
        patch.append((*container.path, "resources", "claims"), claims, [entry])

    def _reference(self, spec: Mapping[str, Any], template: ClaimTemplate, patch: Patch) -> None:
        """DRA mode: the pod's claim made from the template."""
        claims = spec.get("resourceClaims")
        if claims is not None and not isinstance(claims, list):
            raise bad_request("spec.resourceClaims must be a list")
        entry = {"name": CLAIM_NAME, "resourceClaimTemplateName": template.name}
        for claim in claims or ():
            if claim == entry:
                return  # translated before
            if isinstance(claim, Mapping) and claim.get("name") == CLAIM_NAME:
                raise Denied(
                    f"the pod has a resource claim named {CLAIM_NAME!r} and asks for GPUs "
                    f"with {self.names.gpu}: gpuslice gives that claim; rename the pod's own"
                )
        patch.append(("spec", "resourceClaims"), claims, [entry])

    def _wanted_env(self, container: _Container) -> list[dict[str, Any]]:
        """The variables gpuslice gives this GPU container, in the order it appends them."""
        request = container.request
        assert request is not None
        env: list[dict[str, Any]] = [{"name": PRIORITY, "value": str(request.priority)}]
        if self.settings.core_policy is not None:
            env.append({"name": CORE_POLICY, "value": self.settings.core_policy})
        env.extend({"name": name, "valueFrom": _field_ref(path)} for name, path in FIELD_ENV)
        env.append({"name": CONTAINER_ENV, "value": container.name})
        return env

    def _write_env(
        self, container: _Container, env: Sequence[Mapping[str, Any]], patch: Patch
    ) -> None:
        present = {var["name"] for var in env}
        missing = [var for var in self._wanted_env(container) if var["name"] not in present]
        patch.append((*container.path, "env"), container.spec.get("env"), missing)

    def _hide_gpus(
        self, container: _Container, env: Sequence[Mapping[str, Any]], patch: Patch
    ) -> None:
        shown = [var for var in env if var["name"] == VISIBLE_DEVICES]
        for var in shown:  # every one: with a name repeated, kubelet takes the last
            value = var.get("value", "")
            if "valueFrom" in var or not isinstance(value, str) or value not in NO_GPU_VALUES:
                setting = " from valueFrom" if "valueFrom" in var else f"={value}"
                raise Denied(
                    f"{container.label} asks for no NVIDIA GPU but sets "
                    f"{VISIBLE_DEVICES}{setting}, which would show it this node's GPUs "
                    f"outside any limit. Ask for a GPU with {self.names.gpu} or remove the variable"
                )
        if shown or not self.settings.hide_gpus_from_other_containers:
            return
        patch.append(
            (*container.path, "env"),
            container.spec.get("env"),
            [{"name": VISIBLE_DEVICES, "value": "none"}],
        )

    def hide_from_ephemeral(self, pod: Mapping[str, Any], existing: Collection[str]) -> Patch:
        """The patch for a pod gaining ephemeral containers (``kubectl debug``): a pod
        that asks for GPUs gets them hidden from its new debug containers too (those
        named in ``existing`` cannot change any more). Raises Denied like :meth:`mutate`."""
        patch = Patch()
        spec = pod.get("spec")
        ephemeral = spec.get("ephemeralContainers") if isinstance(spec, Mapping) else None
        if not isinstance(ephemeral, list) or not has_gpu_request(pod, self.settings.requests):
            return patch
        for index, entry in enumerate(ephemeral):
            if not isinstance(entry, Mapping):
                raise bad_request(f"spec.ephemeralContainers[{index}] must be an object")
            name = entry.get("name")
            if name in existing:
                continue
            label = name if isinstance(name, str) and name else f"#{index}"
            container = _Container(
                ("spec", "ephemeralContainers", index), entry, label, request=None
            )
            self._hide_gpus(container, self._env(container), patch)
        return patch

    def _route(self, spec: Mapping[str, Any], patch: Patch) -> list[str]:
        """Point the pod at gpuslice's scheduler; the warnings to give."""
        ours = self.settings.scheduler_name
        current = spec.get("schedulerName")
        if current == ours:
            return []
        if current in (None, "", DEFAULT_SCHEDULER) or not self.settings.keep_other_schedulers:
            patch.set(("spec", "schedulerName"), ours, exists="schedulerName" in spec)
            return []
        return [
            f"the pod names scheduler {current!r}, not {ours!r}: its GPU containers start only "
            "if that scheduler reserves their GPUs with gpuslice"
        ]


def _unset(have: Mapping[str, Any], key: str, memory: tuple[str, str]) -> bool:
    """True when ``key`` must be written: absent, or a gpumem or gpumem-percentage
    of 0 ("not set")."""
    if key not in have:
        return True
    return key in memory and parse_quantity(have[key]) == 0  # parse_pod has read it


def _same_var(var: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Does a container's variable hold exactly what gpuslice would write?

    The API server writes ``apiVersion: v1`` into a fieldRef that lacks it, so a
    fieldRef matches on its path alone when the version is absent.
    """
    if "value" in wanted:
        return "valueFrom" not in var and var.get("value") == wanted["value"]
    source = var.get("valueFrom")
    if var.get("value") or not isinstance(source, Mapping) or len(source) != 1:
        return False
    field = source.get("fieldRef")
    expected = wanted["valueFrom"]["fieldRef"]
    return (
        isinstance(field, Mapping)
        and field.get("fieldPath") == expected["fieldPath"]
        and field.get("apiVersion", "v1") == "v1"
    )


def _reserved_message(name: str, priority_resource: str) -> str:
    why = {
        VISIBLE_DEVICES: "GPUs are chosen by the scheduler and given by the device plugin",
        PRIORITY: f"ask for priority with the {priority_resource} resource",
        DRIVER_LIMIT_ENV: "the driver's memory limit of the container is its grant",
        DRIVER_REQUEST_ENV: "the driver's memory limit of the container is its grant",
    }.get(name, "it carries the container's GPU limits or identity")
    return f"env {name} is set by gpuslice ({why}); remove it"
