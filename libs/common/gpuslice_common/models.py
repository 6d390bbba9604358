"""Typed data shared by every gpuslice component.

Units are fixed across the project: device memory in MiB (integers), compute in
percent of one card (0-100 before scaling), times as timezone-aware UTC datetimes.
"""

from __future__ import annotations

import enum
import math
from datetime import UTC, datetime
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NonNegInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
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
# A card of another vendor, whose UUID HAMi's plugins read back from pod annotations
# where "," ":" and ";" separate cards: none of those.
VENDOR_CARD_UUID_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9_./]*$"
MAX_NAME_LENGTH = 128  # a device's UUID and model name
# Whose accelerator a card is, as the ledger stores it ("nvidia", "hygon", "ascend910b3"):
# lower case, digits and inner dashes. Types come from HAMi's device configuration.
VENDOR_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$"
NVIDIA = "nvidia"
Vendor = Annotated[str, Field(min_length=1, max_length=32, pattern=VENDOR_PATTERN)]


def _is_nvidia(vendor: str) -> bool:
    return vendor == NVIDIA


def vendor_order(vendor: str) -> tuple[bool, str]:
    """How operators' views list vendors: NVIDIA's cards first, then the others by name."""
    return vendor != NVIDIA, vendor


class Frozen(BaseModel):
    """Base for value objects: immutable, and unknown fields are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def utcnow() -> datetime:
    return datetime.now(UTC)


# ---------------------------------------------------------------- devices and nodes


class VgpuMode(enum.StrEnum):
    """How a card is shared (HAMi's per-node ``operatingmode``, a pod's ``vgpu-mode``).

    ``hami-core``: the interposer enforces each container's memory and compute
    share. ``mig``: each container gets a MIG instance the device plugin makes at
    Allocate, at the placement the scheduler chose. ``mps``: NVIDIA's MPS server
    enforces the limits (``CUDA_MPS_*``) instead of the interposer.
    """

    HAMI_CORE = "hami-core"
    MIG = "mig"
    MPS = "mps"


# A MIG profile name as NVIDIA prints it: "1g.10gb", "3g.40gb", "1g.10gb+me", "1c.3g.40gb".
MIG_PROFILE_PATTERN = r"^([1-9][0-9]?c\.)?[1-9][0-9]?g\.[1-9][0-9]{0,4}gb(\+[a-z]{1,8})?$"
MAX_MIG_SLICES = 16  # memory slices of one card (8 on an A100/H100): a mask fits 16 bits
MAX_MIG_PROFILES = 32
MigProfileName = Annotated[str, Field(min_length=1, max_length=32, pattern=MIG_PROFILE_PATTERN)]
MigMask = Annotated[int, Field(ge=0, lt=1 << MAX_MIG_SLICES)]  # slices, one bit each


class MigPlacement(Frozen):
    """Where a GPU instance sits on its card, in memory slices (NVML's start and size)."""

    start: Annotated[int, Field(ge=0, lt=MAX_MIG_SLICES)]
    size: Annotated[int, Field(ge=1, le=MAX_MIG_SLICES)]

    @model_validator(mode="after")
    def _inside_card(self) -> MigPlacement:
        if self.start + self.size > MAX_MIG_SLICES:
            raise ValueError(
                f"MIG placement {self.start}+{self.size} ends past slice {MAX_MIG_SLICES}"
            )
        return self

    @property
    def mask(self) -> int:
        """The slices it covers, one bit each (bit 0 is slice 0)."""
        return ((1 << self.size) - 1) << self.start


class MigProfile(Frozen):
    """A GPU instance profile a card can make, with every placement NVML allows for it."""

    name: MigProfileName
    memory_mib: Annotated[int, Field(gt=0, le=MAX_DEVICE_MEMORY_MIB)]
    cores: Annotated[int, Field(ge=1, le=100)]  # the instance's share of the card's SMs, percent
    slices: Annotated[int, Field(ge=1, le=MAX_MIG_SLICES)]  # compute slices (the "3" of 3g)
    placements: Annotated[tuple[MigPlacement, ...], Field(min_length=1, max_length=MAX_MIG_SLICES)]


class MigInstance(Frozen):
    """A MIG instance that exists on a card and that gpuslice did not make (static MIG):
    its slices are taken for as long as the node agent reports it."""

    uuid: Annotated[
        str, Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=DEVICE_UUID_PATTERN)
    ]
    profile: MigProfileName
    placement: MigPlacement


class GpuDevice(Frozen):
    """One physical GPU as the node agent discovered it.

    ``mig`` is the card's MIG mode as NVML reports it. ``mode`` is how gpuslice
    shares it: a card in ``mig`` mode lists in ``mig_profiles`` the instances the
    scheduler may have made on it, and in ``mig_instances`` those that already
    exist and are not gpuslice's.
    """

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
    mode: VgpuMode = VgpuMode.HAMI_CORE
    mig_profiles: Annotated[tuple[MigProfile, ...], Field(max_length=MAX_MIG_PROFILES)] = ()
    mig_instances: Annotated[tuple[MigInstance, ...], Field(max_length=MAX_MIG_SLICES)] = ()
    vendor: Vendor = NVIDIA

    @property
    def mig_slice_mask(self) -> int:
        """Every slice some profile's placement covers: the card's MIG slices."""
        mask = 0
        for profile in self.mig_profiles:
            for placement in profile.placements:
                mask |= placement.mask
        return mask

    @property
    def mig_static_mask(self) -> int:
        """The slices the static instances (not gpuslice's) take."""
        mask = 0
        for instance in self.mig_instances:
            mask |= instance.placement.mask
        return mask

    @model_validator(mode="after")
    def _mig_consistent(self) -> GpuDevice:
        if self.vendor != NVIDIA and (self.mig or self.mode is not VgpuMode.HAMI_CORE):
            raise ValueError(f"a {self.vendor} card has neither MIG nor MPS")
        if (self.mode is VgpuMode.MIG) != bool(self.mig_profiles):
            raise ValueError("a card has MIG profiles exactly when its mode is mig")
        names = [p.name for p in self.mig_profiles]
        if len(set(names)) != len(names):
            raise ValueError("a MIG profile listed twice")
        taken = 0
        for instance in self.mig_instances:
            if taken & instance.placement.mask:
                raise ValueError(f"MIG instance {instance.uuid} overlaps another")
            taken |= instance.placement.mask
        # on a mig card, static instances lie among the slices its profiles cover;
        # a hami-core card with MIG on (static MIG) has no profiles to check them by
        if self.mode is VgpuMode.MIG and taken & ~self.mig_slice_mask:
            raise ValueError("a static MIG instance lies outside the card's MIG slices")
        return self


# ---------------------------------------------------------------- enforcement layers


class LayerState(enum.StrEnum):
    """Whether a layer holds a card's containers to their grants."""

    ENFORCING = "enforcing"
    MISSING = "missing"


MAX_LAYER_NOTE = 160

# What nvidia-container-toolkit's CDI hook ``apply-cuda-memory-limits`` reads from
# a container's environment and sets on its cgroup as the driver's soft (request)
# and hard (limit) device-memory limits. gpuslice writes them as decimal bytes
# (docs/architecture.md, "Layer 1"); a pod may never set them itself.
DRIVER_LIMIT_ENV: Final = "NVIDIA_GPU_MEMORY_LIMIT"
DRIVER_REQUEST_ENV: Final = "NVIDIA_GPU_MEMORY_REQUEST"


class CardLayers(Frozen):
    """Which layers enforce the grants on one card (docs/architecture.md,
    "Enforcement layers"): ``driver``, the driver's per-cgroup device-memory
    limits, with ``driver_note`` saying which backend holds them ("dmem",
    "driver") or why they are missing; ``agent_memory`` and ``agent_compute``,
    the node agent's sampling of the card's processes; ``interposer``, the
    library in each container."""

    driver: LayerState = LayerState.MISSING
    driver_note: (
        Annotated[str, Field(max_length=MAX_LAYER_NOTE, pattern=PRINTABLE_PATTERN)] | None
    ) = None
    agent_memory: LayerState = LayerState.MISSING
    agent_compute: LayerState = LayerState.MISSING
    interposer: LayerState = LayerState.ENFORCING

    def enforcing(self) -> tuple[str, ...]:
        """The names of the layers that enforce, innermost last."""
        named = (
            ("driver", self.driver),
            ("agent-memory", self.agent_memory),
            ("agent-compute", self.agent_compute),
            ("interposer", self.interposer),
        )
        return tuple(name for name, state in named if state is LayerState.ENFORCING)


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
    # The vendor whose cards this lists: registering it leaves other vendors' cards be.
    vendor: Vendor = NVIDIA
    # card UUID -> which layers enforce on it; empty from agents that do not report it
    layers: Annotated[dict[str, CardLayers], Field(max_length=MAX_DEVICES)] = Field(
        default_factory=dict
    )
    # The node's agent serves kubelet through DRA (gpuslice_common.dra): its cards are
    # granted by prepared ResourceClaims only, never by the device plugin path.
    dra: bool = False

    @model_validator(mode="after")
    def _unique_devices(self) -> NodeInventory:
        if any(d.vendor != self.vendor for d in self.devices):
            raise ValueError(f"an inventory of {self.vendor} cards lists another vendor's card")
        uuids = [d.uuid for d in self.devices]
        if len(set(uuids)) != len(uuids):
            raise ValueError("device UUIDs must be unique within a node")
        indexes = [d.index for d in self.devices]
        if len(set(indexes)) != len(indexes):
            raise ValueError("device indexes must be unique within a node")
        if not set(self.layers) <= set(uuids):
            raise ValueError("enforcement layers are reported for a card the node does not list")
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
    mig_mask: MigMask = 0  # the MIG slices gpuslice's instances take (mode mig)


class GpuState(Frozen):
    """A card as the ledger sees it: facts, capacity and current usage."""

    node: str
    device: GpuDevice
    capacity: GpuCapacity
    used: GpuUsage
    present: bool = True
    cordoned: bool = False  # an operator took the card out of scheduling; its pods stay
    layers: CardLayers | None = None  # None: the node's agent reports no layers

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
    """Device memory per GPU: an exact amount or a share of the card.

    Never 0: a container's limit of 0 MiB reads as "no limit" inside it, so an
    unset amount is a default (see :mod:`gpuslice_common.requests`), not 0.
    """

    mib: PositiveInt | None = None
    percent: Annotated[int, Field(ge=1, le=100)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> MemoryRequest:
        if (self.mib is None) == (self.percent is None):
            raise ValueError("memory request needs exactly one of mib or percent")
        return self

    def on_card(self, card_memory_mib: int) -> int:
        """MiB this request takes on a card with the given schedulable memory: a
        percentage rounds down, but to no less than 1 MiB (0 would be no limit)."""
        if self.mib is not None:
            return self.mib
        assert self.percent is not None
        return max(card_memory_mib * self.percent // 100, 1)


MAX_DRS_SLICES = 1024


class DrsDemand(Frozen):
    """What a container asks of an Enflame card shared by DRS profiles: a profile of
    ``size`` slices (``enflame.com/drs-gcu``), or else the smallest profile with at
    least ``memory`` (``enflame.com/gcu-memory``: GB, or MiB when above twice the
    largest profile's GB, as HAMi reads it) and ``cores`` percent. The profile is
    chosen on the node, whose profiles the card's model lists."""

    size: Annotated[int, Field(ge=1, le=MAX_DRS_SLICES)] | None = None
    memory: Annotated[int, Field(ge=0, le=MAX_DEVICE_MEMORY_MIB)] = 0
    cores: Annotated[int, Field(ge=0, le=100)] = 0


class ContainerGpuRequest(Frozen):
    """What one container asks for, per GPU, after defaults are applied."""

    name: Annotated[str, Field(min_length=1)]
    init: bool = False
    sidecar: bool = False  # an init container with restartPolicy Always: runs beside the apps
    count: Annotated[int, Field(ge=1)]
    memory: MemoryRequest
    cores: Percent = 0
    priority: Literal[0, 1] = 1
    # whose cards: another vendor's only from its own resources (left out of the
    # JSON for NVIDIA, whose records stay as they were)
    vendor: Annotated[Vendor, Field(exclude_if=_is_nvidia)] = NVIDIA
    # Enflame DRS: the profile asked for, chosen per node (memory and cores are then
    # the profile's); None for every other card
    drs: Annotated[DrsDemand | None, Field(exclude_if=lambda d: d is None)] = None

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


# A Kubernetes object name (DNS-1123 subdomain), an RFC 1123 label, an object's UID.
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
K8S_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
UID_PATTERN = r"^[A-Za-z0-9_-]+$"


class ClaimRef(Frozen):
    """A ResourceClaim (DRA mode) as kubelet names it to the plugin."""

    namespace: Annotated[str, Field(min_length=1, max_length=63, pattern=K8S_LABEL_PATTERN)]
    name: Annotated[str, Field(min_length=1, max_length=253, pattern=K8S_NAME_PATTERN)]
    uid: Annotated[str, Field(min_length=1, max_length=128, pattern=UID_PATTERN)]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


MAX_SCORING_WEIGHT = 10**9


class ScoringWeights(Frozen):
    """How much slots, cores and memory in use count in HAMi's card score (the
    ``binpack`` and ``spread`` GPU policies); HAMi's default weighs them alike."""

    slot: Annotated[int, Field(ge=0, le=MAX_SCORING_WEIGHT)] = 1
    core: Annotated[int, Field(ge=0, le=MAX_SCORING_WEIGHT)] = 1
    memory: Annotated[int, Field(ge=0, le=MAX_SCORING_WEIGHT)] = 1

    @model_validator(mode="after")
    def _some_weight(self) -> ScoringWeights:
        if self.slot == 0 and self.core == 0 and self.memory == 0:
            raise ValueError("at least one scoring weight must be positive")
        return self


class PodGpuRequest(Frozen):
    """Everything the control plane needs to know about a pod's GPU demand."""

    pod: PodRef
    containers: tuple[ContainerGpuRequest, ...]
    selector: DeviceSelector = DeviceSelector()
    gpu_policy: GpuPolicy | None = None
    node_policy: NodePolicy | None = None
    vgpu_mode: VgpuMode | None = None  # None: a card of any mode will do, as in HAMi
    scoring_weights: ScoringWeights = ScoringWeights()
    warnings: tuple[str, ...] = ()

    @property
    def vendor(self) -> str:
        """The vendor whose cards every container asks for (parse_pod keeps it one)."""
        return self.containers[0].vendor if self.containers else NVIDIA

    @property
    def init_containers(self) -> tuple[ContainerGpuRequest, ...]:
        return tuple(c for c in self.containers if c.init)

    @property
    def app_containers(self) -> tuple[ContainerGpuRequest, ...]:
        return tuple(c for c in self.containers if not c.init)


# ---------------------------------------------------------------- placements


class MigGrant(Frozen):
    """The MIG instance a grant on a ``mig`` card stands for: the device plugin makes
    this profile at this placement at Allocate."""

    profile: MigProfileName
    placement: MigPlacement


class DeviceGrant(Frozen):
    """One card given to one container, with the share it may use."""

    uuid: str
    memory_mib: NonNegInt
    cores: Percent
    mig: MigGrant | None = None


class ContainerAssignment(Frozen):
    name: str
    init: bool = False
    sidecar: bool = False
    vendor: Annotated[Vendor, Field(exclude_if=_is_nvidia)] = NVIDIA  # as the request's
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
    CARD_MIG_TOPOLOGY_INFEASIBLE = "CardMigTopologyInfeasible"
    NODE_INSUFFICIENT_DEVICE = "NodeInsufficientDevice"


class DeviceFootprint(Frozen):
    """What one pod holds on one card at its peak.

    ``mig_mask`` is the MIG slices its instances take on the card: every
    container's, init containers' included, at once. kubelet asks the device
    plugin to allocate every container of a pod when it admits the pod, before
    the first init container starts, so an init container's instance exists
    beside the app containers' instances: they never share slices.
    """

    memory_mib: NonNegInt = 0
    cores: NonNegInt = 0
    slots: NonNegInt = 0
    exclusive: bool = False
    mig_mask: MigMask = 0

    def peak(self, other: DeviceFootprint) -> DeviceFootprint:
        return DeviceFootprint(
            memory_mib=max(self.memory_mib, other.memory_mib),
            cores=max(self.cores, other.cores),
            slots=max(self.slots, other.slots),
            exclusive=self.exclusive or other.exclusive,
            mig_mask=self.mig_mask | other.mig_mask,
        )

    def plus(self, grant: DeviceGrant) -> DeviceFootprint:
        return DeviceFootprint(
            memory_mib=self.memory_mib + grant.memory_mib,
            cores=self.cores + grant.cores,
            slots=self.slots + 1,
            exclusive=self.exclusive or grant.cores == 100,
            mig_mask=self.mig_mask | (grant.mig.placement.mask if grant.mig else 0),
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
    # DRA mode: the ResourceClaim whose allocation this records (None: device plugin)
    claim: Annotated[ClaimRef | None, Field(exclude_if=lambda c: c is None)] = None

    @model_validator(mode="after")
    def _has_containers(self) -> Placement:
        if not self.containers:
            raise ValueError("a placement needs at least one container")
        names = [c.name for c in self.containers]
        if len(set(names)) != len(names):
            raise ValueError("container names in a placement must be unique")
        taken: dict[str, int] = {}  # a pod's MIG instances all exist at once: see DeviceFootprint
        for container in self.containers:
            for grant in container.devices:
                if grant.mig is None:
                    continue
                mask = grant.mig.placement.mask
                if taken.get(grant.uuid, 0) & mask:
                    raise ValueError(
                        f"container {container.name!r}: MIG instance on {grant.uuid} "
                        "overlaps another of the pod's"
                    )
                taken[grant.uuid] = taken.get(grant.uuid, 0) | mask
        return self

    def to_annotation(self) -> str:
        """The durable record written on the pod (:data:`PLACEMENT_ANNOTATION`)."""
        return self.model_dump_json(include={"pod", "node", "containers", "policy", "claim"})

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

        A claim's placement (DRA) makes no card exclusive: kube-scheduler only
        sums what claims consume, a share of all cores included.
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
                mig_mask=base.mig_mask | fp.mig_mask,
            )
        observe(together)
        if self.claim is not None:
            return {u: fp.model_copy(update={"exclusive": False}) for u, fp in peak.items()}
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
    """One device of a sample: the container's counters from its shared region."""

    uuid: Annotated[
        str, Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=DEVICE_UUID_PATTERN)
    ]
    used_bytes: Counter64
    # The region's highest `used` since it was made. Optional: interposers before
    # it was published leave it out. It may lag `used_bytes` by one reservation
    # (the region raises `used` first); readers take the larger of the two.
    peak_bytes: Counter64 = 0
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
