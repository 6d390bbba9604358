"""An NVIDIA A100-40GB in MIG mode, as a node agent reports it: the GPU instance
profiles NVML lists for it, with every placement (facts for the tests)."""

from __future__ import annotations

from collections.abc import Sequence

from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    GpuDevice,
    MigGrant,
    MigInstance,
    MigPlacement,
    MigProfile,
    NodeInventory,
    Placement,
    PodRef,
    VgpuMode,
)

A100_MODEL = "NVIDIA A100-SXM4-40GB"
A100_MEMORY_MIB = 40960

# name: (memory MiB, cores %, compute slices, placement size, placement starts)
A100_PROFILES: dict[str, tuple[int, int, int, int, tuple[int, ...]]] = {
    "1g.5gb": (4864, 14, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    "1g.10gb": (9856, 14, 1, 2, (0, 2, 4, 6)),
    "2g.10gb": (9856, 28, 2, 2, (0, 2, 4)),
    "3g.20gb": (19968, 42, 3, 4, (0, 4)),
    "4g.20gb": (19968, 57, 4, 4, (0,)),
    "7g.40gb": (40192, 100, 7, 8, (0,)),
}


def a100_profiles() -> tuple[MigProfile, ...]:
    return tuple(
        MigProfile(
            name=name,
            memory_mib=mem,
            cores=cores,
            slices=slices,
            placements=tuple(MigPlacement(start=s, size=size) for s in starts),
        )
        for name, (mem, cores, slices, size, starts) in A100_PROFILES.items()
    )


def static(profile: str, start: int, uuid: str = "MIG-static-0") -> MigInstance:
    size = A100_PROFILES[profile][3]
    return MigInstance(uuid=uuid, profile=profile, placement=MigPlacement(start=start, size=size))


def a100(
    uuid: str, index: int = 0, instances: tuple[MigInstance, ...] = (), numa: int | None = None
) -> GpuDevice:
    return GpuDevice(
        uuid=uuid,
        index=index,
        model=A100_MODEL,
        memory_mib=A100_MEMORY_MIB,
        mig=True,
        mode=VgpuMode.MIG,
        mig_profiles=a100_profiles(),
        mig_instances=instances,
        numa=numa,
    )


def mig_node(
    node: str, cards: int = 1, *, plain: int = 0, instances: tuple[MigInstance, ...] = ()
) -> NodeInventory:
    """A node with ``cards`` A100s in mode mig (GPU-<node>-<i>, each with the static
    ``instances``), then ``plain`` hami-core ones."""
    devices = [a100(f"GPU-{node}-{i}", i, instances) for i in range(cards)]
    devices += [
        GpuDevice(uuid=f"GPU-{node}-{i}", index=i, model=A100_MODEL, memory_mib=A100_MEMORY_MIB)
        for i in range(cards, cards + plain)
    ]
    return NodeInventory(node=node, devices=tuple(devices))


def grant(uuid: str, profile: str, start: int) -> DeviceGrant:
    mem, cores, _, size, _ = A100_PROFILES[profile]
    return DeviceGrant(
        uuid=uuid,
        memory_mib=mem,
        cores=cores,
        mig=MigGrant(profile=profile, placement=MigPlacement(start=start, size=size)),
    )


def mig_placement(
    uid: str, node: str, grants: Sequence[DeviceGrant], init: Sequence[DeviceGrant] = ()
) -> Placement:
    """One app container per grant in ``grants``, one init container per grant in ``init``."""
    containers = [
        ContainerAssignment(name=f"init{i}", init=True, devices=(g,)) for i, g in enumerate(init)
    ]
    containers += [ContainerAssignment(name=f"c{i}", devices=(g,)) for i, g in enumerate(grants)]
    return Placement(
        pod=PodRef(uid=uid, namespace="ns", name=uid), node=node, containers=tuple(containers)
    )
