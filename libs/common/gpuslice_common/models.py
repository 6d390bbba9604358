"""Typed data shared by every gpuslice component.

Units are fixed across the project: device memory in MiB (integers), compute in
percent of one card (0-100 before scaling), times as timezone-aware UTC datetimes.
"""

from __future__ import annotations

import enum
import math
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NonNegInt = Annotated[int, Field(ge=0)]
Percent = Annotated[int, Field(ge=0, le=100)]

# Bounds of what a node agent may report. Generous beyond any real card, but
# finite: every number stays an exact integer in Redis's Lua (doubles, printed
# with 14 significant digits), so the ledger stores it as plain digits.
MAX_DEVICE_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB
MAX_DEVICES = 1024  # cards (MIG instances included) on one node; indexes below it
MAX_NUMA_NODE = 1023  # Linux numbers at most 1024 NUMA nodes
MAX_SPLIT_COUNT = 1024
MAX_SCALING = 100.0
# What scaling can make of them: a card's schedulable capacity.
MAX_CAPACITY_MIB = int(MAX_DEVICE_MEMORY_MIB * MAX_SCALING)
MAX_CAPACITY_CORES = int(100 * MAX_SCALING)

# A Kubernetes node name (an RFC 1123 subdomain), as subjects and ledger keys need it.
NODE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
NodeName = Annotated[str, Field(min_length=1, max_length=253, pattern=NODE_NAME_PATTERN)]
# Printable ASCII without leading or trailing blanks: no line breaks or escapes in logs.
PRINTABLE_PATTERN = r"^[!-~]([ -~]*[!-~])?$"
DEVICE_UUID_PATTERN = r"^[A-Za-z0-9_.:/-]+$"
MAX_NAME_LENGTH = 128  # a device's UUID and model name


class Frozen(BaseModel):
    """Base for value objects: immutable, and unknown fields are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def utcnow() -> datetime:
    return datetime.now(UTC)


# ---------------------------------------------------------------- devices and nodes


class GpuDevice(Frozen):
    """One physical GPU as the node agent discovered it."""

    uuid: Annotated[
        str, Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=DEVICE_UUID_PATTERN)
    ]
    index: Annotated[int, Field(ge=0, lt=MAX_DEVICES)]
    model: Annotated[
        str, Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=PRINTABLE_PATTERN)
    ]
    memory_mib: Annotated[int, Field(gt=0, le=MAX_DEVICE_MEMORY_MIB)]
    numa: Annotated[int, Field(ge=0, le=MAX_NUMA_NODE)] | None = None
    healthy: bool = True
    mig: bool = False


class NodeInventory(Frozen):
    """A node's full device list and sharing configuration, sent as a heartbeat.

    Every field is bounded (the constants above), so one node's report cannot
    put a value in the ledger that readers would have to refuse.
    """

    node: NodeName
    devices: Annotated[tuple[GpuDevice, ...], Field(max_length=MAX_DEVICES)]
    split_count: Annotated[int, Field(ge=1, le=MAX_SPLIT_COUNT)] = 10
    memory_scaling: Annotated[float, Field(gt=0, le=MAX_SCALING, allow_inf_nan=False)] = 1.0
    core_scaling: Annotated[float, Field(gt=0, le=MAX_SCALING, allow_inf_nan=False)] = 1.0
    sent_at: datetime = Field(default_factory=utcnow)

    @model_validator(mode="after")
    def _unique_devices(self) -> NodeInventory:
        uuids = [d.uuid for d in self.devices]
        if len(set(uuids)) != len(uuids):
            raise ValueError("device UUIDs must be unique within a node")
        indexes = [d.index for d in self.devices]
        if len(set(indexes)) != len(indexes):
            raise ValueError("device indexes must be unique within a node")
        return self

    def capacity(self, device: GpuDevice) -> GpuCapacity:
        """Schedulable capacity of one of this node's cards after scaling."""
        return GpuCapacity(
            memory_mib=math.floor(device.memory_mib * self.memory_scaling),
            cores=math.floor(100 * self.core_scaling),
            slots=self.split_count,
        )


class GpuCapacity(Frozen):
    memory_mib: NonNegInt
    cores: NonNegInt
    slots: NonNegInt


class GpuUsage(Frozen):
    """What reservations currently hold on one card."""

    memory_mib: NonNegInt = 0
    cores: NonNegInt = 0
    slots: NonNegInt = 0
    exclusive_owner: str | None = None


class GpuState(Frozen):
    """A card as the ledger sees it: facts, capacity and current usage."""

    node: str
    device: GpuDevice
    capacity: GpuCapacity
    used: GpuUsage
    present: bool = True
    cordoned: bool = False  # an operator took the card out of scheduling; its pods stay

    @property
    def free_memory_mib(self) -> int:
        return max(0, self.capacity.memory_mib - self.used.memory_mib)

    @property
    def free_cores(self) -> int:
        return max(0, self.capacity.cores - self.used.cores)

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity.slots - self.used.slots)


# ---------------------------------------------------------------- requests


class MemoryRequest(Frozen):
    """Device memory per GPU: an exact amount or a share of the card."""

    mib: NonNegInt | None = None
    percent: Percent | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> MemoryRequest:
        if (self.mib is None) == (self.percent is None):
            raise ValueError("memory request needs exactly one of mib or percent")
        return self

    def on_card(self, card_memory_mib: int) -> int:
        """MiB this request takes on a card with the given schedulable memory."""
        if self.mib is not None:
            return self.mib
        assert self.percent is not None
        return card_memory_mib * self.percent // 100


class ContainerGpuRequest(Frozen):
    """What one container asks for, per GPU, after defaults are applied."""

    name: Annotated[str, Field(min_length=1)]
    init: bool = False
    sidecar: bool = False  # an init container with restartPolicy Always: runs beside the apps
    count: Annotated[int, Field(ge=1)]
    memory: MemoryRequest
    cores: Percent = 0
    priority: Literal[0, 1] = 1

    @property
    def exclusive(self) -> bool:
        """A 100 % compute request takes the whole card alone."""
        return self.cores == 100


class GpuPolicy(enum.StrEnum):
    """How devices are chosen on a node."""

    FRAGMENTATION = "fragmentation"
    BINPACK = "binpack"
    SPREAD = "spread"


class NodePolicy(enum.StrEnum):
    """How nodes are ranked."""

    BINPACK = "binpack"
    SPREAD = "spread"


class VgpuMode(enum.StrEnum):
    HAMI_CORE = "hami-core"
    MIG = "mig"


class DeviceSelector(Frozen):
    """Pod-level constraints on which cards may be used."""

    include_types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    include_uuids: tuple[str, ...] = ()
    exclude_uuids: tuple[str, ...] = ()
    numa_bind: bool = False

    def admits(self, device: GpuDevice) -> bool:
        model = device.model.lower()
        if self.include_types and not any(t.lower() in model for t in self.include_types):
            return False
        if any(t.lower() in model for t in self.exclude_types):
            return False
        if self.include_uuids and device.uuid not in self.include_uuids:
            return False
        return device.uuid not in self.exclude_uuids


class PodRef(Frozen):
    uid: Annotated[str, Field(min_length=1, max_length=128)]
    namespace: str = "default"
    name: str = ""


class PodGpuRequest(Frozen):
    """Everything the control plane needs to know about a pod's GPU demand."""

    pod: PodRef
    containers: tuple[ContainerGpuRequest, ...]
    selector: DeviceSelector = DeviceSelector()
    gpu_policy: GpuPolicy | None = None
    node_policy: NodePolicy | None = None
    vgpu_mode: VgpuMode = VgpuMode.HAMI_CORE
    warnings: tuple[str, ...] = ()

    @property
    def init_containers(self) -> tuple[ContainerGpuRequest, ...]:
        return tuple(c for c in self.containers if c.init)

    @property
    def app_containers(self) -> tuple[ContainerGpuRequest, ...]:
        return tuple(c for c in self.containers if not c.init)


# ---------------------------------------------------------------- placements


class DeviceGrant(Frozen):
    """One card given to one container, with the share it may use."""

    uuid: str
    memory_mib: NonNegInt
    cores: Percent


class ContainerAssignment(Frozen):
    name: str
    init: bool = False
    sidecar: bool = False
    devices: tuple[DeviceGrant, ...]
    priority: Literal[0, 1] = 1

    @model_validator(mode="after")
    def _distinct_cards(self) -> ContainerAssignment:
        uuids = [d.uuid for d in self.devices]
        if not uuids:
            raise ValueError(f"container {self.name!r} is assigned no device")
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"container {self.name!r} is assigned the same card twice")
        return self


class FitReason(enum.StrEnum):
    """Why a card (and so a node) cannot take a request; HAMi's reason names."""

    CARD_NOT_FOUND = "CardNotFound"
    CARD_NOT_HEALTH = "CardNotHealth"
    CARD_CORDONED = "CardCordoned"
    CARD_TYPE_MISMATCH = "CardTypeMismatch"
    NUMA_NOT_FIT = "NumaNotFit"
    CARD_UUID_MISMATCH = "CardUuidMismatch"
    CARD_TIME_SLICING_EXHAUSTED = "CardTimeSlicingExhausted"
    CARD_INSUFFICIENT_MEMORY = "CardInsufficientMemory"
    CARD_INSUFFICIENT_CORE = "CardInsufficientCore"
    EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT = "ExclusiveDeviceAllocateConflict"
    CARD_COMPUTE_UNITS_EXHAUSTED = "CardComputeUnitsExhausted"
    ALLOCATED_CARDS_INSUFFICIENT_REQUEST = "AllocatedCardsInsufficientRequest"


class DeviceFootprint(Frozen):
    """What one pod holds on one card at its peak."""

    memory_mib: NonNegInt = 0
    cores: NonNegInt = 0
    slots: NonNegInt = 0
    exclusive: bool = False

    def peak(self, other: DeviceFootprint) -> DeviceFootprint:
        return DeviceFootprint(
            memory_mib=max(self.memory_mib, other.memory_mib),
            cores=max(self.cores, other.cores),
            slots=max(self.slots, other.slots),
            exclusive=self.exclusive or other.exclusive,
        )

    def plus(self, grant: DeviceGrant) -> DeviceFootprint:
        return DeviceFootprint(
            memory_mib=self.memory_mib + grant.memory_mib,
            cores=self.cores + grant.cores,
            slots=self.slots + 1,
            exclusive=self.exclusive or grant.cores == 100,
        )


# Pod annotation holding the placement: the copy the ledger can be rebuilt from.
PLACEMENT_ANNOTATION = "gpuslice.io/placement"


class PlacementState(enum.StrEnum):
    RESERVED = "reserved"
    BOUND = "bound"
    ALLOCATED = "allocated"
    RELEASED = "released"


class Placement(Frozen):
    """A pod's devices on one node: the ledger's record of a reservation."""

    pod: PodRef
    node: str
    containers: tuple[ContainerAssignment, ...]
    policy: str = ""
    state: PlacementState = PlacementState.RESERVED
    allocated_containers: NonNegInt = 0
    reserved_at: datetime | None = None
    bound_at: datetime | None = None
    allocated_at: datetime | None = None
    released_at: datetime | None = None
    release_reason: str = ""

    @model_validator(mode="after")
    def _has_containers(self) -> Placement:
        if not self.containers:
            raise ValueError("a placement needs at least one container")
        names = [c.name for c in self.containers]
        if len(set(names)) != len(names):
            raise ValueError("container names in a placement must be unique")
        return self

    def to_annotation(self) -> str:
        """The durable record written on the pod (:data:`PLACEMENT_ANNOTATION`)."""
        return self.model_dump_json(include={"pod", "node", "containers", "policy"})

    @classmethod
    def from_annotation(cls, value: str) -> Placement:
        """Read a record written by :meth:`to_annotation`; raises ValueError when malformed."""
        return cls.model_validate_json(value)

    def footprint(self) -> dict[str, DeviceFootprint]:
        """Per card, the most this pod holds at any moment.

        Kubernetes runs a pod in phases: each plain init container alone beside
        the sidecars started before it (init containers with restartPolicy
        Always), then the app containers together beside every sidecar. A card
        carries the maximum over those phases.
        """
        sidecars: dict[str, DeviceFootprint] = {}
        apps: dict[str, DeviceFootprint] = {}
        peak: dict[str, DeviceFootprint] = {}

        def observe(phase: dict[str, DeviceFootprint]) -> None:
            for uuid, fp in phase.items():
                peak[uuid] = peak.get(uuid, DeviceFootprint()).peak(fp)

        for container in self.containers:
            if container.sidecar:
                _add(sidecars, container.devices)
                observe(sidecars)
            elif container.init:
                observe(_add(dict(sidecars), container.devices))
            else:
                _add(apps, container.devices)
        together = dict(sidecars)
        for uuid, fp in apps.items():
            base = together.get(uuid, DeviceFootprint())
            together[uuid] = DeviceFootprint(
                memory_mib=base.memory_mib + fp.memory_mib,
                cores=base.cores + fp.cores,
                slots=base.slots + fp.slots,
                exclusive=base.exclusive or fp.exclusive,
            )
        observe(together)
        return peak


def _add(
    phase: dict[str, DeviceFootprint], grants: tuple[DeviceGrant, ...]
) -> dict[str, DeviceFootprint]:
    for grant in grants:
        phase[grant.uuid] = phase.get(grant.uuid, DeviceFootprint()).plus(grant)
    return phase


class PodEnded(Frozen):
    """A pod that no longer holds its devices: it terminated (``Succeeded``,
    ``Failed``) or was deleted. Where no API server can be watched (the dev
    stack), whatever stands in for it says so on the bus."""

    pod: PodRef
    phase: Literal["Succeeded", "Failed", "Deleted"]


# ---------------------------------------------------------------- telemetry


# Bounds of a telemetry sample: what the interposer can send, no more. A
# container's region holds at most GS_MAX_DEVICES (region_layout.h) devices; its
# counters are uint64_t; Linux's pid_max is at most 2^22.
MAX_TELEMETRY_DEVICES = 16  # GS_MAX_DEVICES
MAX_COUNTER = 2**64 - 1
MAX_PID = 2**31 - 1
# A Kubernetes container name: an RFC 1123 label.
CONTAINER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_CONTAINER_NAME = 63
Counter64 = Annotated[int, Field(ge=0, le=MAX_COUNTER)]


class DeviceTelemetry(Frozen):
    uuid: Annotated[
        str, Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=DEVICE_UUID_PATTERN)
    ]
    used_bytes: Counter64
    limit_bytes: Counter64
    sm_percent: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] = 0.0
    throttled_ns: Counter64 = 0
    denied_allocations: Counter64 = 0


class TelemetrySample(Frozen):
    """One report from the interposer in a container."""

    node: NodeName
    pod_uid: Annotated[str, Field(min_length=1, max_length=128)]
    container: Annotated[
        str, Field(min_length=1, max_length=MAX_CONTAINER_NAME, pattern=CONTAINER_NAME_PATTERN)
    ]
    pid: Annotated[int, Field(ge=0, le=MAX_PID)]
    time: datetime
    devices: Annotated[tuple[DeviceTelemetry, ...], Field(max_length=MAX_TELEMETRY_DEVICES)]
    dropped_samples: Counter64 = 0

    @model_validator(mode="after")
    def _distinct_devices(self) -> TelemetrySample:
        uuids = [d.uuid for d in self.devices]
        if len(set(uuids)) != len(uuids):
            raise ValueError("a device twice in one sample")
        return self
