"""Node fragmentation, class weights and the learned workload mix."""

from __future__ import annotations

import numpy as np
import pytest

from gpuslice_common.models import DeviceSelector
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import (
    STARVED_WEIGHT,
    MixLearner,
    WorkloadClass,
    WorkloadMix,
    default_mix,
    node_fragmentation,
    spare_ratios,
)
from tests.test_engine import MEM, busy, gpu

SHARE_60 = CardDemand(count=1, mem_mib=-1, mem_percent=60, cores=60, exclusive=False)
WHOLE = CardDemand(count=1, mem_mib=-1, mem_percent=100, cores=100, exclusive=True)
TWO_WHOLE = CardDemand(count=2, mem_mib=-1, mem_percent=100, cores=100, exclusive=True)
HALF = CardDemand(count=1, mem_mib=-1, mem_percent=50, cores=50, exclusive=False)
QUARTER = CardDemand(count=1, mem_mib=-1, mem_percent=25, cores=25, exclusive=False)
# 500 milli-GPU for 4000 milli-CPU and 2000 MiB: 8 milli-CPU and 4 MiB per milli-GPU
FED_HALF = WorkloadClass(1, HALF, cpu=4000, memory=2000)


def fragmentation(cluster: Cluster, mix: WorkloadMix) -> list[float]:
    """Every node's fragmentation, in node order."""
    frag, _ = node_fragmentation(mix, cluster, np.arange(cluster.node_count, dtype=np.int64))
    return [float(f) for f in frag]


def free_share(cluster: Cluster, mix: WorkloadMix) -> list[float]:
    """Every node's free share (milli-GPU), in node order."""
    _, total = node_fragmentation(mix, cluster, np.arange(cluster.node_count, dtype=np.int64))
    return [float(t) for t in total]


def starved(cluster: Cluster, classes: list[WorkloadClass]) -> list[float]:
    """Every node's starved share: its fragmentation with starvation priced, less FGD's
    part alone (the same mix unpriced), over the weight a starved milli-GPU has there.
    Fresh mixes, so priced against ``cluster`` as it is now."""
    on = fragmentation(cluster, WorkloadMix.of(classes))
    off = fragmentation(cluster, WorkloadMix.of(classes, starvation=False))
    return [(a - b) / STARVED_WEIGHT for a, b in zip(on, off, strict=True)]


def two_free_cards(cpu: float, mem: float = np.inf) -> Cluster:
    """n0: two free cards (2000 milli free) with ``cpu`` and ``mem`` free; n1: no card
    and CPU and memory to spare, so that the cluster's spare covers the GPU pods'."""
    return Cluster.build(
        [("n0", [gpu("n0", 0), gpu("n0", 1)]), ("n1", [])],
        node_cpu=[cpu, 10**7],
        node_mem=[mem, 10**7],
    )


def test_free_share_a_class_cannot_use_is_a_fragment() -> None:
    # n0: one half-used card (500 milli free) and one empty card.
    c = Cluster.build([("n0", [busy("n0", 0, 50), gpu("n0", 1)])])
    # A 60 % pod can use the empty card only: the half card's 500 are fragments.
    assert fragmentation(c, WorkloadMix.of([WorkloadClass(1, SHARE_60)])) == [500.0]
    # A whole-card pod cannot use the half card either.
    assert fragmentation(c, WorkloadMix.of([WorkloadClass(1, WHOLE)])) == [500.0]
    # A two-card pod cannot be hosted at all: every free share is a fragment.
    assert fragmentation(c, WorkloadMix.of([WorkloadClass(1, TWO_WHOLE)])) == [1500.0]


def test_fragmentation_is_the_weighted_mean_over_classes() -> None:
    c = Cluster.build([("n0", [busy("n0", 0, 50), gpu("n0", 1)])])
    mix = WorkloadMix.of([WorkloadClass(3, SHARE_60), WorkloadClass(1, TWO_WHOLE)], 0.0)
    assert fragmentation(c, mix) == [pytest.approx(0.75 * 500 + 0.25 * 1500)]


def test_cpu_short_nodes_count_everything_free_and_cpu_only_pods_nothing() -> None:
    c = Cluster.build([("n0", [gpu("n0", 0)]), ("n1", [gpu("n1", 0)])])
    c.node_cpu_free[:] = [1000, 8000]
    c.node_mem_free[:] = [np.inf, np.inf]
    cpu_pod = WorkloadMix.of([WorkloadClass(1, None, cpu=4000)])
    assert fragmentation(c, cpu_pod) == [1000.0, 0.0]


def test_type_lists_make_other_models_fragments() -> None:
    c = Cluster.build([("n0", [gpu("n0", 0, model="Tesla T4")])])
    wants_a100 = WorkloadClass(1, WHOLE, DeviceSelector(include_types=("A100",)))
    assert fragmentation(c, WorkloadMix.of([wants_a100])) == [1000.0]


def test_unschedulable_and_exclusive_cards_have_no_free_share() -> None:
    c = Cluster.build(
        [
            (
                "n0",
                [
                    gpu("n0", 0, healthy=False),
                    gpu("n0", 1, cordoned=True),
                    busy("n0", 2, 10, owner="p"),
                ],
            )
        ]
    )
    mix = WorkloadMix.of([WorkloadClass(1, SHARE_60)])
    assert fragmentation(c, mix) == [0.0]
    assert free_share(c, mix) == [0.0]


@pytest.mark.parametrize(
    ("card", "share"),
    [
        (None, 100),
        (CardDemand(1, -1, 5, 5, False), 100),  # below a tenth of a card counts as a tenth
        (SHARE_60, 600),
        (WHOLE, 1000),
        (TWO_WHOLE, 1000),  # several whole cards count as one
        (CardDemand(1, -1, 30, 0, False), 300),  # memory-only requests weigh by memory
    ],
)
def test_class_weight_is_frequency_times_sqrt_share(card: CardDemand | None, share: int) -> None:
    cls = WorkloadClass(3, card)
    assert cls.weight(0.5) == pytest.approx(3 * share**0.5)
    assert cls.weight(0.0) == 3


def test_an_empty_mix_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one class"):
        WorkloadMix.of([])
    with pytest.raises(ValueError, match="positive total weight"):
        WorkloadMix.of([WorkloadClass(0, WHOLE)])


def test_node_fragmentation_follows_the_cluster_as_it_changes() -> None:
    c = Cluster.build([("n0", [gpu("n0", 0), gpu("n0", 1)])])
    mix = default_mix()
    assert free_share(c, mix) == [2000.0]
    before = fragmentation(c, mix)
    c.take(
        np.asarray([0]),
        np.asarray([5000]),
        np.asarray([50]),
        np.asarray([1]),
        np.asarray([False]),
        node=0,
    )
    assert free_share(c, mix) == [pytest.approx(1500.0)]
    assert fragmentation(c, mix) != before  # the half card is a fragment for whole-card pods


def test_node_fragmentation_answers_for_the_nodes_asked_in_their_order() -> None:
    c = Cluster.build(
        [("n0", [busy("n0", 0, 50), gpu("n0", 1)]), ("n1", []), ("n2", [gpu("n2", 0)])]
    )
    mix = WorkloadMix.of([WorkloadClass(1, WHOLE)])
    frag, total = node_fragmentation(mix, c, np.asarray([2, 1, 0], dtype=np.int64))
    assert [float(f) for f in frag] == [0.0, 0.0, 500.0]
    assert [float(t) for t in total] == [1000.0, 0.0, 1500.0]
    frag, total = node_fragmentation(mix, c, np.zeros(0, dtype=np.int64))
    assert len(frag) == len(total) == 0


def test_mix_learner_counts_each_pod_once_and_rebuilds_in_batches() -> None:
    learner = MixLearner(rebuild_every=3, max_classes=2)
    prior = learner.mix
    assert prior is learner.prior
    selector = DeviceSelector()
    learner.observe("a", SHARE_60, selector)
    learner.observe("a", SHARE_60, selector)  # the same pod filtered again
    learner.observe("b", SHARE_60, selector)
    assert learner.mix is prior  # two new pods: not rebuilt yet
    learner.observe("c", TWO_WHOLE, selector)
    learned = learner.mix
    assert learned is not prior
    cards = [c.card for c in learned.classes]
    assert SHARE_60 in cards
    assert TWO_WHOLE in cards
    counted = {c.card: c.frequency for c in learned.classes[len(prior.classes) :]}
    assert counted == {SHARE_60: 2.0, TWO_WHOLE: 1.0}
    # The prior stays in, worth prior_weight pods in all.
    assert sum(c.frequency for c in learned.classes[: len(prior.classes)]) == pytest.approx(50)


def test_mix_learner_keeps_the_most_common_classes() -> None:
    learner = MixLearner(rebuild_every=1, max_classes=1)
    selector = DeviceSelector()
    for i in range(3):
        learner.observe(f"w{i}", WHOLE, selector)
    learner.observe("s", SHARE_60, selector)
    learned = [c.card for c in learner.mix.classes[len(learner.prior.classes) :]]
    assert learned == [WHOLE]


def test_a_learned_mix_close_to_the_current_one_is_not_put_in_place() -> None:
    selector = DeviceSelector()
    steady = MixLearner(rebuild_every=1, shift=0.5)
    steady.observe("a", SHARE_60, selector)
    assert steady.mix is steady.prior  # one pod against a prior of 50 moves little
    eager = MixLearner(rebuild_every=1, shift=0.0)
    eager.observe("a", SHARE_60, selector)
    assert eager.mix is not eager.prior


def test_mix_learner_learns_cpu_only_pods_and_cpu_and_memory_as_the_replay_does() -> None:
    from gpuslice_scheduler.sim import PodClass, workload_mix

    learner = MixLearner(rebuild_every=1, max_classes=8, prior_weight=1e-9)
    trace = [
        PodClass(6000, 8192, 0, 0, ()),
        PodClass(6000, 8192, 0, 0, ()),
        PodClass(2000, 4096, 1, 1000, ()),
        PodClass(4000, 4096, 1, 1000, ()),  # the same card, another CPU: another class
    ]
    for i, pod in enumerate(trace):
        request = pod.request()
        card = CardDemand.of(request.containers[0]) if request else None
        selector = request.selector if request else DeviceSelector()
        learner.observe(f"p{i}", card, selector, pod.cpu_milli, pod.memory_mib)
    exact = workload_mix(trace)
    learned = learner.mix.classes[len(learner.prior.classes) :]

    def shapes(classes: object) -> dict[tuple[object, ...], float]:
        return {(c.card, c.cpu, c.memory): c.frequency for c in classes}  # type: ignore[attr-defined]

    assert shapes(learned) == shapes(exact.classes)
    # weighted as the exact mix is (the prior here is worth next to nothing)
    cpu_only = [
        w for c, w in zip(learner.mix.classes, learner.mix.weight, strict=True) if not c.card
    ]
    exact_cpu_only = [w for c, w in zip(exact.classes, exact.weight, strict=True) if not c.card]
    assert sum(cpu_only) == pytest.approx(sum(exact_cpu_only), rel=1e-6)


def test_mix_learner_skips_pods_that_ask_for_nothing_or_nonsense() -> None:
    learner = MixLearner(rebuild_every=1)
    learner.observe("empty", None, DeviceSelector())  # no GPU, no CPU, no memory
    learner.observe("nan", WHOLE, DeviceSelector(), float("nan"), 0.0)
    learner.observe("negative", None, DeviceSelector(), -1.0, 0.0)
    assert learner.counts == {}
    assert learner.mix is learner.prior
    # a CPU-only pod's type lists mean nothing: one class whatever they say
    learner.observe("a", None, DeviceSelector(include_types=("A100",)), 1000.0, 0.0)
    learner.observe("b", None, DeviceSelector(), 1000.0, 0.0)
    assert list(learner.counts.values()) == [2]


def test_mix_learner_bounds_hold_with_cpu_shapes() -> None:
    learner = MixLearner(rebuild_every=1, max_classes=2, remember=3, shift=0.0)
    for i in range(10):
        learner.observe(f"p{i}", None, DeviceSelector(), 1000.0 * (1 + i % 4), 0.0)
    assert len(learner.seen) == 3
    # a forgotten pod leaves the counts: the last three pods' classes only
    assert learner.counts == {
        (None, DeviceSelector(), 1000.0 * (1 + i % 4), 0.0): 1 for i in (7, 8, 9)
    }
    assert len(learner.mix.classes) == len(learner.prior.classes) + 2


def test_a_gpu_its_cpu_cannot_feed_is_stranded_and_starved() -> None:
    # Three nodes of two free cards (2000 milli each): no free CPU, 3000 (short of the
    # 4000 one pod asks) and plenty. The cluster's spare, 103000 / 6000 = 17.2
    # milli-CPU per milli-GPU, covers the GPU pods' 8: the feed ratio is 8.
    c = Cluster.build(
        [(n, [gpu(n, 0), gpu(n, 1)]) for n in ("n0", "n1", "n2")],
        node_cpu=[0, 3000, 100_000],
    )
    classes = [WorkloadClass(1, HALF, cpu=4000)]
    # FGD's part: a node that cannot host one pod has all its free share as fragment.
    assert fragmentation(c, WorkloadMix.of(classes, starvation=False)) == [2000.0, 2000.0, 0.0]
    # Starved: n0 feeds nothing (2000); n1 feeds 3000 / 8 = 375 of its 2000 (1625);
    # n2 feeds 100000 / 8 = 12500 > 2000 (none).
    assert fragmentation(c, WorkloadMix.of(classes)) == [
        pytest.approx(2000 + STARVED_WEIGHT * 2000),
        pytest.approx(2000 + STARVED_WEIGHT * 1625),
        0.0,
    ]


@pytest.mark.parametrize(
    ("cpu", "mem", "expected"),
    [
        (12_000, np.inf, 500),  # 12000 / 8 = 1500 of 2000 fed
        (8_000, np.inf, 1000),  # less CPU, more starved
        (4_000, np.inf, 1500),
        (16_000, np.inf, 0),  # exactly enough
        (40_000, np.inf, 0),  # more than enough
        (np.inf, 4_000, 1000),  # memory: 4000 / 4 = 1000 fed
        (np.inf, 6_000, 500),
        (np.inf, 20_000, 0),
        (12_000, 4_000, 1000),  # CPU starves 500, memory 1000: the larger
        (4_000, 6_000, 1500),  # CPU starves 1500, memory 500
        (0, np.inf, 2000),  # nothing fed: the whole free share, no more
        (-8_000, np.inf, 2000),  # overcommitted: still the whole free share, no more
        (16_000, -1, 2000),
    ],
)
def test_the_starved_share_is_the_free_share_cpu_and_memory_cannot_feed(
    cpu: float, mem: float, expected: float
) -> None:
    c = two_free_cards(cpu, mem)
    mix = WorkloadMix.of([FED_HALF])
    assert mix.feed_ratios(c) == (8.0, 4.0)  # the GPU pods' own ratio: the spare covers it
    assert starved(c, [FED_HALF]) == [pytest.approx(expected), 0.0]


def test_pods_without_gpus_take_the_spare_first() -> None:
    classes = [
        WorkloadClass(1, HALF, cpu=4000, memory=1000),  # per milli-GPU: 8 CPU, 2 MiB
        WorkloadClass(1, None, cpu=6000, memory=3000),  # 12 CPU, 6 MiB per milli-GPU asked
    ]
    assert WorkloadMix.of(classes).demand_ratios == (8.0, 12.0, 2.0, 6.0)

    def feed(cpu: float, mem: float) -> tuple[float, float]:
        c = Cluster.build([("n0", [gpu("n0", 0), gpu("n0", 1)])], node_cpu=[cpu], node_mem=[mem])
        return WorkloadMix.of(classes).feed_ratios(c)

    # Spare 50000 / 2000 = 25 CPU and 20000 / 2000 = 10 MiB per milli-GPU: past the GPU
    # pods' 8 and 2 that leaves 17 >= 12 and 8 >= 6, so the GPU pods' ratio stands.
    assert feed(50_000, 20_000) == (8.0, 2.0)
    # Spare 15 CPU and 6 MiB: 7 and 4 past the GPU pods', short of 12 and 6 by 5 and 2.
    assert feed(30_000, 12_000) == pytest.approx((8 + 5, 2 + 2))
    # Either resource alone.
    assert feed(30_000, 20_000) == pytest.approx((13.0, 2.0))
    # Spare 4 CPU: short of the GPU pods' own 8, none left for the pods without GPUs,
    # whose 12 all come out of the GPU pods' share; memory likewise (spare 1.5 MiB).
    assert feed(8_000, 3_000) == pytest.approx((8 + 12, 2 + 6))


def test_a_cluster_short_of_cpu_for_its_gpu_pods_alone_keeps_their_ratio() -> None:
    # No pods without GPUs: whatever the spare, the GPU pods' own ratio feeds the cards.
    c = Cluster.build([("n0", [gpu("n0", 0), gpu("n0", 1)])], node_cpu=[8_000], node_mem=[2_000])
    assert spare_ratios(c) == (4.0, 1.0)
    assert WorkloadMix.of([FED_HALF]).feed_ratios(c) == (8.0, 4.0)


def test_the_spare_counts_only_nodes_whose_cpu_and_memory_are_followed() -> None:
    # n0 followed: 2000 milli free, 30000 CPU, 8000 MiB; n1 not followed (inf), 1000 free;
    # n2 followed with overcommitted CPU (counts as 0) and 500 milli free.
    c = Cluster.build(
        [("n0", [gpu("n0", 0), gpu("n0", 1)]), ("n1", [gpu("n1", 0)]), ("n2", [busy("n2", 0, 50)])],
        node_cpu=[30_000, np.inf, -5_000],
        node_mem=[8_000, np.inf, 2_000],
    )
    assert spare_ratios(c) == pytest.approx((30_000 / 2500, 10_000 / 2500))
    unfollowed = Cluster.build([("n0", [gpu("n0", 0)])])
    assert spare_ratios(unfollowed) == (np.inf, np.inf)


def test_a_fractional_class_weighs_the_share_it_consumes() -> None:
    assert WorkloadClass(1, QUARTER).gpu_milli == 250
    assert WorkloadClass(1, TWO_WHOLE).gpu_milli == 2000
    assert WorkloadClass(1, CardDemand(1, -1, 30, 0, False)).gpu_milli == 300  # memory only

    def cpu_per_milli(card: CardDemand) -> float:
        return WorkloadMix.of([WorkloadClass(1, card, cpu=4000)]).demand_ratios[0]

    # The same 4000 milli-CPU over 250, 500, 1000 and 2000 milli-GPU: a quarter card asks
    # twice the CPU per milli-GPU a half card does, not as much as a whole card.
    assert cpu_per_milli(QUARTER) == 16.0
    assert cpu_per_milli(HALF) == 8.0
    assert cpu_per_milli(WHOLE) == 4.0
    assert cpu_per_milli(TWO_WHOLE) == 2.0
    # By frequency: three quarter-card pods and one whole-card pod ask 4 x 4000 CPU
    # for 3 x 250 + 1000 milli-GPU.
    mix = WorkloadMix.of([WorkloadClass(3, QUARTER, cpu=4000), WorkloadClass(1, WHOLE, cpu=4000)])
    assert mix.demand_ratios[0] == pytest.approx(16_000 / 1750)


def test_unpriced_mixes_and_clusters_starve_nothing() -> None:
    # n0 hosts exactly one pod (4000 CPU): FGD's part is 0, the starved share 1500.
    c = two_free_cards(4000, 2000)
    assert fragmentation(c, WorkloadMix.of([FED_HALF])) == [
        pytest.approx(STARVED_WEIGHT * 1500),
        0.0,
    ]
    unpriced = WorkloadMix.of([FED_HALF], starvation=False)
    assert unpriced.feed_ratios(c) == (0.0, 0.0)
    assert fragmentation(c, unpriced) == [0.0, 0.0]
    # CPU and memory not followed: no spare to measure, no node to starve.
    unfollowed = Cluster.build([("n0", [gpu("n0", 0), gpu("n0", 1)])])
    assert starved(unfollowed, [FED_HALF]) == [0.0]
    # A mix that asks no GPU prices nothing, whatever the CPU.
    cpu_only = WorkloadMix.of([WorkloadClass(1, None, cpu=4000, memory=2000)])
    assert cpu_only.demand_ratios == (0.0, 0.0, 0.0, 0.0)
    assert cpu_only.feed_ratios(two_free_cards(0, 0)) == (0.0, 0.0)


def test_the_feed_ratio_is_fixed_at_first_pricing() -> None:
    classes = [
        WorkloadClass(1, HALF, cpu=4000),  # 8 CPU per milli-GPU
        WorkloadClass(1, None, cpu=6000),  # 12 more
    ]
    c = Cluster.build([("n0", [gpu("n0", 0), gpu("n0", 1)])], node_cpu=[50_000])
    mix = WorkloadMix.of(classes)
    assert mix.feed_ratios(c) == (8.0, 0.0)  # spare 25: 17 past the GPU pods' 8, >= 12
    # Half a card and 30000 CPU taken: 1500 milli and 20000 CPU free, spare 40/3.
    c.take(
        np.asarray([0]),
        np.asarray([MEM // 2]),
        np.asarray([50]),
        np.asarray([1]),
        np.asarray([False]),
        node=0,
        cpu=30_000,
    )
    assert spare_ratios(c)[0] == pytest.approx(40 / 3)
    assert mix.feed_ratios(c) == (8.0, 0.0)
    # The mix keeps pricing at 8: 20000 / 8 = 2500 feeds all 1500 free.
    on, off = fragmentation(c, mix), fragmentation(c, WorkloadMix.of(classes, starvation=False))
    assert on == off
    # Priced afresh, 8 + 12 - (40/3 - 8) = 44/3: 20000 / (44/3) = 15000/11 fed of 1500.
    fresh = WorkloadMix.of(classes)
    assert fresh.feed_ratios(c)[0] == pytest.approx(44 / 3)
    assert starved(c, classes) == [pytest.approx(1500 - 15000 / 11)]


def test_a_mix_first_priced_where_no_share_is_free_is_priced_again() -> None:
    """Against a cluster with no free share (every card full, exclusive or unhealthy;
    or no cards yet) the spare is unmeasurable and no node can starve, whatever the
    ratio: the mix is priced when a cluster first has free share, not frozen at the
    GPU pods' ratio (the service prices a learned mix on whatever the cluster is then)."""
    classes = [
        WorkloadClass(1, HALF, cpu=4000),  # 8 CPU per milli-GPU
        WorkloadClass(1, None, cpu=6000),  # 12 more
    ]
    full = Cluster.build([("n0", [busy("n0", 0, 100), busy("n0", 1, 100)])], node_cpu=[8_000])
    bare = Cluster.build([("n0", [])], node_cpu=[8_000])
    free = Cluster.build([("n0", [gpu("n0", 0), gpu("n0", 1)])], node_cpu=[8_000])
    want = WorkloadMix.of(classes).feed_ratios(free)
    assert want == (20.0, 0.0)  # spare 4 < 8: all 12 come out of the GPU pods' share
    for first in (full, bare):
        mix = WorkloadMix.of(classes)
        assert fragmentation(first, mix) == [0.0]
        assert mix.feed_ratios(free) == want
        assert fragmentation(free, mix) == fragmentation(free, WorkloadMix.of(classes))


def test_pods_no_node_could_take_do_not_move_the_feed_ratio() -> None:
    # 1000 pods of half a card asking 4000 CPU (8 per milli-GPU), and 30 asking more
    # CPU, or more memory, than any node has: they could never be fed, so they count
    # for nothing (without the bound they would have raised the ratio ~50,000x).
    c = two_free_cards(100_000, 100_000)
    fair = WorkloadClass(1000, HALF, cpu=4000, memory=2000)
    for absurd in (
        WorkloadClass(30, HALF, cpu=1e9),
        WorkloadClass(30, None, cpu=1e9),
        WorkloadClass(30, HALF, memory=1e9),
    ):
        assert WorkloadMix.of([fair, absurd]).feed_ratios(c) == (8.0, 4.0)
    # A class the largest node could take still counts.
    big = WorkloadMix.of([fair, WorkloadClass(1000, HALF, cpu=100_000, memory=2000)])
    assert big.feed_ratios(c)[0] == pytest.approx((4000 + 100_000) / 1000)


def test_a_mix_priced_while_no_gpu_class_fits_anywhere_is_priced_again() -> None:
    # Every node's CPU is taken: no class fits, nothing can be measured; once CPU is
    # free again the mix gets its ratio and keeps it.
    c = Cluster.build([("n0", [gpu("n0", 0), gpu("n0", 1)])], node_cpu=[0], node_mem=[100_000])
    mix = WorkloadMix.of([FED_HALF])
    assert mix.feed_ratios(c) == (0.0, 0.0)
    assert mix.fixed_feed is None
    c.node_cpu_free[:] = 100_000
    assert mix.feed_ratios(c) == (8.0, 4.0)
    assert mix.fixed_feed == (8.0, 4.0)
