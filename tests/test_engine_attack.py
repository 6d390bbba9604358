"""Regressions from a review of the compiled engine's wrapper (core.py) and the mix."""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from typing import Any

import numpy as np
import pytest

from gpuslice_common.models import (
    ContainerGpuRequest,
    DeviceSelector,
    GpuPolicy,
    MemoryRequest,
    PodGpuRequest,
    PodRef,
)
from gpuslice_scheduler import core
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import Demand, evaluate
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import WorkloadClass, WorkloadMix, default_mix

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


def test_a_mix_built_by_another_thread_meanwhile_is_the_one_used() -> None:
    """Two threads missing the cache at once: the later must not replace (and so free)
    the entry the earlier stored and is using."""
    c = cluster(2, 4)
    mix = big_mix(50)
    other: list[Any] = []
    real = mix.model_ok

    def meanwhile(models: list[str]) -> Any:  # another thread stores its build first
        mix.model_ok = real  # type: ignore[method-assign]
        other.append(core._mix(mix, c))
        return real(models)

    mix.model_ok = meanwhile  # type: ignore[method-assign]
    mine = core._mix(mix, c)
    assert mine is other[0]
    assert mix.core_structs[tuple(c.models)] is other[0]


def test_threads_evaluating_a_new_mix_at_once_never_replace_each_others_structs() -> None:
    c1, c2 = cluster(16, 8), cluster(16, 8)
    d = demand(count=2)
    mixes = [big_mix(120) for _ in range(30)]
    replaced = []

    class Watch(dict):  # type: ignore[type-arg]
        def __setitem__(self, k: Any, v: Any) -> None:
            if k in self:
                replaced.append(k)
            super().__setitem__(k, v)

        def setdefault(self, k: Any, v: Any) -> Any:
            return super().setdefault(k, v)

    for m in mixes:
        m.core_structs = Watch()
    barrier = threading.Barrier(2)

    def run(cl: Any) -> None:
        for m in mixes:
            barrier.wait()
            evaluate(cl, d, np.arange(cl.node_count), m)

    threads = [threading.Thread(target=run, args=(cl,)) for cl in (c1, c2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads' Python often, as a busy process may
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert replaced == []


@pytest.mark.parametrize("frequency", [math.nan, math.inf, -1.0])
def test_a_mix_of_non_finite_or_negative_weight_is_refused(frequency: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        WorkloadMix.of(
            [
                WorkloadClass(frequency, CardDemand(1, -1, 50, 50, False)),
                WorkloadClass(1.0, CardDemand(1, -1, 100, 100, True)),
            ]
        )


@pytest.mark.parametrize("case", ["model_id", "node_start", "float_caps", "short_array"])
def test_the_core_is_never_handed_a_cluster_whose_arrays_disagree(case: str) -> None:
    c = cluster(2, 4)
    if case == "model_id":
        c.model_id[3] = 1000
    elif case == "node_start":
        c = dataclasses.replace(c, node_start=np.array([0, 4, 4000], dtype=np.int64))
    elif case == "float_caps":
        c = dataclasses.replace(c, cap_mem=c.cap_mem.astype(np.float64))
    else:
        c = dataclasses.replace(c, used_mem=c.used_mem[:3].copy())
    with pytest.raises(core.CoreError):
        evaluate(c, demand(count=1), np.arange(2), default_mix())


def test_a_memory_demand_near_the_integer_limit_never_wraps_into_a_fit() -> None:
    """``used + demand`` past INT64_MAX would wrap negative and fit; the core compares
    the demand with what is left instead."""
    c = cluster(1, 2, used_mem=1)
    huge = demand(count=1, mib=2**63 - 1, policy=GpuPolicy.BINPACK)
    e = evaluate(c, huge, np.arange(1))
    assert e.feasible.tolist() == [False]
    assert e.chosen[0].tolist() == [[-1]]
    assert "CardInsufficientMemory" in e.detail[0]
