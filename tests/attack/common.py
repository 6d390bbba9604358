"""Shared helpers for the attack reproductions (run as scripts)."""

from __future__ import annotations

from gpuslice_common.models import (
    ContainerGpuRequest,
    DeviceSelector,
    GpuPolicy,
    MemoryRequest,
    PodGpuRequest,
    PodRef,
)
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import Demand
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import WorkloadClass, WorkloadMix

MODELS = ("NVIDIA A100-SXM4-80GB", "Tesla T4")


def cluster(nodes: int, cards: int, used_mem: int = 0) -> Cluster:
    rows = []
    for n in range(nodes):
        rows.append(
            (
                f"node-{n}",
                [
                    (
                        f"GPU-{n}-{c}",
                        MODELS[c % 2],
                        c % 2,
                        81920,
                        100,
                        10,
                        used_mem,
                        0,
                        0,
                        False,
                        True,
                        True,
                        False,
                    )
                    for c in range(cards)
                ],
            )
        )
    return Cluster.from_rows(rows)


def big_mix(classes: int) -> WorkloadMix:
    """A mix with many distinct parts (distinct MiB amounts), so that its arrays are
    large enough for NumPy to hand them to free() (its small-block cache keeps < 1 KiB)."""
    return WorkloadMix.of(
        [
            WorkloadClass(
                1.0 + i,
                CardDemand(1, 100 + i, -1, 10, False),
                DeviceSelector(include_types=("a100",) if i % 2 else ()),
            )
            for i in range(classes)
        ]
    )


def demand(
    count: int = 1,
    containers: int = 1,
    mib: int = 1000,
    cores: int = 10,
    policy: GpuPolicy = GpuPolicy.FRAGMENTATION,
    numa: bool = False,
) -> Demand:
    req = PodGpuRequest(
        pod=PodRef(uid="p"),
        containers=tuple(
            ContainerGpuRequest(
                name=f"c{i}", count=count, memory=MemoryRequest(mib=mib), cores=cores
            )
            for i in range(containers)
        ),
        selector=DeviceSelector(numa_bind=numa),
        gpu_policy=policy,
    )
    return Demand.of(req)
