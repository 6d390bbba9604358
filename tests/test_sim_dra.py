"""The trace replay's DRA placements (``gpuslice sim --placement``) on small synthetic
clusters: kube-scheduler's allocator takes cards first fit in device order, the
extender's node is the best-scored one where the claim fits, and kube-scheduler
alone scores nodes by least-allocated CPU and memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gpuslice_cli.main import app
from gpuslice_common.models import GpuPolicy
from gpuslice_scheduler import drafit, sim
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.engine import Demand, Evaluator
from gpuslice_scheduler.sim import DraPlacement, PodClass, TraceError, TraceNode

MIB = 16384  # P100 memory in the sim


def pod(milli: int, gpus: int = 1, cpu: int = 1000, memory: int = 1024) -> PodClass:
    return PodClass(cpu, memory, gpus, milli if gpus else 0, ())


def cluster_of(nodes: list[TraceNode]) -> Cluster:
    return sim.build_cluster(nodes, sim.NO_SLOT_LIMIT)


def use(cluster: Cluster, card: int, percent: int) -> None:
    """Put ``percent`` of a card's memory and cores in use."""
    cluster.used_mem[card] += cluster.cap_mem[card] * percent // 100
    cluster.used_cores[card] += percent
    cluster.used_slots[card] += 1
    cluster.touch()


def gpuslice_place(
    cluster: Cluster, pods: list[PodClass], evaluator: Evaluator, p: PodClass
) -> int:
    demand = Demand.of(p.request(), GpuPolicy.BINPACK, float(p.cpu_milli), float(p.memory_mib))
    ev = evaluator.evaluate(demand)
    best = int(np.argmax(ev.score))
    if not np.isfinite(ev.score[best]):
        return -1
    card = int(ev.chosen[0][best][0])
    sim._take(cluster, p, ev.chosen[0][best], best)
    return card


def dra_place(cluster: Cluster, model: DraPlacement, classes: list[PodClass], p: PodClass) -> int:
    node, cards = model.place(classes.index(p), None)
    if node < 0:
        return -1
    sim._take(cluster, p, cards, node)
    return int(cards[0])


ONE_NODE = [TraceNode("n0", 64_000, 262_144, 3, "P100")]


def test_cards_are_first_fit_in_device_order_where_the_engine_packs() -> None:
    # card 0 has 30 % free, card 1 is empty, card 2 has 50 % free
    classes = [pod(400), pod(300)]
    dra = cluster_of(ONE_NODE)
    engine = cluster_of(ONE_NODE)
    for c in (dra, engine):
        use(c, 0, 70)
        use(c, 2, 50)
    model = DraPlacement(dra, ONE_NODE, classes, seed=1)
    # 40 %: card 0 is too full; first fit takes card 1, the engine the fuller card 2
    assert dra_place(dra, model, classes, classes[0]) == 1
    evaluator = Evaluator(engine, None)
    assert gpuslice_place(engine, classes, evaluator, classes[0]) == 2
    # 30 %: card 0 is the first with room
    assert dra_place(dra, model, classes, classes[1]) == 0


def test_first_fit_is_worse_where_an_exact_fit_was_there_and_equal_for_whole_cards() -> None:
    nodes = [TraceNode("n0", 64_000, 262_144, 2, "P100")]
    classes = [pod(400), pod(700)]
    dra, engine = cluster_of(nodes), cluster_of(nodes)
    for c in (dra, engine):
        use(c, 0, 30)  # 70 % free
        use(c, 1, 60)  # 40 % free
    model = DraPlacement(dra, nodes, classes, seed=1)
    evaluator = Evaluator(engine, None)
    dra_placed = [dra_place(dra, model, classes, p) for p in classes]
    engine_placed = [gpuslice_place(engine, classes, evaluator, p) for p in classes]
    assert dra_placed == [0, -1]  # 40 % into the 70 % gap; 70 % then fits nowhere
    assert engine_placed == [1, 0]  # the exact fit first, then the big gap
    # whole cards: any choice is as good as another, both place the same
    whole = [pod(1000), pod(1000, gpus=2)]
    dra, engine = cluster_of(ONE_NODE), cluster_of(ONE_NODE)
    model = DraPlacement(dra, ONE_NODE, whole, seed=1)
    evaluator = Evaluator(engine, None)
    assert [dra_place(dra, model, whole, p) >= 0 for p in whole + whole] == [
        True,
        True,
        False,
        False,
    ]
    assert [gpuslice_place(engine, whole, evaluator, p) >= 0 for p in whole + whole] == [
        True,
        True,
        False,
        False,
    ]


def test_the_extender_node_is_the_best_scored_where_the_claim_fits() -> None:
    nodes = [TraceNode(f"n{i}", 64_000, 262_144, 2, "P100") for i in range(4)]
    classes = [pod(600)]
    cluster = cluster_of(nodes)
    use(cluster, 2, 50)  # node 1: card 2 half full, card 3 empty
    use(cluster, 4, 80)  # node 2: both cards too full for 60 %
    use(cluster, 5, 80)
    model = DraPlacement(cluster, nodes, classes, seed=1)
    allowed, mem, share = model._claim(0)
    fits = drafit.card_fit(cluster, allowed, mem, share, False)
    feasible = drafit.fitting_nodes(cluster, fits, 1, 1000, 1024)
    assert feasible.tolist() == [True, True, False, True]
    rng = np.random.default_rng(3)
    for _ in range(20):
        score = rng.normal(size=4)
        node, cards = model.place(0, score)
        best = max((s, n) for n, s in enumerate(score.tolist()) if feasible[n])[1]
        assert node == best
        # the cards are first fit there, whatever the engine would have chosen
        start = int(cluster.node_start[node])
        assert cards.tolist() == [start + int(np.flatnonzero(fits[start : start + 2])[0])]
    # the best score on a node where the claim does not fit is passed over
    node, _ = model.place(0, np.asarray([0.0, 1.0, 5.0, -1.0]))
    assert node == 1
    assert model.place(0, np.full(4, -np.inf))[0] == -1


def test_the_extender_follows_the_engine_through_a_replay() -> None:
    nodes = [TraceNode(f"n{i}", 64_000, 262_144, 2, "P100") for i in range(3)]
    pods = [pod(300), pod(600), pod(1000), pod(0, gpus=0)]
    cluster = cluster_of(nodes)
    mix = sim.workload_mix(pods)
    evaluator = Evaluator(cluster, mix, kinds=8)
    model = DraPlacement(cluster, nodes, pods, seed=1)
    for p in pods * 2:
        demand = Demand(p.request(), GpuPolicy.FRAGMENTATION, None, p.cpu_milli, p.memory_mib)
        score = evaluator.evaluate(demand).score
        node, cards = model.place(pods.index(p), score)
        finite = np.isfinite(score)
        assert node == (int(np.argmax(score)) if finite.any() else -1)
        if node >= 0:
            sim._take(cluster, p, cards, node)


def test_kube_scheduler_alone_scores_least_allocated_and_balanced() -> None:
    nodes = [
        TraceNode("n0", 64_000, 262_144, 2, "P100"),
        TraceNode("n1", 64_000, 262_144, 2, "P100"),
    ]
    cluster = cluster_of(nodes)
    cpu_cap = np.asarray([64_000.0, 64_000.0])
    mem_cap = np.asarray([262_144.0, 262_144.0])
    scores = drafit.kube_scores(cluster, cpu_cap, mem_cap, 8_000, 32_768)
    # (56000*100)//64000 = 87, (229376*100)//262144 = 87: mean 87; equal shares: 100
    assert scores.tolist() == [187, 187]
    cluster.node_cpu_free[0] -= 32_000  # node 0 half its CPU used
    scores = drafit.kube_scores(cluster, cpu_cap, mem_cap, 8_000, 32_768)
    # cpu (24000*100)//64000 = 37, memory 87: 62; shares 0.625 and 0.125: 100 - 25 = 75
    assert scores.tolist() == [137, 187]
    # a GPU pod then goes to the emptier node 1, though node 0's cards are as free
    classes = [pod(500, cpu=8_000, memory=32_768)]
    model = DraPlacement(cluster, nodes, classes, seed=1)
    node, cards = model.place(0, None)
    assert (node, cards.tolist()) == (1, [2])
    # equal best scores: either node, as kube-scheduler picks among ties at random
    cluster.node_cpu_free[0] += 32_000
    picks = {model.place(0, None)[0] for _ in range(40)}
    assert picks == {0, 1}


def test_replay_runs_each_placement_and_labels_them() -> None:
    nodes = [TraceNode(f"n{i}", 64_000, 262_144, 4, "P100") for i in range(4)]
    pods = [pod(250), pod(500), pod(750), pod(1000), pod(1000, gpus=2), pod(0, gpus=0)]
    runs = {
        where: sim.replay(nodes, pods, "fragmentation", 5, placement=where)
        for where in sim.PLACEMENTS
    }
    assert {w: r.label for w, r in runs.items()} == {
        "gpuslice": "fragmentation",
        "dra-first-fit": "dra-first-fit",
        "dra+extender": "dra+extender/fragmentation",
    }
    for run in runs.values():
        assert run.arrived_pods == runs["gpuslice"].arrived_pods  # the same arrivals
        assert 0 < run.milli_gpu_allocation_ratio <= 100
    with pytest.raises(TraceError, match="unknown placement"):
        sim.replay(nodes, pods, "fragmentation", 5, placement="dra")


def test_sim_cli_takes_placements(tmp_path: Path) -> None:
    node_csv = tmp_path / "nodes.csv"
    node_csv.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        + "".join(f"n{i},64000,262144,4,P100\n" for i in range(3))
    )
    pod_csv = tmp_path / "openb_pod_list_small.csv"
    pod_csv.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        + "".join(f"p{i},1000,1024,1,{m}\n" for i, m in enumerate((300, 500, 700, 1000)))
    )
    args = ["sim", "--nodes", str(node_csv), "--pods", str(pod_csv), "--json"]
    args += ["--placement", "gpuslice", "--placement", "dra-first-fit"]
    args += ["--placement", "dra+extender", "--policy", "fragmentation", "--policy", "binpack"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["mean"]) == {
        "fragmentation",
        "binpack",
        "dra-first-fit",
        "dra+extender/fragmentation",
        "dra+extender/binpack",
    }
    bad = CliRunner().invoke(app, [*args[:5], "--placement", "nowhere"])
    assert bad.exit_code == 2
    assert "unknown placement" in bad.output
    live = CliRunner().invoke(app, [*args[:5], "--placement", "dra-first-fit", "--via", "http://x"])
    assert live.exit_code == 2
    assert "--placement is for offline replays only" in live.output
