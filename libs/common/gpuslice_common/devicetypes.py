"""Device types as data: HAMi's device configuration (``device-config.yaml``).

HAMi's scheduler reads one YAML document with a section per accelerator
vendor (``nvidia``, ``cambricon``, ``hygon``, ``metax``, ``enflame``,
``mthreads``, ``iluvatars``, ``kunlun``, ``awsneuron``, ``amd``, ``vastai``,
``biren``, ``vnpus``). Each names the vendor's Kubernetes resources and, for
some, defaults and limits. :func:`parse_device_config` turns such a document
into :class:`DeviceType` values: typed, bounded, and strict. A value of the
wrong kind or out of range is refused with a message naming its key; a
section gpuslice does not know is kept as an unsupported type with a warning,
never read as NVIDIA.

How a vendor's device plugin announces its cards on the node (the register and
handshake annotations, :class:`Announcement`) is HAMi behaviour fixed per
vendor, not configuration; it is attached here so that one place holds what
there is to know about a type.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gpuslice_common.config import (
    CommonSettings,
    RequestSettings,
    VendorResources,
    VendorTemplate,
)
from gpuslice_common.models import (
    MAX_DEVICE_MEMORY_MIB,
    MAX_SCALING,
    MAX_SPLIT_COUNT,
    NVIDIA,
    VENDOR_PATTERN,
)

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 1024 * 1024
MAX_TYPES = 256  # chips in the list sections, all together
MAX_TEMPLATES = 64  # virtual-device templates of one chip
MAX_MEMORY_FACTOR = 1 << 20

_VENDOR = re.compile(VENDOR_PATTERN)
# A Kubernetes extended resource name: "<domain>/<name>".
_RESOURCE = re.compile(
    r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_WORD = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_. ]{0,62}[A-Za-z0-9])?$")


class DeviceConfigError(ValueError):
    """The device configuration cannot be used; the message names the key."""


class AnnotationFormat(enum.StrEnum):
    """How a register annotation lists a node's cards.

    ``json``: a JSON list of objects (``id``, ``index``, ``count``, ``devmem``,
    ``devcore``, ``type``, ``numa``, ``mode``, ``health``). ``colon``: the older
    text form, one card per ``:``-ended entry of 7 or 9 comma-separated fields
    (uuid, split count, memory MiB, cores, type, numa, health[, index, mode]).
    """

    JSON = "json"
    COLON = "colon"


@dataclass(frozen=True)
class Announcement:
    """Where a vendor's device plugin announces its cards on the node object.

    ``handshake`` is None for a vendor whose plugin keeps none; then the node's
    capacity of ``DeviceType.count_resource`` says whether the plugin is there.
    ``cores`` replaces the cores a card reports (HAMi sets 100 for vendors whose
    plugins report none). ``allocate`` names the pod annotations a plugin reads.
    """

    register: str
    handshake: str | None
    format: AnnotationFormat
    cores: int | None = None
    # the word of HAMi's pod annotations hami.io/<word>-devices-to-allocate and
    # -devices-allocated, which the vendor's plugin reads at Allocate (None: the
    # type's common word)
    allocate: str | None = None


class Rules(enum.StrEnum):
    """How a vendor's pods are read and what its device plugin reads at bind.

    ``hami``: HAMi's common form (count, memory, cores; the
    ``hami.io/<word>-devices-to-allocate`` encoding). The others add the
    vendor's own rules and annotations (see :mod:`gpuslice_common.vendorrules`).
    """

    HAMI = "hami"
    ASCEND = "ascend"
    CAMBRICON = "cambricon"
    MTHREADS = "mthreads"
    METAX_GPU = "metax-gpu"
    METAX_SGPU = "metax-sgpu"
    ENFLAME = "enflame"
    KUNLUN = "kunlun"


class CardSource(enum.StrEnum):
    """Where a vendor's cards are read from on the node object.

    ``register``: HAMi's register and handshake annotations (:class:`Announcement`).
    ``capacity``: the node's capacity of the vendor's resources, cards derived as
    HAMi's scheduler derives them (:class:`CapacityCards`). ``metax``: Metax's
    own ``metax-tech.com/node-gpu-devices``. ``enflame``: Enflame's own
    ``enflame.com/gcu-drs-capacity``.
    """

    REGISTER = "register"
    CAPACITY = "capacity"
    METAX = "metax"
    ENFLAME = "enflame"


@dataclass(frozen=True)
class CapacityCards:
    """How HAMi's scheduler makes a vendor's cards from its node capacity.

    With ``cores_resource``, the node has ``capacity[cores_resource] /
    cores_per_card`` cards (rounded up), each with ``capacity[memory_resource] *
    memory_unit * cores_per_card / capacity[cores_resource]`` MiB; without, one
    card per unit of the count resource, each of ``memory_mib``. Card ``i`` is
    ``<node>-<word>-<i>``, of model ``model``.
    """

    word: str
    model: str
    cores_per_card: int = 100
    cores_resource: str | None = None
    memory_resource: str | None = None
    memory_unit: int = 1
    memory_mib: int = 0
    split_count: int = 100
    numa_halves: bool = False  # the upper half of the cards is on NUMA node 1


@dataclass(frozen=True)
class Selectors:
    """The pod annotations that choose a vendor's cards by type or by UUID (HAMi's
    keys, per vendor); ``gpuslice.io/use-gputype`` and the like apply too."""

    use_type: str | None = None
    nouse_type: str | None = None
    use_uuid: tuple[str, ...] = ()
    nouse_uuid: tuple[str, ...] = ()


def _uuid_keys(use: str, nouse: str) -> Selectors:
    return Selectors(use_uuid=(use,), nouse_uuid=(nouse,))


@dataclass(frozen=True)
class Template:
    """A virtual-device template of an Ascend chip: memory MiB and AI cores."""

    name: str
    memory_mib: int
    ai_cores: int
    ai_cpus: int = 0


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator, as the device configuration describes it.

    ``vendor`` is the name the ledger stores with each card of this type.
    ``memory_factor`` multiplies the memory a pod asks for into MiB (a vendor
    whose resource counts in larger units). ``supported`` types are those whose
    nodes gpuslice reads (:attr:`announcement`); the others are kept so that
    their resources are known and never taken for NVIDIA's.
    """

    section: str
    vendor: str
    common_word: str
    count_resource: str | None
    memory_resource: str | None = None
    memory_percentage_resource: str | None = None
    core_resource: str | None = None
    priority_resource: str | None = None
    memory_factor: int = 1
    split_count: int = 10
    memory_scaling: float = 1.0
    core_scaling: float = 1.0
    default_memory_mib: int = 0
    default_cores: int = 0
    default_count: int = 1
    chip_name: str | None = None
    memory_capacity_mib: int | None = None
    ai_cores: int | None = None
    templates: tuple[Template, ...] = ()
    memory_allocatable_mib: int | None = None
    announcement: Announcement | None = None
    supported: bool = True
    rules: Rules = Rules.HAMI
    source: CardSource = CardSource.REGISTER
    capacity: CapacityCards | None = None
    selectors: Selectors = Selectors()

    @property
    def readable(self) -> bool:
        """Whether gpuslice knows where to read this type's cards."""
        if self.source is CardSource.REGISTER:
            return self.announcement is not None
        return self.source is not CardSource.CAPACITY or self.capacity is not None

    @property
    def resources(self) -> tuple[str, ...]:
        """Every resource name a pod may use for this type."""
        names = (
            self.count_resource,
            self.memory_resource,
            self.memory_percentage_resource,
            self.core_resource,
            self.priority_resource,
        )
        return tuple(n for n in names if n)


@dataclass(frozen=True)
class DeviceConfig:
    types: tuple[DeviceType, ...]
    warnings: tuple[str, ...] = field(default=())

    def by_vendor(self) -> dict[str, DeviceType]:
        return {t.vendor: t for t in self.types}

    def announced(self) -> tuple[DeviceType, ...]:
        """The types whose cards gpuslice reads from node objects."""
        return tuple(t for t in self.types if t.supported and t.readable)


# ---------------------------------------------------------------- field readers


def _shown(value: Any) -> str:
    return repr(value)[:40]


class _Section:
    """One mapping of the document, read key by key; ``path`` names it in messages."""

    def __init__(self, path: str, raw: Any, known: frozenset[str], warnings: list[str]) -> None:
        if not isinstance(raw, Mapping):
            raise DeviceConfigError(f"device config: {path} is not a mapping")
        self.path = path
        self.raw = raw
        for key in raw:
            if not isinstance(key, str):
                raise DeviceConfigError(f"device config: {path} has a key that is not text")
            if key not in known:
                warnings.append(f"device config: {path}.{key} is not a known setting; ignored")

    def where(self, key: str) -> str:
        return f"{self.path}.{key}"

    def text(
        self, key: str, pattern: re.Pattern[str] | None = None, *, required: bool = False
    ) -> str | None:
        value = self.raw.get(key)
        if value is None or value == "":
            if required:
                raise DeviceConfigError(f"device config: {self.where(key)} is missing")
            return None
        if not isinstance(value, str) or len(value) > 253:
            raise DeviceConfigError(f"device config: {self.where(key)} is not text")
        if pattern is not None and not pattern.fullmatch(value):
            raise DeviceConfigError(
                f"device config: {self.where(key)} is {_shown(value)}, not a valid name"
            )
        return value

    def resource(self, key: str, required: bool = False) -> str | None:
        return self.text(key, _RESOURCE, required=required)

    def number(self, key: str, default: int | None, low: int, high: int) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise DeviceConfigError(f"device config: {self.where(key)} is missing")
            return default
        if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int):
            raise DeviceConfigError(
                f"device config: {self.where(key)} is {_shown(value)}, not a whole number"
            )
        if not low <= value <= high:
            raise DeviceConfigError(
                f"device config: {self.where(key)} is {value}, outside {low}..{high}"
            )
        return value

    def scale(self, key: str) -> float:
        value = self.raw.get(key)
        if value is None:
            return 1.0
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DeviceConfigError(
                f"device config: {self.where(key)} is {_shown(value)}, not a number"
            )
        if not 0 < value <= MAX_SCALING:
            raise DeviceConfigError(
                f"device config: {self.where(key)} is {value}, outside (0, {MAX_SCALING:g}]"
            )
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.raw.get(key)
        if value is None:
            return False
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise DeviceConfigError(
            f"device config: {self.where(key)} is {_shown(value)}, not true or false"
        )

    def items(self, key: str, limit: int) -> list[Any]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise DeviceConfigError(f"device config: {self.where(key)} is not a list")
        if len(value) > limit:
            raise DeviceConfigError(
                f"device config: {self.where(key)} lists {len(value)} entries, above {limit}"
            )
        return value


def _vendor_of(word: str, path: str) -> str:
    vendor = re.sub(r"[^a-z0-9-]+", "-", word.lower()).strip("-")
    if not _VENDOR.fullmatch(vendor):
        raise DeviceConfigError(f"device config: {path} {word!r} makes no vendor name")
    return vendor


# ---------------------------------------------------------------- sections

_COUNT_MEM_CORE = frozenset({"resourceCountName", "resourceMemoryName", "resourceCoreName"})
_NVIDIA_KEYS = frozenset(
    {
        "resourceCountName",
        "resourceMemoryName",
        "resourceMemoryPercentageName",
        "resourceCoreName",
        "resourcePriorityName",
        "overwriteEnv",
        "defaultMemory",
        "defaultCores",
        "defaultGPUNum",
        "preConfiguredDeviceMemory",
        "memoryFactor",
        "deviceSplitCount",
        "deviceMemoryScaling",
        "deviceCoreScaling",
        "enableNumaTopology",
        "gpuCorePolicy",
        "libCudaLogLevel",
        "runtimeClassName",
        "migProfileAllowlist",
        "disableCoreLimit",
    }
)
_CHIP_KEYS = frozenset({"chipName", "commonWord"}) | _COUNT_MEM_CORE
_VNPU_KEYS = frozenset(
    {
        "chipName",
        "commonWord",
        "resourceName",
        "resourceMemoryName",
        "resourceCoreName",
        "memoryAllocatable",
        "memoryCapacity",
        "memoryFactor",
        "aiCore",
        "aiCPU",
        "runtimeClassName",
        "overwriteEnv",
        "templates",
        "superPod",
    }
)


def _nvidia(s: _Section) -> list[DeviceType]:
    s.flag("overwriteEnv")
    s.flag("enableNumaTopology")
    return [
        DeviceType(
            section="nvidia",
            vendor=NVIDIA,
            common_word="NVIDIA",
            count_resource=s.resource("resourceCountName") or "nvidia.com/gpu",
            memory_resource=s.resource("resourceMemoryName") or "nvidia.com/gpumem",
            memory_percentage_resource=s.resource("resourceMemoryPercentageName")
            or "nvidia.com/gpumem-percentage",
            core_resource=s.resource("resourceCoreName") or "nvidia.com/gpucores",
            priority_resource=s.resource("resourcePriorityName") or "nvidia.com/priority",
            memory_factor=s.number("memoryFactor", 1, 1, MAX_MEMORY_FACTOR),
            split_count=s.number("deviceSplitCount", 10, 1, MAX_SPLIT_COUNT),
            memory_scaling=s.scale("deviceMemoryScaling"),
            core_scaling=s.scale("deviceCoreScaling"),
            default_memory_mib=s.number("defaultMemory", 0, 0, MAX_DEVICE_MEMORY_MIB),
            default_cores=s.number("defaultCores", 0, 0, 100),
            default_count=s.number("defaultGPUNum", 1, 1, 64),
            announcement=Announcement(
                "hami.io/node-nvidia-register", "hami.io/node-handshake", AnnotationFormat.JSON
            ),
        )
    ]


def _simple(
    section: str,
    common_word: str,
    memory_factor: int,
    announcement: Announcement,
    selectors: Selectors,
    factor_key: bool = False,
) -> Any:
    def read(s: _Section) -> list[DeviceType]:
        factor = memory_factor
        if factor_key:
            factor = s.number("memoryFactor", memory_factor, 1, MAX_MEMORY_FACTOR)
        return [
            DeviceType(
                section=section,
                vendor=section,
                common_word=common_word,
                count_resource=s.resource("resourceCountName", required=True),
                memory_resource=s.resource("resourceMemoryName"),
                core_resource=s.resource("resourceCoreName"),
                memory_factor=factor,
                default_cores=100,
                announcement=announcement,
                selectors=selectors,
            )
        ]

    return read


def _cambricon(s: _Section) -> list[DeviceType]:
    memory = s.resource("resourceMemoryName") or "cambricon.com/mlu.smlu.vmemory"
    cores = s.resource("resourceCoreName") or "cambricon.com/mlu.smlu.vcore"
    return [
        DeviceType(
            section="cambricon",
            vendor="cambricon",
            common_word="MLU",
            count_resource=s.resource("resourceCountName") or "cambricon.com/vmlu",
            memory_resource=memory,
            core_resource=cores,
            memory_factor=256,
            default_cores=100,
            rules=Rules.CAMBRICON,
            source=CardSource.CAPACITY,
            capacity=CapacityCards(
                word="cambricon-mlu",
                model="MLU",
                cores_resource=cores,
                memory_resource=memory,
                memory_unit=256,
            ),
            selectors=Selectors(
                "cambricon.com/use-mlutype",
                "cambricon.com/nouse-mlutype",
                ("cambricon.com/use-gpuuuid",),
                ("cambricon.com/nouse-gpuuuid",),
            ),
        )
    ]


def _mthreads(s: _Section) -> list[DeviceType]:
    memory = s.resource("resourceMemoryName") or "mthreads.com/sgpu-memory"
    cores = s.resource("resourceCoreName") or "mthreads.com/sgpu-core"
    return [
        DeviceType(
            section="mthreads",
            vendor="mthreads",
            common_word="Mthreads",
            count_resource=s.resource("resourceCountName") or "mthreads.com/vgpu",
            memory_resource=memory,
            core_resource=cores,
            memory_factor=512,
            rules=Rules.MTHREADS,
            source=CardSource.CAPACITY,
            capacity=CapacityCards(
                word="mthreads",
                model="Mthreads",
                cores_per_card=16,
                cores_resource=cores,
                memory_resource=memory,
                memory_unit=512,
            ),
            selectors=_uuid_keys("mthreads.ai/use-gpuuuid", "mthreads.ai/nouse-gpuuuid"),
        )
    ]


def _metax(s: _Section) -> list[DeviceType]:
    s.flag("sgpuTopologyAware")
    whole = DeviceType(
        section="metax",
        vendor="metax",
        common_word="Metax-GPU",
        count_resource=s.resource("resourceCountName") or "metax-tech.com/gpu",
        default_cores=100,
        rules=Rules.METAX_GPU,
        source=CardSource.CAPACITY,
        capacity=CapacityCards(word="metax", model="Metax-GPU", memory_mib=65536, split_count=1),
    )
    shared = DeviceType(
        section="metax",
        vendor="metax-sgpu",
        common_word="Metax-SGPU",
        count_resource=s.resource("resourceVCountName") or "metax-tech.com/sgpu",
        memory_resource=s.resource("resourceVMemoryName") or "metax-tech.com/vmemory",
        core_resource=s.resource("resourceVCoreName") or "metax-tech.com/vcore",
        memory_factor=1024,
        default_cores=100,
        rules=Rules.METAX_SGPU,
        source=CardSource.METAX,
        selectors=_uuid_keys("metax-tech.com/use-gpuuuid", "metax-tech.com/nouse-gpuuuid"),
    )
    return [whole, shared]


def _enflame(s: _Section) -> list[DeviceType]:
    s.resource("resourceNameGCU")
    s.resource("resourceNameVGCUPercentage")
    legacy = s.resource("resourceNameVGCU")
    return [
        DeviceType(
            section="enflame",
            vendor="enflame",
            common_word="Enflame",
            count_resource=s.resource("resourceNameDRSGCU") or legacy or "enflame.com/drs-gcu",
            memory_resource=s.resource("resourceNameGCUMemory") or "enflame.com/gcu-memory",
            core_resource=s.resource("resourceNameGCUCore") or "enflame.com/gcu-core",
            rules=Rules.ENFLAME,
            source=CardSource.ENFLAME,
            selectors=_uuid_keys("enflame.com/use-gpuuuid", "enflame.com/nouse-gpuuuid"),
        )
    ]


def _kunlun(s: _Section) -> list[DeviceType]:
    types = [
        DeviceType(
            section="kunlun",
            vendor="kunlun",
            common_word="kunlun",
            count_resource=s.resource("resourceCountName") or "kunlunxin.com/xpu",
            default_cores=100,
            rules=Rules.KUNLUN,
            source=CardSource.CAPACITY,
            capacity=CapacityCards(
                word="kunlun", model="kunlun", memory_mib=98304, split_count=1, numa_halves=True
            ),
            selectors=Selectors(
                use_uuid=("baidu.com/use-gpuuuid", "hami.io/use-xpu-uuid"),
                nouse_uuid=("baidu.com/nouse-gpuuuid", "hami.io/no-use-xpu-uuid"),
            ),
        )
    ]
    vcount = s.resource("resourceVCountName")
    if vcount:
        types.append(
            DeviceType(
                section="kunlun",
                vendor="xpu",
                common_word="XPU",
                count_resource=vcount,
                memory_resource=s.resource("resourceVMemoryName"),
                default_cores=100,
                announcement=Announcement(
                    "hami.io/node-register-xpu",
                    "hami.io/node-handshake-xpu",
                    AnnotationFormat.JSON,
                    allocate="xpu",
                ),
                selectors=_uuid_keys("hami.io/use-xpu-uuid", "hami.io/no-use-xpu-uuid"),
            )
        )
    return types


def _awsneuron(s: _Section) -> list[DeviceType]:
    return [
        DeviceType(
            section="awsneuron",
            vendor="awsneuron",
            common_word="AWSNeuron",
            count_resource=s.resource("resourceCountName", required=True),
            core_resource=s.resource("resourceCoreName"),
            supported=False,
        )
    ]


def _count_only(
    section: str, common_word: str, announcement: Announcement, selectors: Selectors
) -> Any:
    def read(s: _Section) -> list[DeviceType]:
        return [
            DeviceType(
                section=section,
                vendor=section,
                common_word=common_word,
                count_resource=s.resource("resourceCountName", required=True),
                default_cores=100,
                announcement=announcement,
                selectors=selectors,
            )
        ]

    return read


def _iluvatars(path: str, raw: Any, warnings: list[str]) -> list[DeviceType]:
    if not isinstance(raw, list) or len(raw) > MAX_TYPES:
        raise DeviceConfigError(f"device config: {path} is not a list of at most {MAX_TYPES}")
    types = []
    for i, entry in enumerate(raw):
        s = _Section(f"{path}[{i}]", entry, _CHIP_KEYS, warnings)
        word = s.text("commonWord", _WORD, required=True)
        assert word is not None
        types.append(
            DeviceType(
                section="iluvatars",
                vendor=_vendor_of(word, s.where("commonWord")),
                common_word=word,
                chip_name=s.text("chipName", _WORD),
                count_resource=s.resource("resourceCountName", required=True),
                memory_resource=s.resource("resourceMemoryName"),
                core_resource=s.resource("resourceCoreName"),
                memory_factor=256,
                default_cores=100,
                selectors=_uuid_keys(f"hami.io/use-{word}-uuid", f"hami.io/no-use-{word}-uuid"),
                announcement=Announcement(
                    f"hami.io/node-{word}-register",
                    f"hami.io/node-handshake-{word}",
                    AnnotationFormat.COLON,
                ),
            )
        )
    return types


def _vnpus(s: _Section, warnings: list[str]) -> list[DeviceType]:
    s.flag("hamiVnpuCore")
    types = []
    for i, entry in enumerate(s.items("configs", MAX_TYPES)):
        c = _Section(f"{s.path}.configs[{i}]", entry, _VNPU_KEYS, warnings)
        word = c.text("commonWord", _WORD, required=True)
        assert word is not None
        c.flag("overwriteEnv")
        c.flag("superPod")
        c.number("aiCPU", 0, 0, 1024)
        capacity = c.number("memoryCapacity", 0, 0, MAX_DEVICE_MEMORY_MIB)
        allocatable = c.number("memoryAllocatable", 0, 0, MAX_DEVICE_MEMORY_MIB)
        if capacity and allocatable > capacity:
            raise DeviceConfigError(
                f"device config: {c.where('memoryAllocatable')} is {allocatable}, above "
                f"memoryCapacity {capacity}"
            )
        templates = []
        for j, tpl in enumerate(c.items("templates", MAX_TEMPLATES)):
            t = _Section(
                f"{c.path}.templates[{j}]",
                tpl,
                frozenset({"name", "memory", "aiCore", "aiCPU"}),
                warnings,
            )
            name = t.text("name", _WORD, required=True)
            assert name is not None
            templates.append(
                Template(
                    name=name,
                    memory_mib=t.number("memory", None, 1, MAX_DEVICE_MEMORY_MIB),
                    ai_cores=t.number("aiCore", 0, 0, 1024),
                    ai_cpus=t.number("aiCPU", 0, 0, 1024),
                )
            )
        types.append(
            DeviceType(
                section="vnpus",
                vendor=_vendor_of(word, c.where("commonWord")),
                common_word=word,
                chip_name=c.text("chipName", _WORD),
                count_resource=c.resource("resourceName", required=True),
                memory_resource=c.resource("resourceMemoryName"),
                core_resource=c.resource("resourceCoreName"),
                memory_factor=c.number("memoryFactor", 1, 1, MAX_MEMORY_FACTOR),
                memory_capacity_mib=capacity or None,
                memory_allocatable_mib=allocatable or None,
                ai_cores=c.number("aiCore", 0, 0, 1024) or None,
                # HAMi rounds a request up to the smallest template that holds it
                templates=tuple(sorted(templates, key=lambda t: t.memory_mib)),
                rules=Rules.ASCEND,
                selectors=_uuid_keys(f"hami.io/use-{word}-uuid", f"hami.io/no-use-{word}-uuid"),
                announcement=Announcement(
                    f"hami.io/node-register-{word}",
                    f"hami.io/node-handshake-{word}",
                    AnnotationFormat.JSON,
                ),
            )
        )
    return types


_SECTIONS: dict[str, tuple[frozenset[str], Any]] = {
    "nvidia": (_NVIDIA_KEYS, _nvidia),
    "cambricon": (_COUNT_MEM_CORE, _cambricon),
    "hygon": (
        _COUNT_MEM_CORE | {"memoryFactor"},
        _simple(
            "hygon",
            "DCU",
            1,
            Announcement(
                "hami.io/node-dcu-register",
                "hami.io/node-handshake-dcu",
                AnnotationFormat.COLON,
                allocate="dcu",
            ),
            Selectors(
                "hygon.com/use-dcutype",
                "hygon.com/nouse-dcutype",
                ("hygon.com/use-gpuuuid",),
                ("hygon.com/nouse-gpuuuid",),
            ),
            factor_key=True,
        ),
    ),
    "mthreads": (_COUNT_MEM_CORE, _mthreads),
    "amd": (
        _COUNT_MEM_CORE,
        _simple(
            "amd",
            "AMD",
            1,
            Announcement("hami.io/node-amd-register", None, AnnotationFormat.JSON, allocate="amd"),
            Selectors(
                "amd.com/use-gputype",
                "amd.com/nouse-gputype",
                ("amd.com/use-gpu-uuid",),
                ("amd.com/nouse-gpu-uuid",),
            ),
        ),
    ),
    "metax": (
        frozenset(
            {
                "resourceCountName",
                "resourceVCountName",
                "resourceVMemoryName",
                "resourceVCoreName",
                "sgpuTopologyAware",
            }
        ),
        _metax,
    ),
    "enflame": (
        frozenset(
            {
                "resourceNameGCU",
                "resourceNameDRSGCU",
                "resourceNameGCUMemory",
                "resourceNameGCUCore",
                "resourceNameVGCU",
                "resourceNameVGCUPercentage",
            }
        ),
        _enflame,
    ),
    "kunlun": (
        frozenset({"resourceCountName", "resourceVCountName", "resourceVMemoryName"}),
        _kunlun,
    ),
    "awsneuron": (frozenset({"resourceCountName", "resourceCoreName"}), _awsneuron),
    "vastai": (
        frozenset({"resourceCountName"}),
        _count_only(
            "vastai",
            "Vastai",
            Announcement(
                "hami.io/node-va-register", "hami.io/node-handshake-va", AnnotationFormat.JSON, 100
            ),
            Selectors(
                "vastaitech.com/use-va",
                "vastaitech.com/nouse-va",
                ("vastaitech.com/use-gpuuuid",),
                ("vastaitech.com/nouse-gpuuuid",),
            ),
        ),
    ),
    "biren": (
        frozenset({"resourceCountName"}),
        _count_only(
            "biren",
            "Biren",
            Announcement(
                "hami.io/node-biren-register",
                "hami.io/node-handshake-biren",
                AnnotationFormat.JSON,
                100,
            ),
            Selectors(
                "birentech.com/use-biren",
                "birentech.com/nouse-biren",
                ("birentech.com/use-gpuuuid",),
                ("birentech.com/nouse-gpuuuid",),
            ),
        ),
    ),
}


def parse_device_config(text: str | bytes) -> DeviceConfig:
    """The device types of a HAMi ``device-config.yaml``; raises DeviceConfigError."""
    if len(text) > MAX_CONFIG_BYTES:
        raise DeviceConfigError(
            f"device config is {len(text)} bytes, above the bound {MAX_CONFIG_BYTES}"
        )
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise DeviceConfigError(f"device config is not valid YAML{line}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise DeviceConfigError("device config is not a mapping of vendor sections")
    warnings: list[str] = []
    types: list[DeviceType] = []
    for name, raw in doc.items():
        if not isinstance(name, str):
            raise DeviceConfigError("device config has a section name that is not text")
        if raw is None:
            continue
        if name == "iluvatars":
            types += _iluvatars(name, raw, warnings)
        elif name == "vnpus":
            keys = frozenset({"hamiVnpuCore", "configs"})
            types += _vnpus(_Section(name, raw, keys, warnings), warnings)
        elif name in _SECTIONS:
            known, read = _SECTIONS[name]
            types += read(_Section(name, raw, known, warnings))
        else:
            shown = name if _WORD.fullmatch(name) else _shown(name)
            warnings.append(
                f"device config: section {shown} is not a vendor gpuslice knows; "
                "its devices are not scheduled"
            )
            vendor = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:32].strip("-")
            types.append(
                DeviceType(
                    section=name[:64],
                    vendor=vendor if _VENDOR.fullmatch(vendor) else "unknown",
                    common_word=name[:64],
                    count_resource=None,
                    supported=False,
                )
            )
    if len(types) > MAX_TYPES:
        raise DeviceConfigError(f"device config lists {len(types)} device types, above {MAX_TYPES}")
    if not any(t.vendor == NVIDIA for t in types):
        types.insert(0, _nvidia(_Section("nvidia", {}, _NVIDIA_KEYS, warnings))[0])
    _check_unique(types)
    return DeviceConfig(tuple(types), tuple(warnings))


def _check_unique(types: list[DeviceType]) -> None:
    vendors: dict[str, str] = {}
    owners: dict[str, str] = {}
    for t in types:
        if t.vendor == NVIDIA and t.section != "nvidia":
            # it would take NVIDIA's place: NVIDIA's own type would not be added
            raise DeviceConfigError(
                f"device config: {t.section} {t.common_word!r}: only the nvidia section "
                f"names vendor {NVIDIA!r}"
            )
        if t.vendor in vendors:
            raise DeviceConfigError(
                f"device config: {t.section} {t.common_word!r} names vendor {t.vendor!r} "
                f"again (first in {vendors[t.vendor]})"
            )
        vendors[t.vendor] = t.section
        for resource in t.resources:
            if resource in owners:
                raise DeviceConfigError(
                    f"device config: resource {resource} is named by both "
                    f"{owners[resource]} and {t.vendor}"
                )
            owners[resource] = t.vendor


def load_device_config(path: str) -> DeviceConfig:
    """HAMi's ``device-config.yaml`` at ``path``; its warnings are logged.
    Raises DeviceConfigError, naming the file, when it cannot be read or used."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise DeviceConfigError(f"device config {path}: {exc.strerror or exc}") from None
    try:
        config = parse_device_config(text)
    except DeviceConfigError as exc:
        raise DeviceConfigError(f"{path}: {exc}") from None
    for warning in config.warnings:
        log.warning("%s", warning)
    return config


# the word of the pod annotations each family's plugin reads at Allocate (HAMi's)
_ALLOCATE_WORDS: dict[Rules, str] = {
    Rules.CAMBRICON: "cambricon-mlu",
    Rules.MTHREADS: "mthreads-vgpu",
    Rules.METAX_GPU: "metax-gpu",
    Rules.METAX_SGPU: "metax-sgpu",
    Rules.ENFLAME: "enflame-vgpu",
    Rules.KUNLUN: "kunlun",
}


def vendor_resources(t: DeviceType) -> VendorResources:
    """How pods ask for the cards of type ``t`` (a vendor other than NVIDIA)."""
    assert t.count_resource is not None
    word = _ALLOCATE_WORDS.get(t.rules) or (t.announcement and t.announcement.allocate)
    return VendorResources(
        vendor=t.vendor,
        count=t.count_resource,
        memory=t.memory_resource,
        cores=t.core_resource,
        memory_factor=t.memory_factor,
        device_type=t.common_word,
        allocate_key=word or t.common_word,
        rules=t.rules.value,
        default_cores=t.default_cores,
        max_cores=t.capacity.cores_per_card if t.capacity and t.capacity.cores_resource else 100,
        templates=tuple(VendorTemplate(name=x.name, memory_mib=x.memory_mib) for x in t.templates),
        memory_allocatable_mib=t.memory_allocatable_mib,
        memory_capacity_mib=t.memory_capacity_mib,
        use_type=t.selectors.use_type,
        nouse_type=t.selectors.nouse_type,
        use_uuid=t.selectors.use_uuid,
        nouse_uuid=t.selectors.nouse_uuid,
    )


def vendor_requests(config: DeviceConfig) -> tuple[VendorResources, ...]:
    """The resources pods use to ask for the cards gpuslice reads from node objects
    (other than NVIDIA's, which keep :class:`ResourceNames`)."""
    return tuple(
        vendor_resources(t)
        for t in config.announced()
        if t.vendor != NVIDIA and t.count_resource is not None
    )


def with_vendors(settings: RequestSettings, path: str) -> RequestSettings:
    """``settings`` reading the vendors of the device configuration at ``path``
    ("": unchanged). Raises DeviceConfigError."""
    if not path:
        return settings
    vendors = vendor_requests(load_device_config(path))
    try:
        return RequestSettings.model_validate(
            {**settings.model_dump(), "vendors": [v.model_dump() for v in vendors]}
        )
    except ValueError as exc:
        raise DeviceConfigError(f"{path}: {exc}") from None


S = TypeVar("S", bound=CommonSettings)


def read_vendors(settings: S) -> S:
    """``settings`` whose requests read the vendors of ``settings.device_config``
    (unchanged without one). Raises DeviceConfigError."""
    if not settings.device_config:
        return settings
    requests = with_vendors(settings.requests, settings.device_config)
    return settings.model_copy(update={"requests": requests})


__all__ = [
    "AnnotationFormat",
    "Announcement",
    "CapacityCards",
    "CardSource",
    "DeviceConfig",
    "DeviceConfigError",
    "DeviceType",
    "Rules",
    "Selectors",
    "Template",
    "load_device_config",
    "parse_device_config",
    "read_vendors",
    "vendor_requests",
    "vendor_resources",
    "with_vendors",
]
