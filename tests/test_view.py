"""The scheduler's copy of the ledger (ClusterView) against a real Redis: what a
reservation made here counts, whatever order the ledger's re-reads land in."""

from __future__ import annotations

from typing import Any

from gpuslice_common.ledger import Ledger, NodeCards
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

    async def once(nodes: Any) -> Any:
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
