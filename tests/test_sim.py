"""Trace replay (``gpuslice_scheduler.sim``) and ``gpuslice sim``, on small synthetic traces.

Every trace here is written into ``tmp_path`` by the test itself; nothing reads the real
openb traces, so the file runs anywhere in a few seconds.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuslice_common.models import GpuPolicy
from gpuslice_scheduler import sim
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import Demand, evaluate
from gpuslice_scheduler.sim import Derivation, PodClass, RunResult, TraceError, TraceNode

ROOT = Path(__file__).resolve().parent.parent
NODE_HEADER = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_HEADER = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec")

# 16 nodes, 63 cards: T4 (1 and 2 per node), V100M32 (4 and 8) and G2 (2 and 8).
LAYOUT = [(1, "T4")] * 3 + [(2, "T4")] * 2 + [(4, "V100M32")] * 3 + [(8, "V100M32")] * 2
LAYOUT += [(8, "G2")] * 2 + [(2, "G2")] * 2 + [(4, "T4")] * 2


# ---------------------------------------------------------------- synthetic traces


def write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[object]]) -> Path:
    lines = [",".join(header)] + [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def synthetic_nodes() -> list[TraceNode]:
    return [
        TraceNode(f"node-{i:02d}", 96_000 if gpus == 8 else 64_000, 262_144, gpus, model)
        for i, (gpus, model) in enumerate(LAYOUT)
    ]


def synthetic_pods(count: int, seed: int = 7) -> list[PodClass]:
    """CPU-only pods, shares of 100-900 milli, whole GPUs and 2/4-GPU pods, some with a spec."""
    rng = random.Random(seed)
    pods = []
    for i in range(count):
        kind = rng.random()
        if kind < 0.1:
            pod = PodClass(rng.choice([1000, 4000, 8000]), 4096, 0, 0, ())
        elif kind < 0.6:
            share = rng.choice([100, 200, 250, 300, 500, 500, 700, 900])
            pod = PodClass(4000, 8192, 1, share, ())
        elif kind < 0.85:
            pod = PodClass(8000, 16_384, 1, 1000, ())
        else:
            pod = PodClass(16_000, 32_768, rng.choice([2, 4]), 1000, ())
        if pod.num_gpu and i % 9 == 0:
            spec = rng.choice([("T4",), ("V100M16", "V100M32")])
            pod = PodClass(pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, spec)
        pods.append(pod)
    return pods


def node_rows(nodes: Sequence[TraceNode]) -> list[tuple[object, ...]]:
    return [(n.name, n.cpu_milli, n.memory_mib, n.gpus, n.model) for n in nodes]


def pod_rows(pods: Sequence[PodClass]) -> list[tuple[object, ...]]:
    return [
        (f"pod-{i:04d}", p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, "|".join(p.gpu_spec))
        for i, p in enumerate(pods)
    ]


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, Path]:
    """The synthetic cluster and an 80-pod mixed trace, as openb-style CSV files."""
    nodes = write_csv(
        tmp_path / "openb_node_list_gpu_node.csv", NODE_HEADER, node_rows(synthetic_nodes())
    )
    pods = write_csv(tmp_path / "openb_pod_list_synth.csv", POD_HEADER, pod_rows(MIXED))
    return nodes, pods


NODES = synthetic_nodes()
MIXED = synthetic_pods(80)
CAPACITY = 1000 * sum(n.gpus for n in NODES)


def capture_cluster(monkeypatch: pytest.MonkeyPatch) -> list[Cluster]:
    """Keep the cluster each replay builds, to look at its usage afterwards."""
    built: list[Cluster] = []
    original = sim.build_cluster

    def build(nodes: Sequence[TraceNode], split_count: int = sim.SPLIT_COUNT) -> Cluster:
        cluster = original(nodes, split_count)
        built.append(cluster)
        return cluster

    monkeypatch.setattr(sim, "build_cluster", build)
    return built


def arrived_count(pods: Sequence[PodClass], seed: int, inflation: float) -> int:
    """Pods of the arrival list up to the one that brings arrived demand to the target."""
    arrived = 0
    for count, index in enumerate(sim.arrivals(pods, CAPACITY, inflation, seed), start=1):
        arrived += pods[index].gpu_demand
        if arrived >= inflation * CAPACITY:
            return count
    raise AssertionError("the arrival list never reaches the target")


# ---------------------------------------------------------------- loading


def test_good_files_parse(tmp_path: Path) -> None:
    nodes_csv = write_csv(
        tmp_path / "nodes.csv",
        NODE_HEADER,
        [("a", 64000, 262144, 2, "T4"), ("", "96000.0", 524288, 8, "V100M32"), ("c", 1, 1, 0, "")],
    )
    nodes = sim.load_nodes(nodes_csv)
    assert nodes == [
        TraceNode("a", 64000, 262144, 2, "T4"),
        TraceNode("nodes.csv:3", 96000, 524288, 8, "V100M32"),  # a blank name: where it is
        TraceNode("c", 1, 1, 0, "unknown"),
    ]
    pods_csv = write_csv(
        tmp_path / "pods.csv",
        (*POD_HEADER, "qos"),
        [
            ("p0", 12000, 16384, 1, 1000, "", "LS"),
            ("p1", 6000, 12288, 1, 460, "T4", "LS"),
            ("p2", 8000, 8192, 2, 1000, "V100M16|V100M32", "BE"),
            ("p3", 4000, 2048, 0, 0, "", "BE"),
            ("p4", 4000, 2048, 0, 300, "T4", "BE"),  # no GPU: share and spec do not count
        ],
    )
    pods = sim.load_pods(pods_csv)
    assert pods == [
        PodClass(12000, 16384, 1, 1000, ()),
        PodClass(6000, 12288, 1, 460, ("T4",)),
        PodClass(8000, 8192, 2, 1000, ("V100M16", "V100M32")),
        PodClass(4000, 2048, 0, 0, ()),
        PodClass(4000, 2048, 0, 0, ()),
    ]
    assert [p.gpu_demand for p in pods] == [1000, 460, 2000, 0, 0]
    assert pods[3].request() is None
    request = pods[1].request()
    assert request is not None
    assert request.selector.include_types == ("T4",)
    (container,) = request.containers
    assert (container.count, container.cores, container.memory.percent) == (1, 46, 46)


def test_a_trace_without_gpu_spec_parses(tmp_path: Path) -> None:
    """multigpu50 has no gpu_spec column."""
    path = write_csv(
        tmp_path / "pods.csv",
        ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"),
        [("p0", 1000, 1024, 4, 1000), ("p1", 1000, 1024, 1, 250)],
    )
    assert sim.load_pods(path) == [
        PodClass(1000, 1024, 4, 1000, ()),
        PodClass(1000, 1024, 1, 250, ()),
    ]


def test_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "pods.csv"
    path.write_text("cpu_milli,memory_mib,num_gpu,gpu_milli\n1,1,1,100\n\n1,1,1,oops\n")
    with pytest.raises(TraceError, match=r"pods\.csv:4: column 'gpu_milli' is not a number"):
        sim.load_pods(path)


POD_COLUMNS = ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (("x", 1, 1, 100), r"pods\.csv:3: column 'cpu_milli' is not a number: 'x'"),
        (("", 1, 1, 100), r"pods\.csv:3: column 'cpu_milli' is not a number: ''"),
        ((1, 1, 1, 1500), r"pods\.csv:3: column 'gpu_milli' = 1500 is outside 0\.\.1000"),
        ((1, 1, 2, 500), r"pods\.csv:3: a pod with 2 GPUs must ask 1000 milli each"),
        ((1, -1, 1, 100), r"pods\.csv:3: column 'memory_mib' = -1 is outside"),
        ((1, 1, -1, 100), r"pods\.csv:3: column 'num_gpu' = -1 is outside"),
        ((1, 1, 65, 1000), r"pods\.csv:3: column 'num_gpu' = 65 is outside 0\.\.64"),
        ((1, 1, 0.5, 1000), r"pods\.csv:3: column 'num_gpu' is not a whole number: '0\.5'"),
        ((1, 1, 1, "inf"), r"pods\.csv:3: column 'gpu_milli' is not a whole number: 'inf'"),
        ((1, 1, 1, "nan"), r"pods\.csv:3: column 'gpu_milli' is not a whole number: 'nan'"),
    ],
)
def test_bad_pod_rows_name_the_line_and_column(
    tmp_path: Path, row: tuple[object, ...], message: str
) -> None:
    path = write_csv(tmp_path / "pods.csv", POD_COLUMNS, [(1000, 1024, 1, 500), row])
    with pytest.raises(TraceError, match=message):
        sim.load_pods(path)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (("n", "lots", 1, 1, "T4"), r"nodes\.csv:2: column 'cpu_milli' is not a number"),
        (("n", 1, 1, 65, "T4"), r"nodes\.csv:2: column 'gpu' = 65 is outside 0\.\.64"),
        (("n", 1, -5, 1, "T4"), r"nodes\.csv:2: column 'memory_mib' = -5 is outside"),
    ],
)
def test_bad_node_rows_name_the_line_and_column(
    tmp_path: Path, row: tuple[object, ...], message: str
) -> None:
    path = write_csv(tmp_path / "nodes.csv", NODE_HEADER, [row])
    with pytest.raises(TraceError, match=message):
        sim.load_nodes(path)


def test_a_missing_column_is_named_with_the_file(tmp_path: Path) -> None:
    pods = write_csv(tmp_path / "pods.csv", ("cpu_milli", "memory_mib", "num_gpu"), [(1, 1, 1)])
    with pytest.raises(TraceError, match="missing column") as caught:
        sim.load_pods(pods)
    assert str(pods) in str(caught.value)
    assert "gpu_milli" in str(caught.value)
    nodes = write_csv(tmp_path / "nodes.csv", ("sn", "cpu_milli", "gpu"), [("n", 1, 1)])
    with pytest.raises(TraceError, match=r"missing column\(s\) memory_mib, model"):
        sim.load_nodes(nodes)


def test_unreadable_paths_are_trace_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.csv"
    with pytest.raises(TraceError, match="cannot read") as caught:
        sim.load_pods(missing)
    assert str(missing) in str(caught.value)
    with pytest.raises(TraceError, match="cannot read"):
        sim.load_nodes(tmp_path)  # a directory


@pytest.mark.parametrize("content", ["", "cpu_milli,memory_mib,num_gpu,gpu_milli\n"])
def test_an_empty_pod_file_is_a_trace_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "pods.csv"
    path.write_text(content)
    with pytest.raises(TraceError) as caught:
        sim.load_pods(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("content", ["", ",".join(NODE_HEADER) + "\n"])
def test_an_empty_node_file_is_a_trace_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "nodes.csv"
    path.write_text(content)
    with pytest.raises(TraceError) as caught:
        sim.load_nodes(path)
    assert str(path) in str(caught.value)


def test_a_binary_file_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "pods.csv"
    path.write_bytes(b"cpu_milli,memory_mib,num_gpu,gpu_milli\n1,1,1,\xff\xfe\n")
    with pytest.raises(TraceError, match="not a UTF-8 CSV file") as caught:
        sim.load_pods(path)
    assert str(path) in str(caught.value)


# ---------------------------------------------------------------- arrivals


def test_arrivals_depend_on_the_seed_only() -> None:
    first = sim.arrivals(MIXED, CAPACITY, 1.3, 42)
    assert sim.arrivals(MIXED, CAPACITY, 1.3, 42) == first
    assert sim.arrivals(MIXED, CAPACITY, 1.3, 43) != first


@pytest.mark.parametrize("inflation", [1.3, 2.0, 3.5])
def test_arrivals_inflate_to_the_target(inflation: float) -> None:
    demand = [p.gpu_demand for p in MIXED]
    assert sum(demand) < inflation * CAPACITY  # the trace alone is short of every target
    order = sim.arrivals(MIXED, CAPACITY, inflation, 42)
    counts = Counter(order)
    assert set(counts) >= set(range(len(MIXED)))  # every pod of the trace arrives
    assert all(0 <= i < len(MIXED) for i in counts)
    total = sum(demand[i] for i in order)
    assert total >= inflation * CAPACITY
    # Inflation stops at the first draw that reaches the target.
    assert total - max(demand) < inflation * CAPACITY
    assert order[: len(MIXED)] != list(range(len(MIXED)))  # shuffled


def test_a_trace_past_the_target_is_not_inflated() -> None:
    order = sim.arrivals(MIXED, CAPACITY, 0.5, 42)
    assert sum(p.gpu_demand for p in MIXED) > 0.5 * CAPACITY
    assert sorted(order) == list(range(len(MIXED)))
    assert order != list(range(len(MIXED)))


def test_a_trace_without_gpu_pods_is_a_trace_error() -> None:
    with pytest.raises(TraceError, match="no pod in the trace asks for a GPU"):
        sim.arrivals([PodClass(1000, 1024, 0, 0, ())], CAPACITY, 1.3, 42)


# ---------------------------------------------------------------- replay


def check_cluster(cluster: Cluster, result: RunResult) -> None:
    """No card, slot or node over-committed, and usage adding up to the reported allocation."""
    assert (cluster.used_cores <= cluster.cap_cores).all()
    assert (cluster.used_mem <= cluster.cap_mem).all()
    assert (cluster.used_slots <= cluster.cap_slots).all()
    assert (cluster.used_cores >= 0).all()
    owned = cluster.owned
    assert (cluster.used_slots[owned] == 1).all()  # a whole GPU is nobody else's
    assert (cluster.used_cores[owned] == 100).all()
    assert (cluster.node_cpu_free >= 0).all()
    assert (cluster.node_mem_free >= 0).all()
    # Shares are whole percents in these traces, so cores x 10 is exactly the milli-GPU.
    allocated = 10 * int(cluster.used_cores.sum())
    capacity = 1000 * cluster.card_count
    assert result.milli_gpu_allocation_ratio == round(100 * allocated / capacity, 3)
    assert result.unallocated_gpus == round((capacity - allocated) / 1000, 3)


@pytest.mark.parametrize("policy", list(sim.POLICIES))
def test_replay_invariants(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    built = capture_cluster(monkeypatch)
    result = sim.replay(NODES, MIXED, policy, 42, trace="synth")
    (cluster,) = built
    assert (result.trace, result.policy, result.seed) == ("synth", policy, 42)
    check_cluster(cluster, result)
    # One point per whole percent of arrived demand up to the target, never falling.
    assert len(result.curve) == 130
    assert all(a <= b for a, b in zip(result.curve, result.curve[1:], strict=False))
    assert 0 < result.curve[0] <= result.curve[-1] <= 100
    assert result.curve[-1] == result.milli_gpu_allocation_ratio
    assert 0 < result.milli_gpu_allocation_ratio <= 100
    assert result.unallocated_gpus == pytest.approx(
        CAPACITY / 1000 * (1 - result.milli_gpu_allocation_ratio / 100), abs=1e-3
    )
    assert result.scheduled_pods + result.failed_pods == result.arrived_pods
    assert result.arrived_pods == arrived_count(MIXED, 42, 1.3)
    assert 0 <= result.failed_gpu_pods <= result.failed_pods
    assert result.failed_pods > 0  # 130 % of capacity cannot all fit
    assert result.wall_seconds >= 0


@pytest.mark.parametrize("policy", list(sim.POLICIES))
def test_replay_is_deterministic(policy: str) -> None:
    def run(seed: int) -> dict[str, Any]:
        result = sim.replay(NODES, MIXED, policy, seed).as_dict()
        del result["wall_seconds"]
        return result

    first = run(42)
    assert run(42) == first
    assert run(44) != first


@pytest.mark.parametrize("policy", list(sim.POLICIES))
def test_replay_matches_evaluating_every_node_every_time(policy: str) -> None:
    """The replay keeps scores per pod class; evaluating everything afresh must agree."""
    result = sim.replay(NODES, MIXED, policy, 43)
    cluster = sim.build_cluster(NODES)
    chosen = sim.POLICIES[policy]
    mix = None
    if chosen.gpu is GpuPolicy.FRAGMENTATION:
        mix = sim.workload_mix(MIXED, chosen.size_exponent)
    everyone = np.arange(cluster.node_count)
    arrived = allocated = failed = 0
    for index in sim.arrivals(MIXED, CAPACITY, 1.3, 43):
        pod = MIXED[index]
        demand = Demand(
            pod.request(), chosen.gpu, chosen.node, float(pod.cpu_milli), float(pod.memory_mib)
        )
        ev = evaluate(cluster, demand, everyone, mix)
        best = int(np.argmax(ev.score))
        if np.isfinite(ev.score[best]):
            cards = ev.chosen[0][best] if ev.chosen else np.empty(0, dtype=np.int64)
            sim._take(cluster, pod, cards, best)
            allocated += pod.gpu_demand
        else:
            failed += 1
        arrived += pod.gpu_demand
        if arrived >= 1.3 * CAPACITY:
            break
    assert result.milli_gpu_allocation_ratio == round(100 * allocated / CAPACITY, 3)
    assert result.failed_pods == failed


@pytest.mark.parametrize(("inflation", "points"), [(1.3, 130), (0.5, 50), (1.296, 129), (2, 200)])
def test_the_curve_has_a_point_per_whole_percent(inflation: float, points: int) -> None:
    for seed in (42, 43, 44):
        result = sim.replay(NODES, MIXED, "binpack", seed, inflation=inflation)
        assert len(result.curve) == points == math.floor(inflation * 100 + 1e-9)
        assert result.arrived_pods == arrived_count(MIXED, seed, inflation)
        assert result.curve[-1] <= result.milli_gpu_allocation_ratio


def test_below_capacity_everything_fits() -> None:
    """Half the capacity in 100-milli shares: no policy may fail a pod."""
    pods = [PodClass(100, 100, 1, 100, ())]
    for policy in sim.POLICIES:
        result = sim.replay(NODES, pods, policy, 42, inflation=0.5)
        assert result.failed_pods == 0
        assert result.milli_gpu_allocation_ratio == 50.0
        # Without failures the point at m % is the arrived demand: m % rounded up to a pod.
        expected = [100 * math.ceil(m * CAPACITY / 100 / 100) for m in range(1, 51)]
        assert result.curve == [round(100 * v / CAPACITY, 3) for v in expected]


@pytest.mark.parametrize(
    ("spec", "allowed"),
    [(("T4",), {"T4"}), (("V100M16", "V100M32"), {"V100M32"}), (("g2",), {"G2"})],
)
def test_a_gpu_spec_only_lands_on_matching_models(
    spec: tuple[str, ...], allowed: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    built = capture_cluster(monkeypatch)
    pods = [
        PodClass(1000, 1024, 1, 300, spec),
        PodClass(1000, 1024, 1, 1000, spec),
        PodClass(1000, 1024, 2, 1000, spec),
    ]
    share = sum(n.gpus for n in NODES if n.model in allowed) / sum(n.gpus for n in NODES)
    for policy in sim.POLICIES:
        result = sim.replay(NODES, pods, policy, 42)
        cluster = built[-1]
        check_cluster(cluster, result)
        models = np.asarray(cluster.models)[cluster.model_id]
        elsewhere = ~np.isin(models, sorted(allowed))
        assert (cluster.used_slots[elsewhere] == 0).all(), policy
        assert 0 < result.milli_gpu_allocation_ratio <= 100 * share, policy
        assert result.failed_pods > 0


def test_pods_bigger_than_every_node_all_fail() -> None:
    for too_big in (
        PodClass(200_000, 1024, 1, 500, ()),  # CPU
        PodClass(1000, 10**7, 1, 1000, ()),  # memory
        PodClass(1000, 1024, 16, 1000, ()),  # GPUs
    ):
        for policy in sim.POLICIES:
            result = sim.replay(NODES, [too_big], policy, 42)
            assert result.scheduled_pods == 0
            assert result.failed_pods == result.failed_gpu_pods == result.arrived_pods > 0
            assert result.milli_gpu_allocation_ratio == 0.0
            assert result.unallocated_gpus == CAPACITY / 1000
            assert set(result.curve) == {0.0}


def test_node_cpu_is_used_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pod takes 50 of a node's 64-96 cores: one pod a node, whatever its GPUs."""
    built = capture_cluster(monkeypatch)
    result = sim.replay(NODES, [PodClass(50_000, 1024, 1, 1000, ())], "binpack", 42)
    assert result.scheduled_pods == len(NODES)
    assert result.milli_gpu_allocation_ratio == round(100 * 1000 * len(NODES) / CAPACITY, 3)
    (cluster,) = built
    assert (cluster.node_cpu_free >= 0).all()
    assert (cluster.node_cpu_free < 50_000).all()


def test_cpu_only_pods_take_node_cpu_too() -> None:
    """Every other pod needs a whole 64-core node's CPU and no GPU: GPU pods then fail there."""
    hog = PodClass(64_000, 1024, 0, 0, ())
    gpu = PodClass(1000, 1024, 1, 1000, ())
    alone = sim.replay(NODES, [gpu], "binpack", 42, inflation=0.9)
    crowded = sim.replay(NODES, [hog, gpu], "binpack", 42, inflation=0.9)
    assert alone.failed_pods == 0
    assert crowded.milli_gpu_allocation_ratio < alone.milli_gpu_allocation_ratio


def test_fragmentation_beats_spread() -> None:
    """Pins that the fragmentation policy does something on a mixed trace."""
    fragmentation = sim.replay(NODES, MIXED, "fragmentation", 42)
    spread = sim.replay(NODES, MIXED, "spread", 42)
    assert fragmentation.milli_gpu_allocation_ratio >= spread.milli_gpu_allocation_ratio + 5


def test_replay_reports_progress() -> None:
    seen: list[float] = []
    pods = [PodClass(100, 100, 1, 100, ())]  # 1890 arrivals: a report every 256
    sim.replay(NODES, pods, "spread", 42, inflation=3.0, progress=seen.append)
    assert len(seen) == 1890 // 256 + 1
    assert seen == sorted(seen)
    assert seen[-1] == 1.0
    assert 0 < seen[0] < 1


def test_replay_rejects_an_unknown_policy_and_a_cluster_without_gpus() -> None:
    with pytest.raises(TraceError, match=r"unknown policy 'nope' \(choose from fragmentation"):
        sim.replay(NODES, MIXED, "nope", 42)
    with pytest.raises(TraceError, match="the cluster has no GPU"):
        sim.replay([TraceNode("n", 64000, 262144, 0, "T4")], MIXED, "binpack", 42)


def test_split_count_limits_pods_per_card() -> None:
    """100-milli pods: ten fit on a card by default, only two with a split count of 2."""
    pods = [PodClass(100, 100, 1, 100, ())]
    assert sim.replay(NODES, pods, "binpack", 42).milli_gpu_allocation_ratio == 100.0
    two = sim.replay(NODES, pods, "binpack", 42, split_count=2)
    assert two.milli_gpu_allocation_ratio == 20.0


# ---------------------------------------------------------------- seeds, many runs


@pytest.mark.parametrize(
    ("text", "seeds"),
    [
        ("42", [42]),
        ("42-51", list(range(42, 52))),
        ("42,45,50-51", [42, 45, 50, 51]),
        (" 7 , 9-10 ", [7, 9, 10]),
        ("3-3", [3]),
    ],
)
def test_parse_seeds(text: str, seeds: list[int]) -> None:
    assert sim.parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "abc", "42-", "-3", "51-42", "1-20000", "4,,5", "1.5"])
def test_parse_seeds_rejects(text: str) -> None:
    with pytest.raises(TraceError):
        sim.parse_seeds(text)


def test_replay_many_in_processes_matches_one_process(trace: tuple[Path, Path]) -> None:
    nodes, pods = trace
    policies, seeds = ["fragmentation", "spread"], [42, 43]
    done: list[float] = []
    serial = sim.replay_many(nodes, pods, policies, seeds, jobs=1, progress=done.append)
    parallel = sim.replay_many(nodes, pods, policies, seeds, jobs=2)

    def key(results: list[RunResult]) -> list[tuple[Any, ...]]:
        return [
            (r.trace, r.policy, r.seed, r.milli_gpu_allocation_ratio, r.failed_pods, r.curve)
            for r in results
        ]

    assert key(parallel) == key(serial)
    assert [(r.policy, r.seed) for r in serial] == [(p, s) for p in policies for s in seeds]
    assert {r.trace for r in serial} == {"synth"}
    assert done[-1] == pytest.approx(len(policies) * len(seeds))
    assert done == sorted(done)
    # The same runs as replaying the loaded trace directly.
    direct = sim.replay(NODES, MIXED, "spread", 43)
    assert serial[3].milli_gpu_allocation_ratio == direct.milli_gpu_allocation_ratio


def test_replay_many_checks_before_running(trace: tuple[Path, Path], tmp_path: Path) -> None:
    nodes, pods = trace
    with pytest.raises(TraceError, match="unknown policy 'nope'"):
        sim.replay_many(nodes, pods, ["binpack", "nope"], [42])
    with pytest.raises(TraceError, match="cannot read"):
        sim.replay_many(nodes, tmp_path / "missing.csv", ["binpack"], [42], jobs=2)


def test_summarise_means_over_seeds() -> None:
    def run(policy: str, seed: int, ratio: float, failed: int) -> RunResult:
        return RunResult("t", policy, seed, ratio, 64 * (1 - ratio / 100), failed, 0, 1, 1)

    summary = sim.summarise(
        [run("binpack", 1, 90.0, 10), run("binpack", 2, 95.0, 13), run("spread", 1, 80.0, 4)]
    )
    assert summary["binpack"]["seeds"] == 2
    assert summary["binpack"]["milli_gpu_allocation_ratio"] == 92.5
    assert summary["binpack"]["failed_pods"] == 11.5
    assert summary["binpack"]["unallocated_gpus"] == pytest.approx(4.8)
    assert summary["spread"]["seeds"] == 1
    assert summary["spread"]["milli_gpu_allocation_ratio"] == 80.0


# ---------------------------------------------------------------- derived workloads


def is_sharing(pod: PodClass) -> bool:
    return pod.num_gpu == 1 and 0 < pod.gpu_milli < 1000


def sharing_share(pods: Sequence[PodClass]) -> float:
    """Share of the GPU demand that sharing pods hold."""
    return sum(p.gpu_demand for p in pods if is_sharing(p)) / sum(p.gpu_demand for p in pods)


@pytest.mark.parametrize("share", [0.7, 0.8, 0.95])
def test_sharing_replaces_gpu_pods_that_do_not_share(share: float) -> None:
    before = list(MIXED)
    assert sharing_share(MIXED) < 0.7  # every share asked here is a raise
    derived = Derivation(sharing=share, seed=3).apply(MIXED)
    assert before == MIXED  # the source is left alone
    assert len(derived) == len(MIXED)
    assert sharing_share(derived) >= share
    trace_sharing = {p for p in MIXED if is_sharing(p)}
    changed = [(old, new) for old, new in zip(MIXED, derived, strict=True) if old != new]
    assert changed
    for old, new in changed:
        assert old.num_gpu > 0  # CPU-only pods stay
        assert not is_sharing(old)  # and so do sharing pods
        assert new in trace_sharing  # a copy of one of the trace's own sharing pods


def test_sharing_depends_on_the_seed() -> None:
    derived = Derivation(sharing=0.8, seed=3).apply(MIXED)
    assert Derivation(sharing=0.8, seed=3).apply(MIXED) == derived
    others = [Derivation(sharing=0.8, seed=s).apply(MIXED) for s in (4, 5, 6)]
    assert any(o != derived for o in others)


def test_sharing_already_met_changes_nothing_and_all_leaves_none_unshared() -> None:
    met = math.floor(100 * sharing_share(MIXED)) / 100
    for share in (0.0, met):
        assert Derivation(sharing=share).apply(MIXED) == MIXED
    everything = Derivation(sharing=1.0).apply(MIXED)
    assert sharing_share(everything) == 1.0
    assert all(is_sharing(p) for p in everything if p.num_gpu > 0)
    # the CPU-only pods are still there
    assert [p for p in everything if not p.num_gpu] == [p for p in MIXED if not p.num_gpu]


@pytest.mark.parametrize("scale", [2.5, 1.1, 0.3333, 100])
def test_cpu_scale_multiplies_every_pods_cpu_rounded_up(scale: float) -> None:
    pods = [*MIXED, PodClass(1, 1, 1, 100, ()), PodClass(0, 1, 0, 0, ())]
    derived = Derivation(cpu_scale=scale).apply(pods)
    # Exact decimal arithmetic: 1000 x 1.1 is 1100, not one milli more.
    expected = [replace(p, cpu_milli=math.ceil(p.cpu_milli * Fraction(str(scale)))) for p in pods]
    assert derived == expected
    assert derived != pods


def test_sharing_and_cpu_scale_combine() -> None:
    shared = Derivation(sharing=0.8, seed=5).apply(MIXED)
    both = Derivation(sharing=0.8, cpu_scale=2.0, seed=5).apply(MIXED)
    assert both == [replace(p, cpu_milli=2 * p.cpu_milli) for p in shared]


@pytest.mark.parametrize(
    ("sharing", "cpu_scale", "named"),
    [
        (-0.1, 1.0, "sharing share must be between 0 and 1, not -0.1"),
        (1.5, 1.0, "sharing share must be between 0 and 1, not 1.5"),
        (math.nan, 1.0, "sharing share must be between 0 and 1, not nan"),
        (None, 0.0, "CPU scale must be above 0 and at most 100, not 0.0"),
        (None, -1.0, "CPU scale must be above 0 and at most 100, not -1.0"),
        (None, math.inf, "CPU scale must be above 0 and at most 100, not inf"),
        (None, math.nan, "CPU scale must be above 0 and at most 100, not nan"),
        (0.5, 100.5, "CPU scale must be above 0 and at most 100, not 100.5"),
    ],
)
def test_bad_derivations_are_refused(sharing: float | None, cpu_scale: float, named: str) -> None:
    with pytest.raises(TraceError, match=re.escape(named)):
        Derivation(sharing, cpu_scale)


def test_raising_sharing_needs_sharing_pods(trace: tuple[Path, Path], tmp_path: Path) -> None:
    whole = [PodClass(8000, 16_384, 1, 1000, ()), PodClass(4000, 4096, 0, 0, ())]
    with pytest.raises(TraceError, match="no sharing pods"):
        Derivation(sharing=0.5).apply(whole)
    Derivation(cpu_scale=2).apply(whole)  # scaling CPU alone needs none
    pods = write_csv(tmp_path / "whole.csv", POD_HEADER, pod_rows(whole))
    with pytest.raises(TraceError, match="no sharing pods"):  # before any run
        sim.replay_many(trace[0], pods, ["binpack"], [42], derivation=Derivation(sharing=0.5))


@pytest.mark.parametrize(
    ("derivation", "suffix"),
    [
        (Derivation(), ""),
        (Derivation(sharing=0.6), "-share60"),
        (Derivation(sharing=1.0), "-share100"),
        (Derivation(cpu_scale=2.5), "-cpu2.5x"),
        (Derivation(cpu_scale=2), "-cpu2x"),
        (Derivation(sharing=0.6, cpu_scale=2.5), "-share60-cpu2.5x"),
    ],
)
def test_derived_trace_names(derivation: Derivation, suffix: str) -> None:
    assert derivation.suffix == suffix
    path = Path("traces/openb_pod_list_default.csv")
    assert sim.trace_name(path) == "default"
    assert sim.trace_name(path, derivation) == "default" + suffix


def test_different_derivations_are_named_apart() -> None:
    """A name stands for one workload: a share or scale the short form would round away
    (to the source's, or to another's) is written out in full."""
    named = {
        Derivation(cpu_scale=1.0000001).suffix: "-cpu1.0000001x",
        Derivation(cpu_scale=2.5000001).suffix: "-cpu2.5000001x",
        Derivation(sharing=0.004).suffix: "-share0.4",
        Derivation(sharing=0.805).suffix: "-share80.5",
        Derivation(sharing=0.07).suffix: "-share7",
    }
    assert list(named) == list(named.values())
    assert Derivation(cpu_scale=1.0000001).apply(MIXED) != MIXED  # not the source's workload


def test_replay_many_replays_the_derived_pods(trace: tuple[Path, Path]) -> None:
    derivation = Derivation(sharing=0.8, cpu_scale=2.0, seed=1)
    derived = derivation.apply(MIXED)
    assert derived != MIXED
    results = sim.replay_many(*trace, ["fragmentation", "binpack"], [42], derivation=derivation)
    assert [r.trace for r in results] == ["synth-share80-cpu2x"] * 2
    for r in results:
        direct = sim.replay(NODES, derived, r.policy, 42)
        assert (r.milli_gpu_allocation_ratio, r.failed_pods, r.curve) == (
            direct.milli_gpu_allocation_ratio,
            direct.failed_pods,
            direct.curve,
        )
        assert r.arrived_pods == direct.arrived_pods


# ---------------------------------------------------------------- the command


def gpuslice(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "gpuslice"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gpuslice_cli.main"]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": str(columns)},
        cwd=ROOT,
        check=False,
    )


def trace_args(trace: tuple[Path, Path]) -> list[str]:
    return ["--nodes", str(trace[0]), "--pods", str(trace[1])]


def test_sim_json(trace: tuple[Path, Path]) -> None:
    policies = ["--policy", "binpack", "--policy", "fragmentation"]
    result = gpuslice("sim", *trace_args(trace), *policies, "--seeds", "42-43", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["trace"] == "synth"
    assert report["inflation"] == 1.3
    runs = report["runs"]
    assert [(r["policy"], r["seed"]) for r in runs] == [
        ("binpack", 42),
        ("binpack", 43),
        ("fragmentation", 42),
        ("fragmentation", 43),
    ]
    for run in runs:
        for key in ("milli_gpu_allocation_ratio", "unallocated_gpus", "failed_pods"):
            assert isinstance(run[key], int | float)
        assert len(run["curve"]) == 130
        assert run["wall_seconds"] >= 0
        direct = sim.replay(NODES, MIXED, run["policy"], run["seed"])
        assert run["milli_gpu_allocation_ratio"] == direct.milli_gpu_allocation_ratio
    assert set(report["mean"]) == {"binpack", "fragmentation"}
    binpack = [r["milli_gpu_allocation_ratio"] for r in runs[:2]]
    assert report["mean"]["binpack"]["seeds"] == 2
    assert report["mean"]["binpack"]["milli_gpu_allocation_ratio"] == pytest.approx(
        sum(binpack) / 2, abs=1e-3
    )


def test_sim_defaults_and_options(trace: tuple[Path, Path]) -> None:
    args = [*trace_args(trace), "--inflation", "0.5", "--split-count", "2", "--jobs", "2"]
    result = gpuslice("sim", *args, "--seed", "7", "--json")
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    assert (run["policy"], run["seed"], len(run["curve"])) == ("fragmentation", 7, 50)
    direct = sim.replay(NODES, MIXED, "fragmentation", 7, inflation=0.5, split_count=2)
    assert run["milli_gpu_allocation_ratio"] == direct.milli_gpu_allocation_ratio


def test_sim_table(trace: tuple[Path, Path]) -> None:
    result = gpuslice("sim", *trace_args(trace), "--policy", "spread", "--policy", "hami-default")
    assert result.returncode == 0, result.stderr
    assert "spread" in result.stdout
    assert "hami-default" in result.stdout
    assert "allocation" in result.stdout
    assert "Traceback" not in result.stderr


def test_sim_plot(trace: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "out.png"
    args = [*trace_args(trace), "--policy", "binpack", "--policy", "spread", "--seeds", "1-2"]
    result = gpuslice("sim", *args, "--plot", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
    assert len(json.loads(result.stdout)["runs"]) == 4


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0]


def test_sim_bad_trace_file(trace: tuple[Path, Path], tmp_path: Path) -> None:
    # A long name in a folder with brackets: neither wrapped nor taken as markup.
    odd = tmp_path / "odd[dir]"
    odd.mkdir()
    name = "openb_pod_list_a_rather_long_trace_name_that_would_not_fit_on_one_line.csv"
    bad = write_csv(odd / name, POD_COLUMNS, [(1000, 1024, 1, 500), (1000, 1024, 1, 1500)])
    result = gpuslice("sim", "--nodes", str(trace[0]), "--pods", str(bad), columns=60)
    assert_one_line_error(result, f"{name}:3", "'gpu_milli' = 1500")

    # A missing file: the one line says where the openb traces come from.
    missing = odd / "missing.csv"
    result = gpuslice("sim", "--nodes", str(missing), "--pods", str(trace[1]), "--json")
    assert_one_line_error(result, "cannot read", str(missing), sim.TRACE_SOURCE, "make traces")

    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    result = gpuslice("sim", "--nodes", str(binary), "--pods", str(trace[1]), "--json")
    assert_one_line_error(result, str(binary))


def test_sim_help_says_where_the_traces_come_from() -> None:
    result = gpuslice("sim", "--help", columns=300)
    assert result.returncode == 0, result.stderr
    assert sim.TRACE_SOURCE in result.stdout
    assert "make traces" in result.stdout


def test_sim_unknown_policy_and_bad_seeds(trace: tuple[Path, Path]) -> None:
    result = gpuslice("sim", *trace_args(trace), "--policy", "nope[bold]", "--json")
    assert_one_line_error(result, "unknown policy 'nope[bold]'", "choose from", "fragmentation")
    result = gpuslice("sim", *trace_args(trace), "--seeds", "9-1", "--json")
    assert_one_line_error(result, "bad seed range: '9-1'")


def test_sim_derives_a_workload(trace: tuple[Path, Path]) -> None:
    args = [*trace_args(trace), "--sharing", "0.8", "--cpu-scale", "2", "--json"]
    result = gpuslice("sim", *args)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["trace"] == "synth-share80-cpu2x"
    (run,) = report["runs"]
    assert run["trace"] == "synth-share80-cpu2x"
    derived = Derivation(sharing=0.8, cpu_scale=2.0).apply(MIXED)
    direct = sim.replay(NODES, derived, "fragmentation", 42)
    assert run["milli_gpu_allocation_ratio"] == direct.milli_gpu_allocation_ratio
    assert run["failed_pods"] == direct.failed_pods


def test_sim_refuses_bad_derivations(trace: tuple[Path, Path], tmp_path: Path) -> None:
    # Out of range: Typer's own usage error (a box, not one line) names the option.
    result = gpuslice("sim", *trace_args(trace), "--sharing", "2", "--json")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "--sharing" in result.stderr
    assert "Traceback" not in result.stderr
    # A trace with no sharing pods to raise.
    whole = write_csv(
        tmp_path / "whole.csv", POD_HEADER, pod_rows([PodClass(8000, 16_384, 1, 1000, ())])
    )
    result = gpuslice("sim", "--nodes", str(trace[0]), "--pods", str(whole), "--sharing", "0.5")
    assert_one_line_error(result, "no sharing pods")
    # Derivations are for offline replays only.
    for derive in (["--sharing", "0.5"], ["--cpu-scale", "2"]):
        result = gpuslice("sim", *trace_args(trace), "--via", "http://127.0.0.1:1", *derive)
        assert_one_line_error(result, "--sharing and --cpu-scale derive offline replays only")


# ---------------------------------------------------------------- the packing bench

BENCH = ROOT / "bench" / "packing_bench.py"


def test_bench_prints_each_workload_with_the_margin_over_fgd(
    trace: tuple[Path, Path], tmp_path: Path
) -> None:
    nodes, pods = trace
    shutil.copy(pods, nodes.parent / "openb_pod_list_default.csv")
    workloads = ["default", "default-share80", "default-cpu2x"]
    result = subprocess.run(
        [sys.executable, str(BENCH), "--traces", str(nodes.parent), "--seeds", "42", "--jobs", "1"]
        + [a for w in workloads for a in ("--trace", w)]
        + ["--policy", "fragmentation", "--policy", "fgd", "--plot", str(tmp_path / "plots")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")]
    header, body = [c.strip() for c in rows[0]], rows[1:]
    assert header[:3] == ["workload", "fragmentation", "fgd"]
    assert "fragmentation - fgd" in header
    assert [r[0].strip() for r in body] == workloads
    # each row is the replay of its workload: derived ones from the trace's pods
    loaded = sim.load_pods(nodes.parent / "openb_pod_list_default.csv")
    derived = {
        "default": loaded,
        "default-share80": sim.Derivation(sharing=0.8).apply(loaded),
        "default-cpu2x": sim.Derivation(cpu_scale=2.0).apply(loaded),
    }
    for row in body:
        name = row[0].strip()
        ratio = {}
        for column, policy in ((1, "fragmentation"), (2, "fgd")):
            run = sim.replay(sim.load_nodes(nodes), derived[name], policy, 42)
            ratio[policy] = run.milli_gpu_allocation_ratio
            assert row[column].strip() == f"{ratio[policy]:.2f}"
        margin = row[header.index("fragmentation - fgd")].strip()
        assert margin == f"{ratio['fragmentation'] - ratio['fgd']:+.2f}"
        assert row[header.index("published FGD")].strip() == ("95.39" if name == "default" else "-")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(
        f"{w}.png" for w in workloads
    )
