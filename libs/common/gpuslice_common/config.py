"""Typed settings for every component, read from environment variables.

Every variable starts with ``GPUSLICE_``; nested groups use a double underscore,
for example ``GPUSLICE_RESOURCES__GPU=nvidia.com/gpu``. ``load(SettingsClass)``
fails fast with a :class:`ConfigError` whose message names each bad variable.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import timedelta
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from gpuslice_common.models import (
    MAX_DEVICE_MEMORY_MIB,
    NVIDIA,
    VENDOR_PATTERN,
    GpuPolicy,
    NodePolicy,
)

ENV_PREFIX = "GPUSLICE_"
NESTED_DELIMITER = "__"

_RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class ConfigError(Exception):
    """Settings could not be loaded; the message names every offending variable."""


def parse_duration(value: Any) -> timedelta:
    """Accept ``30s``, ``5m``, ``2h``, ``30d``, a number of seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    elif isinstance(value, str) and value.strip().replace(".", "", 1).isdigit():
        seconds = float(value)
    else:
        raise ValueError(f"not a duration: {value!r} (use e.g. 30s, 5m, 2h, 30d)")
    if seconds <= 0:
        raise ValueError("duration must be positive")
    try:
        return timedelta(seconds=seconds)
    except (OverflowError, ValueError):  # inf, nan, or beyond timedelta's ~2.7 million years
        raise ValueError(f"duration out of range: {value!r}") from None


# A duration setting: "30s", "5m", "2h", "90d" or a number of seconds.
Duration = Annotated[timedelta, BeforeValidator(parse_duration)]
# The largest request body an HTTP service reads, in bytes: "64MiB", "8MiB", "65536".
BodyCap = Annotated[ByteSize, Field(ge=1024, le=1024**3)]
MIB = 1024 * 1024


class ResourceNames(BaseModel):
    """Extended-resource names a pod uses to ask for GPUs (HAMi's by default)."""

    gpu: str = "nvidia.com/gpu"
    memory: str = "nvidia.com/gpumem"
    memory_percentage: str = "nvidia.com/gpumem-percentage"
    cores: str = "nvidia.com/gpucores"
    priority: str = "nvidia.com/priority"

    @field_validator("*")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _RESOURCE_NAME.fullmatch(value):
            raise ValueError(f"not a Kubernetes resource name: {value!r}")
        return value

    def all(self) -> tuple[str, ...]:
        return (self.gpu, self.memory, self.memory_percentage, self.cores, self.priority)


class RequestDefaults(BaseModel):
    """Values filled in when a container leaves them out (HAMi's names in comments)."""

    gpu_count: Annotated[int, Field(ge=1, le=64)] = 1  # defaultGPUNum
    memory_mib: Annotated[int, Field(ge=0)] = 0  # defaultMem: 0 means the whole card
    cores: Annotated[int, Field(ge=0, le=100)] = 0  # defaultCores
    priority: Annotated[int, Field(ge=0, le=1)] = 1


class VendorTemplate(BaseModel):
    """A virtual-device template a vendor rounds memory up to (Ascend's vNPUs)."""

    model_config = ConfigDict(frozen=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_. ]{0,62}[A-Za-z0-9])?$")]
    memory_mib: Annotated[int, Field(ge=1, le=MAX_DEVICE_MEMORY_MIB)]


_ANNOTATION_KEY = (
    r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
AnnotationName = Annotated[str, Field(pattern=_ANNOTATION_KEY)]


class VendorResources(BaseModel):
    """How a pod asks for another vendor's cards (from HAMi's device configuration):
    a count resource, and optionally a memory and a cores resource. Memory a pod asks
    for, times ``memory_factor``, is MiB. ``rules`` names the vendor's own rules
    (``gpuslice_common.devicetypes.Rules``); ``default_cores`` are the cores of a
    container that names none; ``max_cores`` the cores of a whole card in the
    vendor's unit. ``use_type`` … ``nouse_uuid`` are the pod annotations that
    choose its cards."""

    model_config = ConfigDict(frozen=True)

    vendor: Annotated[str, Field(pattern=VENDOR_PATTERN, max_length=32)]
    count: str
    memory: str | None = None
    cores: str | None = None
    memory_factor: Annotated[int, Field(ge=1, le=1 << 20)] = 1
    # HAMi's name of the device type and the word of its pod annotations
    # (hami.io/<allocate_key>-devices-to-allocate): what the vendor's plugin reads
    device_type: Annotated[str, Field(pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,62}[A-Za-z0-9])?$")]
    allocate_key: Annotated[str, Field(pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,40}[A-Za-z0-9])?$")]
    rules: Annotated[str, Field(pattern=r"^[a-z][-a-z]{0,31}$")] = "hami"
    default_cores: Annotated[int, Field(ge=0, le=100)] = 100
    max_cores: Annotated[int, Field(ge=1, le=100)] = 100
    templates: Annotated[tuple[VendorTemplate, ...], Field(max_length=64)] = ()
    memory_allocatable_mib: Annotated[int, Field(ge=1, le=MAX_DEVICE_MEMORY_MIB)] | None = None
    memory_capacity_mib: Annotated[int, Field(ge=1, le=MAX_DEVICE_MEMORY_MIB)] | None = None
    use_type: AnnotationName | None = None
    nouse_type: AnnotationName | None = None
    use_uuid: Annotated[tuple[AnnotationName, ...], Field(max_length=4)] = ()
    nouse_uuid: Annotated[tuple[AnnotationName, ...], Field(max_length=4)] = ()

    @field_validator("count", "memory", "cores")
    @classmethod
    def _valid_name(cls, value: str | None) -> str | None:
        if value is not None and not _RESOURCE_NAME.fullmatch(value):
            raise ValueError(f"not a Kubernetes resource name: {value!r}")
        return value

    def all(self) -> tuple[str, ...]:
        return tuple(n for n in (self.count, self.memory, self.cores) if n)


class RequestSettings(BaseModel):
    """How pods' GPU requests are read; shared by the webhook and the scheduler."""

    resources: ResourceNames = ResourceNames()
    # other vendors whose cards the ledger holds (set from GPUSLICE_DEVICE_CONFIG)
    vendors: tuple[VendorResources, ...] = ()
    defaults: RequestDefaults = RequestDefaults()
    default_gpu_policy: GpuPolicy = GpuPolicy.FRAGMENTATION  # gpuSchedulerPolicy
    # nodeSchedulerPolicy for pods without the annotation; unset: the GPU policy's
    # own ranking (fragmentation), or binpack with a binpack or spread GPU policy
    default_node_policy: NodePolicy | None = None

    @model_validator(mode="after")
    def _vendors_apart(self) -> RequestSettings:
        seen = dict.fromkeys(self.resources.all(), NVIDIA)
        vendors = {NVIDIA}
        for v in self.vendors:
            if v.vendor in vendors:
                raise ValueError(f"vendor {v.vendor!r} is named twice")
            vendors.add(v.vendor)
            for name in v.all():
                if name in seen:
                    raise ValueError(f"resource {name} is both {seen[name]}'s and {v.vendor}'s")
                seen[name] = v.vendor
        return self


class BusSettings(BaseSettings):
    """Settings every component reads: where the bus is. The node agent has only these."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=NESTED_DELIMITER,
        extra="ignore",
        frozen=True,
    )

    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password: str | None = None
    nats_creds_file: str | None = None
    # a token read at every (re)connect: a projected ServiceAccount token kubelet rotates
    nats_token_file: str | None = None
    subject_prefix: str = "gpuslice"
    audit_max_age: Annotated[Duration, Field(description="retention of the audit stream")] = (
        timedelta(days=90)
    )
    audit_replicas: Annotated[
        int,
        Field(
            ge=1, le=5, description="copies of the audit stream (3 on a three-member NATS cluster)"
        ),
    ] = 1
    connect_wait: Annotated[
        Duration, Field(description="how long a component waits for NATS at start-up")
    ] = timedelta(seconds=10)
    log_level: str = "INFO"
    requests: RequestSettings = RequestSettings()
    # export HAMi's metric names beside gpuslice's, so that HAMi's dashboards and
    # alerts keep working (docs/migrating-from-hami.md): its snake_case hami_* names
    # on /metrics, its camelCase ones (GPUDeviceMemoryAllocated, QuotaUsed,
    # HostGPUMemoryUsage, ...), which Prometheus's naming rules flag, on /metrics/hami
    hami_metrics: bool = True

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, value: str) -> str:
        for url in value.split(","):
            if not re.match(r"^(nats|tls|ws|wss)://[^\s/]+", url.strip()):
                raise ValueError(
                    f"not a NATS URL: {without_password(url)!r} (expected nats://host:port)"
                )
        return value

    @field_validator("subject_prefix")
    @classmethod
    def _token(cls, value: str) -> str:
        return _one_token(value)

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"unknown log level {value!r}")
        return level


HIDDEN_URL = "(a URL, not shown: it may hold a password)"


def without_password(url: str) -> str:
    """``url`` (one or more comma-separated servers) for a message or a log:
    each server's password, if any, left out (the user stays). A server that
    cannot be read as a URL but may hold a login is not shown at all."""
    shown = []
    for server in url.split(","):
        try:
            parts = urlsplit(server.strip())
            netloc = parts.netloc
        except ValueError:
            shown.append(HIDDEN_URL)
            continue
        if "@" in netloc:
            login, _, host = netloc.rpartition("@")
            user = login.partition(":")[0]
            shown.append(urlunsplit(parts._replace(netloc=f"{user}@{host}" if user else host)))
        elif "@" in server:  # a login, but where is not clear
            shown.append(HIDDEN_URL)
        else:
            shown.append(server.strip())
    return ",".join(shown)


def _one_token(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", value):
        raise ValueError(f"must be one token of letters, digits, '-' or '_': {value!r}")
    return value


class CommonSettings(BusSettings):
    """Settings every control-plane service reads: where the bus and the ledger are."""

    # HAMi's device-config.yaml: "" reads none. The webhook and the scheduler read
    # its vendors' resources into requests.vendors; the inventory registers their cards
    device_config: str = ""

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False  # redis_url names one node of a Redis Cluster
    # Redis Sentinel: "host:port,host:port,..."; the ledger asks them which
    # server is the primary of ``redis_sentinel_service`` (and asks again after
    # a failover); redis_url then gives only the user, password and database
    redis_sentinels: str | None = None
    redis_sentinel_service: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")] = "gpuslice"
    redis_sentinel_user: str | None = None
    redis_sentinel_password: str | None = None
    ledger_prefix: str = "gpuslice"

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not re.match(r"^(redis|rediss|unix)://", value):
            raise ValueError(
                f"not a Redis URL: {without_password(value)!r} (expected redis://host:port/db)"
            )
        return value

    @field_validator("ledger_prefix")
    @classmethod
    def _ledger_token(cls, value: str) -> str:
        return _one_token(value)

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinel_addresses(cls, value: str | None) -> str | None:
        if value is not None:
            sentinel_addresses(value)
        return value

    @model_validator(mode="after")
    def _one_redis_shape(self) -> CommonSettings:
        if self.redis_sentinels and self.redis_cluster:
            raise ValueError(
                "GPUSLICE_REDIS_SENTINELS and GPUSLICE_REDIS_CLUSTER exclude each other"
                " (Sentinel watches one primary; a Redis Cluster fails over by itself)"
            )
        if self.redis_sentinels and not self.redis_url.startswith("redis://"):
            # the primary's address comes from the sentinels: only a plain
            # redis:// URL's user, password and database carry over, and a
            # rediss:// one would silently lose its TLS
            raise ValueError(
                "with GPUSLICE_REDIS_SENTINELS, GPUSLICE_REDIS_URL must be redis:// "
                "(TLS to the primary through sentinels is not supported)"
            )
        return self


_HOST = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])$")


def sentinel_addresses(value: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` as pairs (an IPv6 host in brackets); ValueError
    naming the first bad one."""
    addresses = []
    for item in value.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"not a sentinel address: {item.strip()!r} (expected host:port)")
        addresses.append((host.strip("[]"), int(port)))
    return addresses


_SCHEDULER_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class WebhookSettings(CommonSettings):
    """The mutating admission webhook."""

    listen_host: str = "0.0.0.0"
    listen_port: Annotated[int, Field(ge=1, le=65535)] = 8443
    # plain HTTP for Prometheus (/metrics) beside the HTTPS the API server calls
    metrics_host: str = "0.0.0.0"
    metrics_port: Annotated[int, Field(ge=1, le=65535)] = 9091
    # HTTPS from mounted files, re-read when they change; neither set: plain HTTP
    # (the local stack only: the API server calls webhooks over HTTPS)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_reload_interval: Duration = timedelta(seconds=2)
    # the scheduler GPU pods are routed to; a pod naming another scheduler keeps
    # it unless keep_other_schedulers is false
    scheduler_name: str = "gpuslice-scheduler"
    keep_other_schedulers: bool = True
    # route pods that ask for no GPU to scheduler_name too (same rules: ignore
    # labels, keep_other_schedulers), changing nothing else in them, so that
    # gpuslice places them where they strand the fewest GPUs (score_cpu_pods)
    route_cpu_pods: bool = False
    # NVIDIA_VISIBLE_DEVICES=none for the containers of a GPU pod that ask for no GPU
    hide_gpus_from_other_containers: bool = True
    # GPU_CORE_UTILIZATION_POLICY given to GPU containers that do not set it;
    # unset: the node's own setting applies
    core_policy: Literal["default", "force", "disable"] | None = None
    # let containers that share a card lift their limits with CUDA_DISABLE_CONTROL=true
    # or GPU_CORE_UTILIZATION_POLICY=disable (HAMi allows both)
    allow_limit_opt_out: bool = False
    # namespace labels and GPU quotas: "cluster" (in-cluster or kubeconfig),
    # "local" (the dev stack's in-memory API) or "none" (neither is checked)
    kube_api: Literal["cluster", "local", "none"] = "cluster"
    kube_cache_ttl: Duration = timedelta(seconds=10)  # namespaces and quotas
    # what one admission may spend on the Kubernetes API, well under the API
    # server's webhook timeout (10 s by default)
    kube_timeout: Duration = timedelta(seconds=3)
    event_queue_size: Annotated[int, Field(ge=1)] = 10_000  # events waiting for NATS
    # an AdmissionReview holds a pod, and on updates its old copy too; the API
    # server stores objects of at most about 1.5 MiB
    max_request_body: BodyCap = ByteSize(8 * MIB)
    # DRA mode: HAMi-style GPU requests become a ResourceClaimTemplate the pod
    # references (gpuslice_common.dra); dra_consumable as the node agents have it
    dra: bool = False
    dra_consumable: bool = True
    # DRA mode: the card memory sizes (MiB) a share of a card's memory
    # (gpumem-percentage) is sized for, comma-separated, at most 8; unset: the
    # sizes at least two nodes publish in their ResourceSlices (all nodes, when fewer)
    dra_card_memory_mib: Annotated[tuple[int, ...], NoDecode] = ()

    @field_validator("dra_card_memory_mib", mode="before")
    @classmethod
    def _card_memory(cls, value: object) -> object:
        if isinstance(value, str):
            items = [item.strip() for item in value.split(",") if item.strip()]
            if not all(item.isdigit() for item in items):
                raise ValueError(f"not comma-separated whole MiB: {value!r}")
            value = tuple(int(item) for item in items)
        return value

    @field_validator("dra_card_memory_mib")
    @classmethod
    def _card_memory_sizes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(mib < 1 for mib in value):
            raise ValueError(f"a card has at least 1 MiB: {list(value)}")
        if len(set(value)) > 8:
            raise ValueError(f"at most 8 card memory sizes (firstAvailable): {list(value)}")
        return tuple(sorted(set(value)))

    @field_validator("scheduler_name")
    @classmethod
    def _scheduler_name(cls, value: str) -> str:
        if len(value) > 253 or not _SCHEDULER_NAME.fullmatch(value):
            raise ValueError(f"not a scheduler name (a DNS-1123 subdomain): {value!r}")
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> WebhookSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("GPUSLICE_TLS_CERT_FILE and GPUSLICE_TLS_KEY_FILE go together")
        return self


class SchedulerSettings(CommonSettings):
    listen_host: str = "0.0.0.0"
    listen_port: Annotated[int, Field(ge=1, le=65535)] = 8888
    # plain HTTP for Prometheus (/metrics): the extender itself may listen on
    # 127.0.0.1 only (kube-scheduler calls it from the same pod)
    metrics_host: str = "0.0.0.0"
    metrics_port: Annotated[int, Field(ge=1, le=65535)] = 9092
    # where the Kubernetes API is: "cluster" (in-cluster or kubeconfig) or "local"
    # (an in-memory API for the dev stack)
    kube_api: Literal["cluster", "local"] = "cluster"
    # the ledger copy: polled this often without change notices (Redis Cluster) ...
    sync_interval: Duration = timedelta(seconds=1)
    # ... and read whole this often with them
    resync_interval: Duration = timedelta(seconds=30)
    # kube-scheduler's ExtenderArgs: small with nodeCacheCapable (node names), but
    # with full Node objects several MiB for a few thousand nodes
    max_request_body: BodyCap = ByteSize(64 * MIB)
    # follow every node's allocatable CPU and memory and every pod's requests
    # (a list and a watch of Nodes and Pods, as kube-scheduler's cache), so that
    # placements weigh what nodes have free of them; off, they count as unlimited
    node_resources: bool = True
    # score pods that ask for no GPU too (prioritize), as FGD does: each goes
    # where it strands the fewest GPUs (its CPU and memory measured against the
    # workload mix); off, every node scores 0 for them. Filter passes every node
    # for such a pod either way (kube-scheduler checked its CPU and memory), and
    # a bind through gpuslice counts its CPU and memory on the node at once.
    # kube-scheduler sends them only where they name gpuslice's scheduler (the
    # webhook's GPUSLICE_ROUTE_CPU_PODS) and the extender lists no
    # managedResources: k8s/cpu-pods does both, and turns this on
    score_cpu_pods: bool = False
    # a GPU bind waits this long for its node's turn: while another pod bound
    # there waits for kubelet's Allocate (which names no pod), none binds. Keep
    # it under kube-scheduler's extender httpTimeout (10 s in k8s/scheduler.yaml)
    bind_wait: Duration = timedelta(seconds=8)
    # where a node fails filter or bind for cards that reservations hold, ask the
    # API server about their pods and release those it says are gone or
    # terminal, at once (kube-scheduler may retry before the inventory has
    # released them); off, such cards are free only once the inventory releases
    # them. Never with kube_api "local", whose pods are only those it was shown
    free_ended_holders: bool = True
    # GPU preemption at filter time: a GPU pod that fits no node evicts GPU pods
    # of lower priority (docs/architecture.md, Scheduler: Preemption)
    preemption: bool = True
    # how long the room freed by a preemption stays held for its pod if it
    # does not bind before
    nomination_ttl: Duration = timedelta(minutes=5)


class InventorySettings(CommonSettings):
    """The inventory: node registration, liveness, telemetry, releases, metrics."""

    listen_host: str = "0.0.0.0"
    listen_port: Annotated[int, Field(ge=1, le=65535)] = 9090
    # the node agents' heartbeat; a node silent for three of them is unavailable
    heartbeat_interval: Duration = timedelta(seconds=10)
    # a reservation never allocated within this is released as expired
    reservation_ttl: Duration = timedelta(minutes=5)
    # how often the replica holding the lease checks liveness and expiry
    sweep_interval: Duration = timedelta(seconds=5)
    # how long a replica's lease on the periodic jobs lasts without renewal
    lease_ttl: Duration = timedelta(seconds=15)
    # a container's telemetry counts for this long after its last sample
    telemetry_ttl: Duration = timedelta(seconds=30)
    # telemetry is stored only for a live placement's containers and cards; each
    # pod's placement is read from the ledger at most this often
    telemetry_placement_cache: Duration = timedelta(seconds=5)
    # how often the per-GPU metrics are read from the ledger
    metrics_interval: Duration = timedelta(seconds=5)
    # "cluster": watch and reconcile pods through the Kubernetes API; "none":
    # no API server (the dev stack), pod ends come as reports on the bus
    kube_api: Literal["cluster", "none"] = "cluster"
    # how often the ledger is rebuilt from pod annotations and pods gone released
    reconcile_interval: Duration = timedelta(seconds=60)
    # a reservation this young is never released for a pod missing from the list
    reconcile_grace: Duration = timedelta(seconds=30)
    # (device_config, in CommonSettings: with the Kubernetes API, other vendors'
    # cards are read from the node annotations of HAMi's vendor device plugins
    # every vendor_interval and registered)
    vendor_interval: Duration = timedelta(seconds=30)
    # a vendor plugin's "Reported_" handshake older than this: its cards are gone
    vendor_report_timeout: Duration = timedelta(minutes=5)
    # NATS auth callout (node agents and GPU containers prove who they are):
    # runs when the account seed is set (python -m gpuslice_common.nkeys makes
    # one; NATS's auth_callout.issuer is its public key)
    callout_issuer_seed: str | None = None
    callout_nats_user: str = "callout"
    callout_nats_password: str | None = None
    # the NATS account the callout places node agents and containers in
    callout_account: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]+$")] = "GPUSLICE"
    # node agents: the audience of their projected token, their ServiceAccount
    node_agent_audience: Annotated[str, Field(min_length=1)] = "gpuslice-nats"
    node_agent_service_account: Annotated[
        str, Field(pattern=r"^system:serviceaccount:[^:]+:[^:]+$")
    ] = "system:serviceaccount:gpuslice:gpuslice-deviceplugin"
    # authorization requests decided at once (each may wait on a TokenReview);
    # anyone who reaches NATS's port can send them
    callout_concurrency: Annotated[int, Field(ge=1, le=1024)] = 64
    # how long a container's telemetry user lasts: then the server closes the
    # connection and the interposer reconnects through the callout, which checks
    # the ledger again (a released pod's container is not let back in)
    telemetry_session: Duration = timedelta(minutes=10)
    # HTTP serves probes and metrics only: no request has a body
    max_request_body: BodyCap = ByteSize(64 * 1024)
    # the web console (read-only), on its own port; 0: no console
    console_port: Annotated[int, Field(ge=0, le=65535)] = 8090
    console_host: str = "127.0.0.1"
    # "none": anyone who reaches the port sees every tenant's pods, so only a
    # loopback host is allowed (reach it with kubectl port-forward);
    # "tokenreview": a bearer token the Kubernetes API reviews, and what its user
    # may list decides what the console shows
    console_auth: Literal["none", "tokenreview"] = "none"
    # how often the console's one shared snapshot is refreshed (and at once on a change)
    console_tick: Duration = timedelta(seconds=2)
    # how many of the newest audit events the console keeps in memory
    console_audit_events: Annotated[int, Field(ge=1, le=1_000_000)] = 20_000

    @model_validator(mode="after")
    def _console_closed_unless_loopback(self) -> InventorySettings:
        if self.console_port and self.console_auth == "none" and not _loopback(self.console_host):
            raise ValueError(
                f"GPUSLICE_CONSOLE_AUTH none serves every tenant's pods to whoever reaches"
                f" the port: GPUSLICE_CONSOLE_HOST must be a loopback address, not"
                f" {self.console_host!r} (or set GPUSLICE_CONSOLE_AUTH=tokenreview,"
                f" or GPUSLICE_CONSOLE_PORT=0 for no console)"
            )
        return self


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DevicePluginSettings(BusSettings):
    """The node agent: kubelet's device plugin, inventory and compute coordination.

    It holds no ledger credential: what it needs from the ledger it asks the
    inventory over NATS (:mod:`gpuslice_common.nodeapi`).
    """

    node_name: Annotated[str, Field(min_length=1)]
    # kubelet's device-plugin directory (kubelet.sock) and our socket's file name in it
    kubelet_dir: str = "/var/lib/kubelet/device-plugins"
    socket_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+\.sock$")] = "gpuslice.sock"
    listen_host: str = "0.0.0.0"
    metrics_port: Annotated[int, Field(ge=1, le=65535)] = 9400
    # where GPUs come from: NVML; configured simulated GPUs; or "auto", NVML when it
    # loads and sees a GPU, else the simulated ones (machines that may have no GPU)
    backend: Literal["auto", "nvml", "simulated"] = "nvml"
    # per-node settings (YAML or JSON): defaults, then overrides by node name
    node_config_file: str | None = None
    # host directory the DaemonSet mounts: the interposer, ld.so.preload and one
    # directory per GPU container for its shared region
    host_dir: str = "/usr/local/gpuslice"
    # where the library appears inside GPU containers (the grant and region
    # directory is fixed: gpuslice_common.grant.GRANT_DIR)
    container_lib_dir: str = "/usr/local/gpuslice"
    # the interposer as built into the device plugin's image, installed into host_dir
    interposer_library: str = "/opt/gpuslice/libgpuslice.so"
    inventory_interval: Duration = timedelta(seconds=10)  # inventory heartbeat
    health_interval: Duration = timedelta(seconds=5)  # device health polling
    coordinate_interval: Duration = timedelta(milliseconds=250)  # region flags
    # how long a container directory of a pod the ledger no longer holds is kept
    cleanup_grace: Duration = timedelta(minutes=10)
    # how long one request to the inventory is waited for before it is sent again
    # (a lost reply, an inventory replica that died), and how long kubelet's
    # Allocate may take in all while the inventory or its ledger is away
    inventory_timeout: Duration = timedelta(seconds=2)
    allocate_timeout: Duration = timedelta(seconds=30)
    # NATS as containers reach it (their credential is the token the inventory
    # issues for their pod at Allocate)
    telemetry_nats_url: str | None = None
    # where pod specs are read (CUDA_DISABLE_CONTROL): "cluster", "local", or "none"
    kube_api: Literal["cluster", "local", "none"] = "cluster"
    # HTTP serves probes and metrics only: no request has a body
    max_request_body: BodyCap = ByteSize(64 * 1024)
    # The enforcer (gpuslice_deviceplugin.enforcer): NVML's processes and their
    # utilisation sampled every interval, compared with the grants. A container's
    # memory on a card may pass its grant by the context allowance and this margin
    # before its largest process there is killed; its compute share, averaged
    # over the window, by the tolerance (percentage points) before it is throttled;
    # a process keeping the card busy while throttled for hog_after is killed.
    enforce: bool = True
    enforce_interval: Duration = timedelta(milliseconds=250)
    enforce_window: Duration = timedelta(seconds=3)
    enforce_memory_margin: ByteSize = ByteSize(64 << 20)
    enforce_compute_tolerance: Annotated[int, Field(ge=0, le=100)] = 10
    enforce_hog_after: Duration = timedelta(seconds=10)
    # where host processes and the cgroup trees are seen (hostPID, a hostPath of
    # /sys/fs/cgroup): the v2 hierarchy is found in /proc/self/mountinfo when unset
    proc_root: str = "/proc"
    cgroup_root: str | None = None
    cgroup_v1_freezer_root: str | None = "/sys/fs/cgroup/freezer"
    # DRA mode (gpuslice_common.dra): the agent publishes the node's cards as a
    # ResourceSlice pool and serves kubelet's DRA plugin API instead of the device
    # plugin's. With dra_consumable (the cluster runs DRAConsumableCapacity) several
    # claims share a card, each taking part of its memory and cores; without, cards
    # are offered whole.
    dra: bool = False
    dra_consumable: bool = True
    dra_plugins_dir: str = "/var/lib/kubelet/plugins"
    dra_registry_dir: str = "/var/lib/kubelet/plugins_registry"
    cdi_dir: str = "/var/run/cdi"


S = TypeVar("S", bound=BaseSettings)


def env_name(loc: tuple[int | str, ...]) -> str:
    """The environment variable behind a validation error location."""
    return ENV_PREFIX + NESTED_DELIMITER.join(str(part) for part in loc).upper()


def load(cls: type[S], **overrides: Any) -> S:
    """Read ``cls`` from the environment, or raise ConfigError naming each bad variable."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if p not in {"__root__"})
            message = str(err["msg"]).removeprefix("Value error, ")
            if err["type"] == "missing":
                message = "is required but not set"
            problems.append(f"{env_name(loc)}: {message}" if loc else message)
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None
    except SettingsError as exc:
        # Raised before validation when a group variable (GPUSLICE_REQUESTS) is not JSON.
        field = re.search(r'field "([^"]+)"', str(exc))
        where = env_name((field.group(1),)) if field else ENV_PREFIX + "*"
        raise ConfigError(
            f"invalid configuration: {where}: cannot parse value ({exc.__cause__ or exc})"
        ) from None
