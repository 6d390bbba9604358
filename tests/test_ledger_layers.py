"""The node agent's per-card enforcement-layer report in the ledger (real redis-server)."""

from __future__ import annotations

import pytest

from gpuslice_common.ledger import BadRecord, Ledger
from gpuslice_common.models import CardLayers, LayerState, NodeInventory
from tests.conftest import make_inventory

ON, OFF = LayerState.ENFORCING, LayerState.MISSING


def with_layers(inventory: NodeInventory, layers: dict[str, CardLayers]) -> NodeInventory:
    return NodeInventory.model_validate({**inventory.model_dump(), "layers": layers})


async def test_the_layers_a_node_reports_are_read_back_per_card(ledger: Ledger) -> None:
    inventory = make_inventory("n1", gpus=2)
    first = CardLayers(driver=ON, driver_note="dmem", agent_memory=ON, agent_compute=OFF)
    second = CardLayers(driver_note="MIG mode: the driver limits whole cards only")
    await ledger.register_node(with_layers(inventory, {"GPU-n1-0": first, "GPU-n1-1": second}))
    gpus = await ledger.node_gpus("n1")
    assert [g.layers for g in gpus] == [first, second]
    assert gpus[0].layers is not None
    assert gpus[0].layers.enforcing() == ("driver", "agent-memory", "interposer")
    # an agent that reports no layers (an older one) leaves none: not a stale report
    await ledger.register_node(inventory)
    assert [g.layers for g in await ledger.node_gpus("n1")] == [None, None]


def test_a_report_for_a_card_the_node_does_not_list_is_refused() -> None:
    with pytest.raises(ValueError, match="does not list"):
        with_layers(make_inventory("n1", gpus=1), {"GPU-n1-7": CardLayers()})


@pytest.mark.parametrize(
    "stored",
    ['{"driver":"sometimes"}', "not json", '{"driver_note":"a\\nb"}', "x" * 2000],
)
async def test_a_planted_layer_report_spoils_only_its_node(ledger: Ledger, stored: str) -> None:
    await ledger.register_node(make_inventory("n1", gpus=1))
    await ledger.register_node(make_inventory("n2", gpus=1))
    await ledger.redis.hset(ledger.node_keys("n1").gpus, "GPU-n1-0|layers", stored)
    read = await ledger.read_gpus(["n1", "n2"])
    assert isinstance(read["n1"], BadRecord)
    assert "GPU-n1-0 layers" in read["n1"].problem
    assert isinstance(read["n2"], list)
