"""Per-node configuration in HAMi's style: defaults for every node, overrides by name.

The file is YAML or JSON (JSON is YAML) and may be empty::

    defaults:                  # optional: every node starts from these
      deviceSplitCount: 10
      deviceMemoryScaling: 1.0
      deviceCoreScaling: 1.0
      filterDevices: {uuid: [GPU-...], index: [3]}
      operatingMode: hami-core # or mig: cards in MIG mode get MIG instances made at Allocate
      migStrategy: none        # hami-core nodes: none (MIG cards left out) or mixed
      migProfileAllowlist:     # mig nodes: the profiles offered per model (HAMi's format)
        - {models: [A100-SXM4-40GB], profiles: [1g.5gb, 2g.10gb, 3g.20gb, 7g.40gb]}
      libCudaLogLevel: 2
      gpuCorePolicy: default
      contextOverhead: 384     # MiB
      simulate: {count: 2, model: ..., memoryMiB: 40960, numaNodes: 2, unhealthy: [1],
                 mig: false, instances: []}
               # mig: MIG cards of the A100-40GB geometry (operatingMode mig, or migStrategy
               # mixed with instances); instances: static ones on each, e.g. [3g.20gb, 3g.20gb]
      mps: {pipeDirectory: /run/nvidia/mps/nvidia.com/gpu/pipe, shmDirectory: /run/nvidia/mps/shm}
      kubeletApi: dra          # or device-plugin; unset: the agent's GPUSLICE_DRA decides
    nodeconfig:                # optional: HAMi's per-node list
      - name: gpu-node-1
        devicememoryscaling: 1.5

Keys match case-insensitively, ignoring ``-`` and ``_``: ``devicesplitcount``,
``deviceSplitCount`` and ``device_split_count`` are one key, and the field names
(``split_count``, ``memory_scaling``, ...) are accepted too. A node's entry
overrides the defaults key by key; a nested ``filterDevices`` or ``simulate``
given for a node replaces the defaults' whole object, it is not merged.

``operatingMode: mps`` (HAMi's value) shares the node's cards through NVIDIA's
MPS control daemon, which the operator runs (NVIDIA's ``mps-control-daemon``
or ``nvidia-cuda-mps-control -d``); ``mps`` names the host directories it
shares with its clients. The limits MPS applies are advisory: each container
gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` in its environment, which is the
tenant's to change, and MPS only holds a client to the lower of its own value
and the control daemon's default. Only the daemon's defaults
(``set_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit``) bind a tenant, and they are the same
for every container. The interposer's memory limit stays on as the fence a
container cannot move; see docs/hami.md, "MPS mode".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from gpuslice_common.models import (
    MAX_DEVICE_MEMORY_MIB,
    MAX_MIG_PROFILES,
    MAX_MIG_SLICES,
    PRINTABLE_PATTERN,
    Frozen,
    GpuDevice,
    MigProfileName,
    NodeInventory,
    VgpuMode,
)
from gpuslice_deviceplugin.mig import A100_40GB, MigError, first_fit


class NodeConfigError(Exception):
    """The node configuration cannot be used; one line per problem, each naming the source."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in self.problems))


class FilterDevices(Frozen):
    """GPUs this node's agent leaves out, by UUID (any case) or by index."""

    uuids: tuple[str, ...] = ()
    indices: tuple[Annotated[int, Field(ge=0)], ...] = ()

    def excludes(self, device: GpuDevice) -> bool:
        uuids = {u.lower() for u in self.uuids}
        return device.uuid.lower() in uuids or device.index in self.indices


class SimulatedGpus(Frozen):
    """The GPUs the simulated backend reports; NUMA nodes take contiguous runs of indices."""

    count: Annotated[int, Field(ge=1, le=16)] = 4
    model: Annotated[str, Field(min_length=1, max_length=128, pattern=PRINTABLE_PATTERN)] = (
        "NVIDIA A100-SXM4-80GB"
    )
    memory_mib: Annotated[int, Field(gt=0, le=MAX_DEVICE_MEMORY_MIB)] = 81920
    numa_nodes: Annotated[int, Field(ge=1, le=16)] = 1
    unhealthy: tuple[int, ...] = ()  # indices reported Unhealthy
    mig: bool = False  # MIG cards with the A100-40GB geometry
    # MIG instances already on each card, made by someone else (static), in order
    instances: Annotated[tuple[MigProfileName, ...], Field(max_length=MAX_MIG_SLICES)] = ()

    @model_validator(mode="after")
    def _unhealthy_in_range(self) -> SimulatedGpus:
        bad = [i for i in self.unhealthy if not 0 <= i < self.count]
        if bad:
            raise ValueError(f"unhealthy indices {bad} are not among the {self.count} GPUs")
        return self

    @model_validator(mode="after")
    def _instances_fit(self) -> SimulatedGpus:
        if self.instances and not self.mig:
            raise ValueError("simulate.instances needs simulate.mig: true")
        try:
            first_fit(A100_40GB, self.instances)
        except MigError as exc:
            raise ValueError(f"simulate.instances: {exc}") from None
        return self

    def numa_of(self, index: int) -> int:
        return index * self.numa_nodes // self.count


# where NVIDIA's MPS control daemon keeps its pipes and shared memory by default
# (its ``mpsRoot`` /run/nvidia/mps, for the resource nvidia.com/gpu)
MPS_PIPE_DIRECTORY = "/run/nvidia/mps/nvidia.com/gpu/pipe"
MPS_SHM_DIRECTORY = "/run/nvidia/mps/shm"
HostPath = Annotated[str, Field(min_length=2, max_length=1024, pattern=r"^/[!-~]*$")]


class MpsDaemon(Frozen):
    """The host directories of the node's MPS control daemon (``operatingMode: mps``).

    ``pipe_directory`` is its ``CUDA_MPS_PIPE_DIRECTORY``, mounted read-only into
    each container unless ``writable_pipe``: clients only connect to the sockets
    there, and a container that could write there could remove the daemon's
    socket and put its own in its place for every other tenant's clients.
    ``shm_directory`` is the daemon's ``/dev/shm``, which its clients must share.
    """

    pipe_directory: HostPath = MPS_PIPE_DIRECTORY
    shm_directory: HostPath = MPS_SHM_DIRECTORY
    writable_pipe: bool = False

    @field_validator("pipe_directory", "shm_directory")
    @classmethod
    def _plain_path(cls, value: str) -> str:
        # Both are mounted into every container of the node (shm writable): a
        # path that is the host's root or one of its top directories would give
        # each tenant the host's files.
        parts = value.split("/")[1:]
        if any(part in (".", "..") for part in parts):
            raise ValueError(f"{value!r} has '.' or '..' in it; give the directory itself")
        if "" in parts:
            raise ValueError(
                f"{value!r} has an empty part ('//' or a trailing '/'); give the directory itself"
            )
        if len(parts) < 2:
            raise ValueError(
                f"{value!r} is a directory of the host itself; "
                "give the MPS daemon's own directory below it"
            )
        return value

    @model_validator(mode="after")
    def _pipe_apart(self) -> MpsDaemon:
        # shm is mounted writable: holding the pipe, it would undo the read-only pipe
        pipe, shm = self.pipe_directory, self.shm_directory
        if not self.writable_pipe and (pipe == shm or pipe.startswith(shm + "/")):
            raise ValueError(
                f"shmDirectory {shm!r} holds pipeDirectory {pipe!r}: mounted writable, it "
                "would let containers replace the daemon's socket; give them apart, "
                "or set writablePipe"
            )
        return self


class MigAllowlistEntry(Frozen):
    """HAMi's ``migProfileAllowlist`` entry: the MIG profiles offered on cards whose
    model contains one of ``models`` (the first entry that matches a card applies)."""

    models: Annotated[
        tuple[Annotated[str, Field(min_length=1, max_length=128, pattern=PRINTABLE_PATTERN)], ...],
        Field(max_length=64),
    ]
    profiles: Annotated[tuple[MigProfileName, ...], Field(max_length=MAX_MIG_PROFILES)]

    @model_validator(mode="after")
    def _not_empty(self) -> MigAllowlistEntry:
        if not self.models or not self.profiles:  # as HAMi refuses it
            raise ValueError("an allowlist entry needs models and profiles")
        return self

    def matches(self, model: str) -> bool:
        return any(m in model for m in self.models)


class NodeConfig(Frozen):
    """How this node shares its GPUs (HAMi's key names in comments)."""

    split_count: Annotated[int, Field(ge=1, le=1024)] = 10  # deviceSplitCount
    memory_scaling: Annotated[float, Field(gt=0, le=100)] = 1.0  # deviceMemoryScaling
    core_scaling: Annotated[float, Field(gt=0, le=100)] = 1.0  # deviceCoreScaling
    filter_devices: FilterDevices = FilterDevices()  # filterDevices
    operating_mode: Literal["hami-core", "mig", "mps"] = "hami-core"  # operatingMode
    mig_strategy: Literal["none", "mixed"] = "none"  # migStrategy (HAMi's default: none)
    # migProfileAllowlist; None offers every profile NVML gives
    mig_profile_allowlist: Annotated[tuple[MigAllowlistEntry, ...], Field(max_length=64)] | None = (
        None
    )
    log_level: Annotated[int, Field(ge=0, le=4)] = 2  # libCudaLogLevel (LIBCUDA_LOG_LEVEL)
    core_policy: Literal["default", "force", "disable"] = "default"  # gpuCorePolicy
    context_overhead_mib: Annotated[int, Field(ge=0)] | None = None  # contextOverhead
    simulate: SimulatedGpus = SimulatedGpus()
    mps: MpsDaemon = MpsDaemon()
    # how kubelet gets this node's cards: the device plugin API or DRA (one node, one
    # mode; read when the agent starts); None: the agent's setting (GPUSLICE_DRA)
    kubelet_api: Literal["device-plugin", "dra"] | None = None

    @field_validator("operating_mode", mode="before")
    @classmethod
    def _known_mode(cls, value: Any) -> Any:
        if value not in ("hami-core", "mig", "mps"):
            raise ValueError(f"only 'hami-core', 'mig' and 'mps' are supported, not {value!r}")
        return value

    @property
    def mode(self) -> VgpuMode:
        """How this node's cards are shared (a card without MIG on a mig node stays hami-core)."""
        return VgpuMode(self.operating_mode)

    @field_validator("mig_strategy", mode="before")
    @classmethod
    def _known_strategy(cls, value: Any) -> Any:
        if value == "single":
            raise ValueError(
                "'single' is not supported: it advertises MIG instances as nvidia.com/gpu, "
                "which here counts shared whole cards; use 'mixed' (nvidia.com/mig-<profile>)"
            )
        if value not in ("none", "mixed"):
            raise ValueError(f"only 'none' and 'mixed' are supported, not {value!r}")
        return value

    @model_validator(mode="after")
    def _simulated_mig_on_mig_nodes(self) -> NodeConfig:
        static = bool(self.simulate.instances) and self.mig_strategy == "mixed"
        if self.simulate.mig and self.operating_mode != "mig" and not static:
            raise ValueError(
                "simulate.mig needs operatingMode: mig,"
                " or simulate.instances with migStrategy: mixed"
            )
        return self

    def mig_allowed(self, model: str) -> frozenset[str] | None:
        """The MIG profiles offered on a card of ``model``; None: every one NVML gives."""
        if self.mig_profile_allowlist is None:
            return None
        for entry in self.mig_profile_allowlist:
            if entry.matches(model):
                return frozenset(entry.profiles)
        return frozenset()

    def inventory(self, node: str, devices: Sequence[GpuDevice]) -> NodeInventory:
        """The heartbeat describing ``devices`` shared as this configuration says."""
        return NodeInventory(
            node=node,
            devices=tuple(devices),
            split_count=self.split_count,
            memory_scaling=self.memory_scaling,
            core_scaling=self.core_scaling,
        )


log = logging.getLogger(__name__)


def _norm(key: object) -> str:
    return str(key).lower().replace("-", "").replace("_", "")


# normalised key as written -> field name
_NODE_KEYS = {
    "devicesplitcount": "split_count",
    "splitcount": "split_count",
    "devicememoryscaling": "memory_scaling",
    "memoryscaling": "memory_scaling",
    "devicecorescaling": "core_scaling",
    "corescaling": "core_scaling",
    "filterdevices": "filter_devices",
    "operatingmode": "operating_mode",
    "migstrategy": "mig_strategy",
    "migprofileallowlist": "mig_profile_allowlist",
    "libcudaloglevel": "log_level",
    "loglevel": "log_level",
    "gpucorepolicy": "core_policy",
    "corepolicy": "core_policy",
    "contextoverhead": "context_overhead_mib",
    "contextoverheadmib": "context_overhead_mib",
    "simulate": "simulate",
    "mps": "mps",
    "kubeletapi": "kubelet_api",
}
# HAMi keys with no meaning here: read and ignored, with a warning, so HAMi's own
# files load unchanged (GetPreferredAllocation is always offered)
_IGNORED_KEYS = {"enablegetpreferredallocation": "always on"}
_NESTED_KEYS = {
    "filter_devices": {"uuid": "uuids", "uuids": "uuids", "index": "indices", "indices": "indices"},
    "simulate": {
        "count": "count",
        "model": "model",
        "memorymib": "memory_mib",
        "numanodes": "numa_nodes",
        "unhealthy": "unhealthy",
        "mig": "mig",
        "instances": "instances",
    },
    "mps": {
        "pipedirectory": "pipe_directory",
        "shmdirectory": "shm_directory",
        "writablepipe": "writable_pipe",
    },
}


class _Section:
    """One mapping of the file (the defaults or a node entry) renamed to field names."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.values: dict[str, Any] = {}
        self.spelled: dict[str, str] = {}  # dotted field path -> key as written
        self.problems: list[str] = []

    def read(self, raw: Mapping[Any, Any], skip: frozenset[str] = frozenset()) -> None:
        for key, value in raw.items():
            if _norm(key) in skip:
                continue
            if _norm(key) in _IGNORED_KEYS:
                log.warning("%s: key %r ignored (%s)", self.where, key, _IGNORED_KEYS[_norm(key)])
                continue
            field = self._field(key, _NODE_KEYS, "", self.spelled)
            if field is None:
                continue
            nested = _NESTED_KEYS.get(field)
            if nested is not None and isinstance(value, Mapping):
                value = self._nested(field, value, nested)
            self.values[field] = value

    def _nested(
        self, field: str, raw: Mapping[Any, Any], keys: Mapping[str, str]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        seen: dict[str, str] = {}
        for key, value in raw.items():
            name = self._field(key, keys, f"{self.spelled[field]}.", seen)
            if name is not None:
                out[name] = value
        for name, key in seen.items():
            self.spelled[f"{field}.{name}"] = key
        return out

    def _field(
        self, key: object, keys: Mapping[str, str], prefix: str, seen: dict[str, str]
    ) -> str | None:
        """The field ``key`` names, recorded in ``seen``; None (and a problem) if it names none."""
        field = keys.get(_norm(key))
        if field is None:
            self.problems.append(f"{self.where}: unknown key '{prefix}{key}'")
            return None
        if field in seen:
            self.problems.append(
                f"{self.where}: key '{prefix}{key}' repeats '{prefix}{seen[field]}'"
            )
            return None
        seen[field] = str(key)
        return field

    def check(self) -> NodeConfig | None:
        """The section as a configuration of its own; None (and problems) when invalid."""
        try:
            return NodeConfig.model_validate(self.values)
        except ValidationError as exc:
            for err in exc.errors():
                message = str(err["msg"]).removeprefix("Value error, ")
                path = self._path(err["loc"])  # empty for a rule across keys
                self.problems.append(f"{self.where}: {path + ': ' if path else ''}{message}")
            return None

    def _path(self, loc: tuple[int | str, ...]) -> str:
        parts: list[str] = []
        fields: list[str] = []
        for item in loc:
            if isinstance(item, int) and parts:
                parts[-1] += f"[{item}]"
            elif isinstance(item, int):
                parts.append(f"[{item}]")
            else:
                fields.append(item)
                parts.append(self.spelled.get(".".join(fields), item))
        return ".".join(parts)


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = f"{where}{exc.problem}"
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
    raise NodeConfigError(source, [f"not YAML or JSON: {problem}"])


def _top_level(data: Any, problems: list[str]) -> tuple[Any, Any]:
    """The raw ``defaults`` and ``nodeconfig`` values of the file's top level."""
    if data is None:
        return None, None
    if not isinstance(data, Mapping):
        kind = type(data).__name__
        problems.append(f"the top level must be a mapping (defaults, nodeconfig), not {kind}")
        return None, None
    found: dict[str, Any] = {}
    for key, value in data.items():
        name = _norm(key)
        if name not in ("defaults", "nodeconfig"):
            problems.append(f"unknown top-level key '{key}' (expected defaults, nodeconfig)")
        elif name in found:
            problems.append(f"top-level key '{key}' is given twice")
        else:
            found[name] = value
    return found.get("defaults"), found.get("nodeconfig")


def _entries(raw: Any, problems: list[str]) -> Iterator[tuple[str, str, Mapping[Any, Any]]]:
    """(where, name, mapping) for each well-formed entry of ``nodeconfig``, in file order."""
    if raw is None:
        return
    if not isinstance(raw, list):
        problems.append(f"nodeconfig: must be a list of node entries, not {type(raw).__name__}")
        return
    first: dict[str, str] = {}
    for i, entry in enumerate(raw):
        where = f"nodeconfig[{i}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: must be a mapping, not {type(entry).__name__}")
            continue
        names = [v for k, v in entry.items() if _norm(k) == "name"]
        if not names or not isinstance(names[0], str) or not names[0]:
            problems.append(f"{where}: needs a 'name': the node's name as a string")
            continue
        name = names[0]
        where = f"{where} ({name})"
        if name in first:
            problems.append(f"{where}: node '{name}' is already configured by {first[name]}")
            continue
        first[name] = where
        yield where, name, entry


def parse_node_config(text: str, node: str, *, source: str = "<config>") -> NodeConfig:
    """The configuration of ``node`` from a file's text; NodeConfigError when it is invalid.

    Every node entry is checked, not only this node's, so a bad file fails on every node.
    """
    problems: list[str] = []
    raw_defaults, raw_nodes = _top_level(_load_yaml(text, source), problems)
    defaults = _Section("defaults")
    if isinstance(raw_defaults, Mapping):
        defaults.read(raw_defaults)
    elif raw_defaults is not None:
        problems.append(f"defaults: must be a mapping, not {type(raw_defaults).__name__}")
    defaults.check()
    problems += defaults.problems
    mine: _Section | None = None
    for where, name, entry in _entries(raw_nodes, problems):
        section = _Section(where)
        section.read(entry, skip=frozenset({"name"}))
        section.check()
        problems += section.problems
        if name == node:
            mine = section
    if problems:
        raise NodeConfigError(source, problems)
    merged = _Section(f"node {node}")
    merged.values = {**defaults.values, **(mine.values if mine else {})}
    merged.spelled = {**defaults.spelled, **(mine.spelled if mine else {})}
    config = merged.check()
    if config is None:
        raise NodeConfigError(source, merged.problems)
    return config


def load_node_config(path: str | os.PathLike[str] | None, node: str) -> NodeConfig:
    """The configuration of ``node`` from the file at ``path``; the defaults when None."""
    if path is None:
        return NodeConfig()
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise NodeConfigError(source, [f"cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise NodeConfigError(source, [f"not UTF-8 text: {exc.reason}"]) from None
    return parse_node_config(text, node, source=source)
