"""The scheduler's copy of the ledger (ClusterView) against a real Redis: what a
reservation made here counts, whatever order the ledger's re-reads land in; and
each node's free CPU and memory, from NodeResources."""

from __future__ import annotations

import math
from typing import Any

from gpuslice_common.kube import LocalKubeApi
from gpuslice_common.ledger import Ledger, NodeCards
from gpuslice_common.models import GpuDevice, NodeInventory
from gpuslice_scheduler.cluster import CardFacts
from gpuslice_scheduler.engine import Demand, Evaluator
from gpuslice_scheduler.resources import NodeResources
from gpuslice_scheduler.view import ClusterView
from tests.conftest import make_inventory
from tests.test_ledger import placement

NODE = "node-a"


async def used_mem(view: ClusterView) -> list[int]:
    cluster = view.cluster
    i = cluster.node_index[NODE]
    lo, hi = int(cluster.node_start[i]), int(cluster.node_start[i + 1])
    return [int(m) for m in cluster.used_mem[lo:hi]]


async def ledger_mem(ledger: Ledger) -> list[int]:
    got = (await ledger.read_nodes([NODE]))[NODE]
    assert isinstance(got, NodeCards)
    return [card.used_mem for card in got.cards]


async def synced_view(ledger: Ledger) -> ClusterView:
    await ledger.register_node(make_inventory(NODE, gpus=2, memory_mib=16384), rebuilt=True)
    view = ClusterView(ledger)
    await view.sync()
    return view


def serve_once(ledger: Ledger, stale: dict[str, Any]) -> None:
    """The next read_nodes answers ``stale``: a read sent before a reservation
    whose answer arrives after it."""
    read = ledger.read_nodes

    async def once(nodes: Any, vendor: Any = None) -> Any:
        ledger.read_nodes = read  # type: ignore[method-assign]
        return stale

    ledger.read_nodes = once  # type: ignore[method-assign]


async def test_a_read_from_before_a_reservation_does_not_wipe_out_its_count(
    ledger: Ledger,
) -> None:
    view = await synced_view(ledger)
    before = await ledger.read_nodes([NODE])
    made = await ledger.reserve_new(placement("p1", NODE, [[(0, 8000, 50)]]))
    assert made.created
    assert made.rev > 0
    view.apply(made.placement, made.rev)
    assert await used_mem(view) == [8000, 0]
    serve_once(ledger, before)  # landed late
    await view.refresh([NODE])
    assert await used_mem(view) == [8000, 0]
    # a read that has it settles it: counted once, and the next reads agree
    await view.refresh([NODE])
    assert await used_mem(view) == await ledger_mem(ledger) == [8000, 0]
    made = await ledger.reserve_new(placement("p2", NODE, [[(0, 4000, 20)]]))
    view.apply(made.placement, made.rev)
    await view.refresh([NODE])
    await view.sync()
    assert await used_mem(view) == await ledger_mem(ledger) == [12000, 0]


async def test_a_read_that_has_the_reservation_already_is_not_counted_twice(
    ledger: Ledger,
) -> None:
    view = await synced_view(ledger)
    made = await ledger.reserve_new(placement("p1", NODE, [[(1, 8000, 50)]]))
    await view.refresh([NODE])  # the change notice's re-read came first
    view.apply(made.placement, made.rev)
    assert await used_mem(view) == await ledger_mem(ledger) == [0, 8000]


async def test_a_whole_rebuild_of_the_copy_keeps_counting_what_no_read_showed(
    ledger: Ledger,
) -> None:
    view = await synced_view(ledger)
    before = await ledger.read_nodes([NODE])
    made = await ledger.reserve_new(placement("p1", NODE, [[(0, 8000, 50)]]))
    view.apply(made.placement, made.rev)
    # a new node changes the copy's shape: it is built again from the reads
    await ledger.register_node(make_inventory("node-b", gpus=1, memory_mib=16384), rebuilt=True)
    serve_once(ledger, {**before, **(await ledger.read_nodes(["node-b"]))})
    await view.refresh([NODE, "node-b"])
    assert "node-b" in view.cluster.node_index
    assert await used_mem(view) == [8000, 0]
    await view.sync()
    assert await used_mem(view) == await ledger_mem(ledger) == [8000, 0]


async def test_a_re_read_that_finds_the_node_unchanged_keeps_its_evaluations(
    ledger: Ledger,
) -> None:
    view = await synced_view(ledger)
    made = await ledger.reserve_new(placement("p1", NODE, [[(0, 8000, 50)]]))
    view.apply(made.placement, made.rev)
    await view.refresh([NODE])
    version = view.cluster.version
    await ledger.mark_bound("p1", NODE)  # a new revision, the same usage
    await view.refresh([NODE])
    assert view.cluster.version == version
    await ledger.release("p1", "done")
    await view.refresh([NODE])
    assert view.cluster.version > version
    assert await used_mem(view) == [0, 0]


def k8s_node(name: str, cpu: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"allocatable": {"cpu": cpu, "memory": "8Gi"}}}


def bound_pod(name: str, node: str, cpu: str) -> dict[str, Any]:
    container = {"name": "c", "resources": {"requests": {"cpu": cpu}}}
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": name},
        "spec": {"nodeName": node, "containers": [container]},
        "status": {"phase": "Running"},
    }


async def test_free_cpu_and_memory_come_from_node_resources_when_the_copy_is_built(
    ledger: Ledger,
) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1, memory_mib=16384), rebuilt=True)
    await ledger.register_node(make_inventory("node-b", gpus=1, memory_mib=16384), rebuilt=True)
    resources = NodeResources(LocalKubeApi())
    resources.replace_nodes([k8s_node(NODE, "8")])
    resources.replace_pods([bound_pod("p", NODE, "3")])
    view = ClusterView(ledger, resources=resources)
    await view.sync()
    a, b = view.cluster.node_index[NODE], view.cluster.node_index["node-b"]
    assert view.cluster.node_cpu_free[a] == 5000.0
    assert view.cluster.node_mem_free[a] == 8192.0
    assert math.isinf(view.cluster.node_cpu_free[b])  # no Node object: not tracked


async def test_a_change_reported_by_node_resources_redoes_that_nodes_evaluations(
    ledger: Ledger,
) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1, memory_mib=16384), rebuilt=True)
    await ledger.register_node(make_inventory("node-b", gpus=1, memory_mib=16384), rebuilt=True)
    resources = NodeResources(LocalKubeApi())
    resources.replace_nodes([k8s_node(NODE, "8"), k8s_node("node-b", "8")])
    view = ClusterView(ledger, resources=resources)
    await view.sync()
    a, b = view.cluster.node_index[NODE], view.cluster.node_index["node-b"]
    evaluator = Evaluator(view.cluster, None)
    wants = Demand(None, cpu=6000.0)
    assert evaluator.evaluate(wants).feasible.tolist() == [True, True]
    resources.apply_pod("ADDED", bound_pod("p", NODE, "3"))
    changed_b = int(view.cluster.changed[b])
    view.follow_resources()
    assert view.cluster.node_cpu_free[a] == 5000.0
    assert int(view.cluster.changed[b]) == changed_b  # only the node that changed
    feasible = evaluator.evaluate(wants).feasible
    assert (bool(feasible[a]), bool(feasible[b])) == (False, True)
    version = view.cluster.version
    view.follow_resources()  # nothing new: nothing redone
    assert view.cluster.version == version


async def test_a_whole_rebuild_of_the_copy_keeps_free_cpu(ledger: Ledger) -> None:
    await ledger.register_node(make_inventory(NODE, gpus=1, memory_mib=16384), rebuilt=True)
    resources = NodeResources(LocalKubeApi())
    resources.replace_nodes([k8s_node(NODE, "8"), k8s_node("node-b", "4")])
    view = ClusterView(ledger, resources=resources)
    await view.sync()
    resources.apply_pod("ADDED", bound_pod("p", NODE, "1"))
    # a new node: the copy is built again, with new arrays
    await ledger.register_node(make_inventory("node-b", gpus=1, memory_mib=16384), rebuilt=True)
    await view.sync()
    cluster = view.cluster
    free = {name: cluster.node_cpu_free[i] for name, i in cluster.node_index.items()}
    assert free == {NODE: 7000.0, "node-b": 4000.0}


async def test_each_card_s_index_and_model_follow_the_ledger(ledger: Ledger) -> None:
    """A bind reads a granted card's index and model in the copy (vendorannotations)."""
    view = await synced_view(ledger)
    assert view.card_facts(NODE) == {
        f"GPU-{NODE}-0": CardFacts(0, "NVIDIA A100-SXM4-80GB"),
        f"GPU-{NODE}-1": CardFacts(1, "NVIDIA A100-SXM4-80GB"),
    }
    # another vendor's cards on the node, whose indexes are not their places
    xpus = tuple(
        GpuDevice(uuid=f"XPU-{i}", index=i, model="P800", memory_mib=1024, vendor="xpu")
        for i in (6, 2)
    )
    await ledger.register_node(NodeInventory(node=NODE, devices=xpus, vendor="xpu"))
    await view.sync()
    facts = view.card_facts(NODE)
    assert (facts["XPU-6"], facts["XPU-2"]) == (CardFacts(6, "P800"), CardFacts(2, "P800"))
    assert len(facts) == 4
    assert view.card_facts("elsewhere") == {}
