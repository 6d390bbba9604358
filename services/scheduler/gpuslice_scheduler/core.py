"""The placement engine's compiled core (``native/engine/engine.c``), through cffi.

The interface has one definition, the C header ``engine_core.h`` shipped inside
this package: it is read at import and handed to cffi's ``cdef`` (ABI mode, as
:mod:`gpuslice_common.region` reads the region layout), so struct layouts are
the ones the C compiler used. The library, ``libgsengine.so``, is loaded on
first use from ``$GPUSLICE_NATIVE_DIR`` (the image sets it) or else from the
repository's ``native/build`` (``make engine`` builds it); a missing or stale
library is a :class:`CoreError` that says so, never a silent fallback.

The core reads the cluster's NumPy arrays in place and writes its answers into
arrays allocated here; it keeps no pointer after a call, and cffi releases the
GIL while it runs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from gpuslice_common.models import (
    NVIDIA,
    ContainerGpuRequest,
    DeviceSelector,
    GpuPolicy,
    NodePolicy,
    ScoringWeights,
    VgpuMode,
)
from gpuslice_common.region import header_ffi
from gpuslice_scheduler.cluster import Bools, Cluster, Floats, Ints
from gpuslice_scheduler.fit import model_mask
from gpuslice_scheduler.mig import mode_ok

if TYPE_CHECKING:
    from gpuslice_scheduler.fragmentation import WorkloadMix

HEADER: Final = "engine_core.h"
LIBRARY: Final = "libgsengine.so"


class CoreError(RuntimeError):
    """The compiled core cannot be loaded or refused a call; the message says why."""


ffi, _DEFINES = header_ffi("gpuslice_scheduler", HEADER)
CODE_COUNT: Final = _DEFINES["GS_CODE_COUNT"]
FAIL_NONE: Final = _DEFINES["GS_FAIL_NONE"]
FAIL_NODE_SHORT: Final = _DEFINES["GS_FAIL_NODE_SHORT"]
FAIL_CONTAINER: Final = _DEFINES["GS_FAIL_CONTAINER"]
_GPU_POLICY: Final = {
    GpuPolicy.FRAGMENTATION: _DEFINES["GS_POLICY_FRAGMENTATION"],
    GpuPolicy.BINPACK: _DEFINES["GS_POLICY_BINPACK"],
    GpuPolicy.SPREAD: _DEFINES["GS_POLICY_SPREAD"],
}
_NODE_POLICY: Final = {
    None: _DEFINES["GS_POLICY_NONE"],
    NodePolicy.BINPACK: _DEFINES["GS_POLICY_BINPACK"],
    NodePolicy.SPREAD: _DEFINES["GS_POLICY_SPREAD"],
}
_ERRORS: Final = {
    _DEFINES["GS_ENOMEM"]: "out of memory",
    _DEFINES["GS_EINVAL"]: "invalid arguments (a node index, policy or card count)",
}


def library_path() -> Path:
    """Where the library is looked for."""
    folder = os.environ.get("GPUSLICE_NATIVE_DIR")
    root = Path(folder) if folder else Path(__file__).resolve().parents[3] / "native" / "build"
    return root / LIBRARY


@functools.cache
def _library() -> Any:
    path = library_path()
    if not path.is_file():
        raise CoreError(
            f"the compiled placement engine {path} is missing: build it with `make engine` "
            f"(in the repository), or set GPUSLICE_NATIVE_DIR to the folder holding {LIBRARY}"
        )
    try:
        lib = ffi.dlopen(str(path))
    except OSError as exc:
        raise CoreError(f"the compiled placement engine {path} cannot be loaded: {exc}") from None
    if lib.gs_engine_abi() != _DEFINES["GS_ENGINE_ABI"]:
        raise CoreError(f"{path} was built from another version of {HEADER}: rebuild it")
    return lib


def load() -> None:
    """Load the library now (a service does at start, to fail there rather than later)."""
    _library()


def _check(status: int) -> None:
    if status != 0:
        raise CoreError(f"the compiled placement engine refused the call: {_ERRORS[status]}")


# ---------------------------------------------------------------- inputs


def _pointer(kind: str, array: np.ndarray[Any, Any], keep: list[Any]) -> Any:
    buffer = ffi.from_buffer(kind, np.ascontiguousarray(array))
    keep.append(buffer)
    return buffer


_CLUSTER_FIELDS: Final = (
    ("node_start", "int64_t[]"),
    ("model_id", "int64_t[]"),
    ("numa", "int64_t[]"),
    ("cap_mem", "int64_t[]"),
    ("cap_cores", "int64_t[]"),
    ("cap_slots", "int64_t[]"),
    ("used_mem", "int64_t[]"),
    ("used_cores", "int64_t[]"),
    ("used_slots", "int64_t[]"),
    ("owned", "uint8_t[]"),
    ("healthy", "uint8_t[]"),
    ("present", "uint8_t[]"),
    ("cordoned", "uint8_t[]"),
    ("node_cpu_free", "double[]"),
    ("node_mem_free", "double[]"),
)
_C_NAMES: Final = {"node_cpu_free": "cpu_free", "node_mem_free": "mem_free"}


_KINDS: Final = {"int64_t[]": "i", "uint8_t[]": "bu", "double[]": "f"}


def _check_shape(cluster: Cluster, arrays: tuple[Any, ...]) -> None:
    """What the core trusts: node_start runs from 0 to the card count without going
    back, every card array has a row per card and every node array one per node, and
    model indexes are rows of the model table. Checked once per set of arrays."""
    start, nodes, cards = arrays[0], cluster.node_count, cluster.card_count
    if (
        start.shape != (nodes + 1,)
        or start[0] != 0
        or start[-1] != cards
        or bool((np.diff(start) < 0).any())
    ):
        raise CoreError("the cluster's node_start does not divide its cards among its nodes")
    for (name, _), array in zip(_CLUSTER_FIELDS[1:], arrays[1:], strict=True):
        rows = nodes if name.startswith("node_") else cards
        if array.shape != (rows,):
            raise CoreError(f"the cluster's {name} has shape {array.shape}, not ({rows},)")
    model_id = arrays[1]
    if model_id.size and (model_id.min() < 0 or model_id.max() >= len(cluster.models)):
        raise CoreError("the cluster's model_id indexes past its models")


def _cluster(cluster: Cluster) -> tuple[Any, Any, list[Any]]:
    """The cluster's arrays as a ``gs_cluster_t``, made once per cluster: the core reads
    them in place, so changes to the arrays need no rebuild (replacing one does).

    Returns the whole cache entry (arrays, struct, keep-alives): the caller holds it
    for the length of its call, so that another thread replacing the entry (a rebuild,
    or a build of its own at the same time) cannot free buffers the call reads."""
    arrays = tuple(getattr(cluster, name) for name, _ in _CLUSTER_FIELDS)
    cached = cluster.lookups.get("core")
    if cached is not None and all(a is b for a, b in zip(cached[0], arrays, strict=True)):
        return cached  # type: ignore[no-any-return]
    _check_shape(cluster, arrays)
    keep: list[Any] = []
    struct = ffi.new("gs_cluster_t *")
    struct.node_count = cluster.node_count
    for (name, kind), array in zip(_CLUSTER_FIELDS, arrays, strict=True):
        if not (array.flags.c_contiguous and array.dtype.itemsize == ffi.sizeof(kind[:-2])):
            raise CoreError(f"the cluster's {name} is not a contiguous array of {kind[:-2]}")
        if array.dtype.kind not in _KINDS[kind]:
            raise CoreError(f"the cluster's {name} is {array.dtype}, not {kind[:-2]}")
        setattr(struct, _C_NAMES.get(name, name), _pointer(kind, array, keep))
    entry = (arrays, struct, keep)
    cluster.lookups["core"] = entry
    return entry


def _mix(mix: WorkloadMix, cluster: Cluster) -> tuple[Any, list[Any]]:
    """A workload mix as a ``gs_mix_t`` for
    clusters of these models, made once per mix and list of models."""
    models = cluster.models
    key = tuple(models)
    cached = mix.core_structs.get(key)  # kept only once its feed ratios are fixed
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    feed = mix.feed_ratios(cluster)
    keep: list[Any] = []
    struct = ffi.new("gs_mix_t *")
    struct.classes = len(mix.classes)
    struct.parts = len(mix.parts)
    struct.weight = _pointer("double[]", mix.weight.astype(np.float64), keep)
    struct.cpu = _pointer("double[]", mix.cpu.astype(np.float64), keep)
    struct.memory = _pointer("double[]", mix.memory.astype(np.float64), keep)
    for name in ("need", "part", "part_mem_mib", "part_mem_percent", "part_cores"):
        setattr(struct, name, _pointer("int64_t[]", getattr(mix, name).astype(np.int64), keep))
    struct.part_exclusive = _pointer("uint8_t[]", mix.part_exclusive.astype(np.uint8), keep)
    model_ok = mix.model_ok(models).astype(np.uint8)
    if model_ok.shape != (len(models), len(mix.parts)):
        raise CoreError("the mix's model table does not match the cluster's models")
    struct.model_ok = _pointer("uint8_t[]", model_ok, keep)
    struct.cpu_per_share, struct.mem_per_share = feed
    struct.starved_weight = mix.starved_weight
    if mix.fixed_feed != feed:  # priced for this cluster only (see feed_ratios): not kept
        return struct, keep
    # of two threads building at once, both use the first stored (and hold it)
    return mix.core_structs.setdefault(key, (struct, keep))  # type: ignore[no-any-return]


MASKS_KEPT: Final = 256  # distinct type or UUID lists remembered per cluster


def _selector_masks(
    cluster: Cluster,
    selector: DeviceSelector,
    vgpu_mode: VgpuMode | None = None,
    vendor: str = NVIDIA,
) -> tuple[Bools | None, Bools | None]:
    """Per model (a (model, mode, vendor) kind), may the type lists, the pod's vgpu-mode
    (:func:`~gpuslice_scheduler.mig.mode_ok`) and its vendor use it; per card, may the
    UUID lists (None: no list, and every card is an NVIDIA card in mode hami-core, or
    none is asked for).

    Remembered per cluster, up to :data:`MASKS_KEPT` lists (then forgotten all at
    once), so that pods naming ever-new lists cannot grow it without bound."""
    masks: dict[tuple[object, ...], Bools] = cluster.lookups.setdefault("selector_masks", {})
    if len(masks) > MASKS_KEPT:
        masks.clear()
    types = uuids = None
    modes = cluster.modes_differ or vgpu_mode not in (None, VgpuMode.HAMI_CORE)
    vendors = cluster.vendors_differ or vendor != NVIDIA
    if selector.include_types or selector.exclude_types or modes or vendors:
        key: tuple[object, ...] = (
            "types",
            selector.include_types,
            selector.exclude_types,
            vgpu_mode,
            vendor,
        )
        types = masks.get(key)
        if types is None:
            allowed = model_mask(selector, cluster.models)
            if modes:
                allowed &= np.asarray([mode_ok(m, vgpu_mode) for m in cluster.model_mode], bool)
            if vendors:
                allowed &= np.asarray([v == vendor for v in cluster.model_vendor], bool)
            types = masks[key] = allowed.astype(np.uint8)
    if selector.include_uuids or selector.exclude_uuids:
        key = ("uuids", selector.include_uuids, selector.exclude_uuids)
        uuids = masks.get(key)
        if uuids is None:
            include, exclude = set(selector.include_uuids), set(selector.exclude_uuids)
            uuids = masks[key] = np.fromiter(
                ((not include or u in include) and u not in exclude for u in cluster.uuids),
                dtype=np.uint8,
                count=cluster.card_count,
            )
    return types, uuids


def _containers(containers: tuple[ContainerGpuRequest, ...]) -> Any:
    array = ffi.new("gs_container_t[]", max(len(containers), 1))
    for slot, container in zip(array, containers, strict=False):
        memory = container.memory
        slot.count = container.count
        slot.mem_mib = -1 if memory.mib is None else memory.mib
        slot.mem_percent = -1 if memory.percent is None else memory.percent
        slot.cores = container.cores
        slot.exclusive = container.exclusive
        slot.init = container.init
        slot.sidecar = container.sidecar
    return array


# ---------------------------------------------------------------- calls


_EVEN: Final = ScoringWeights()


@dataclass
class Answer:
    """The core's answer per evaluated node (rows follow the nodes asked about)."""

    feasible: Bools
    score: Floats
    code: np.ndarray[Any, np.dtype[np.int8]]
    chosen: list[Ints]  # per container: (nodes, count) card indexes, -1 where none
    failed: np.ndarray[Any, np.dtype[np.int32]]  # FAIL_NONE, FAIL_NODE_SHORT, FAIL_CONTAINER + c
    counts: np.ndarray[Any, np.dtype[np.int32]]  # (nodes, CODE_COUNT): the failed container's


def evaluate(
    cluster: Cluster,
    request_containers: tuple[ContainerGpuRequest, ...] | None,
    selector: DeviceSelector,
    gpu_policy: GpuPolicy,
    node_policy: NodePolicy | None,
    cpu: float,
    memory: float,
    nodes: Ints,
    mix: WorkloadMix | None,
    vgpu_mode: VgpuMode | None = None,
    weights: ScoringWeights = _EVEN,
    kinds: Bools | None = None,
) -> Answer:
    """Run ``gs_evaluate``: ``request_containers`` None for a pod that asks for no GPU;
    ``weights`` weigh HAMi's card score (binpack and spread); ``kinds``, when given,
    the kinds of card (per model entry) the pod may use besides its selector's."""
    lib = _library()
    nodes = np.ascontiguousarray(nodes, dtype=np.int64)
    n = int(nodes.size)
    containers = request_containers or ()
    counts_per = [c.count for c in containers]
    keep: list[Any] = []
    demand = ffi.new("gs_demand_t *")
    demand.gpu_policy = _GPU_POLICY[gpu_policy]
    demand.node_policy = _NODE_POLICY[node_policy]
    demand.cpu = cpu
    demand.memory = memory
    demand.containers = -1 if request_containers is None else len(containers)
    demand.container = holder = _containers(containers)
    keep.append(holder)
    demand.numa_bind = selector.numa_bind
    demand.slot_weight = weights.slot
    demand.core_weight = weights.core
    demand.mem_weight = weights.memory
    vendor = containers[0].vendor if containers else NVIDIA  # one per pod: parse_pod
    types, uuids = _selector_masks(cluster, selector, vgpu_mode, vendor)
    if kinds is not None:
        allowed = kinds if types is None else kinds & types.astype(np.bool_)
        types = allowed.astype(np.uint8)
    if types is not None:
        demand.type_ok = _pointer("uint8_t[]", types, keep)
    if uuids is not None:
        demand.uuid_ok = _pointer("uint8_t[]", uuids, keep)

    feasible = np.empty(n, dtype=np.bool_)
    score = np.empty(n, dtype=np.float64)
    code = np.empty(n, dtype=np.int8)
    flat = np.empty(max(n * sum(counts_per), 1), dtype=np.int64)
    failed = np.empty(n, dtype=np.int32)
    counts = np.empty((n, CODE_COUNT), dtype=np.int32)
    result = ffi.new("gs_result_t *")
    result.feasible = _pointer("uint8_t[]", feasible, keep)
    result.score = _pointer("double[]", score, keep)
    result.code = _pointer("int8_t[]", code, keep)
    result.chosen = _pointer("int64_t[]", flat, keep)
    result.failed = _pointer("int32_t[]", failed, keep)
    result.counts = _pointer("int32_t[]", counts, keep)
    cluster_entry = _cluster(cluster)  # checked first; held through the call: see _cluster
    mix_entry = None if mix is None else _mix(mix, cluster)
    c_mix = ffi.NULL if mix_entry is None else mix_entry[0]
    c_nodes = _pointer("int64_t[]", nodes, keep)
    _check(lib.gs_evaluate(cluster_entry[1], demand, c_mix, c_nodes, n, result))
    del cluster_entry, mix_entry
    chosen, start = [], 0
    for count in counts_per:
        chosen.append(flat[start : start + n * count].reshape(n, count))
        start += n * count
    return Answer(feasible, score, code, chosen, failed, counts)


def fragmentation(cluster: Cluster, mix: WorkloadMix, nodes: Ints) -> tuple[Floats, Floats]:
    """Run ``gs_fragmentation``: per node, its fragmentation and free share."""
    lib = _library()
    nodes = np.ascontiguousarray(nodes, dtype=np.int64)
    keep: list[Any] = []
    frag = np.empty(nodes.size, dtype=np.float64)
    total = np.empty(nodes.size, dtype=np.float64)
    cluster_entry, mix_entry = _cluster(cluster), _mix(mix, cluster)  # held: see _cluster
    _check(
        lib.gs_fragmentation(
            cluster_entry[1],
            mix_entry[0],
            _pointer("int64_t[]", nodes, keep),
            int(nodes.size),
            _pointer("double[]", frag, keep),
            _pointer("double[]", total, keep),
        )
    )
    return frag, total
