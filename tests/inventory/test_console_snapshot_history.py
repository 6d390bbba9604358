"""A node's released placements (the ledger keeps them an hour) must not slow
every refresh of the console's snapshot: they are set aside once per node, not
looked through again for each of its cards. ``bench/console_bench.py`` showed
the refresher's CPU climbing with the cluster's history, with no page open."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from gpuslice_common.ledger import Ledger
from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
from gpuslice_common.occupancy import CardGrant, card_grants
from gpuslice_inventory.console import snapshot
from gpuslice_inventory.console.snapshot import SnapshotBuilder
from gpuslice_inventory.telemetry import TelemetryStore
from tests.conftest import make_inventory

CARDS = 8
RELEASED = 30


def pod(uid: str, card: int) -> Placement:
    grant = DeviceGrant(uuid=f"GPU-gpu-1-{card}", memory_mib=1024, cores=10)
    return Placement(
        pod=PodRef(uid=uid, namespace="team-a", name=uid),
        node="gpu-1",
        containers=(ContainerAssignment(name="main", devices=(grant,)),),
    )


async def test_released_placements_are_set_aside_once_per_node(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger.from_url(redis_url, prefix)
    try:
        await ledger.register_node(make_inventory("gpu-1", gpus=CARDS), rebuilt=True)
        for i in range(RELEASED):
            await ledger.reserve(pod(f"gone-{i}", i % CARDS))
            await ledger.release(f"gone-{i}", "ended")
        await ledger.reserve(pod("live-1", 3))
        examined: list[int] = []

        def counting(uuid: str, placements: Iterable[Placement]) -> list[CardGrant]:
            given = list(placements)
            examined.append(len(given))
            return card_grants(uuid, given)

        monkeypatch.setattr(snapshot, "card_grants", counting)
        builder = SnapshotBuilder(ledger, TelemetryStore(ledger.redis, prefix), prefix)
        assert await builder.refresh(full=True)
    finally:
        await ledger.close()

    assert len(builder.placements()) == RELEASED + 1  # the pod view still finds the released
    [node] = builder.document["nodes"]
    shown = {p["uid"]: card["index"] for card in node["cards"] for p in card["pods"]}
    assert shown == {"live-1": 3}
    assert builder.document["cluster"]["pods"] == 1
    # each card looked through the one live placement, none of the released ones
    assert examined[-CARDS:] == [1] * CARDS
