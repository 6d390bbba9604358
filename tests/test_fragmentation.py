"""Node fragmentation, class weights and the learned workload mix."""

from __future__ import annotations

import numpy as np
import pytest

from gpuslice_common.models import DeviceSelector
from gpuslice_scheduler.cluster import Cluster
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import (
    MixLearner,
    WorkloadClass,
    WorkloadMix,
    default_mix,
    node_fragmentation,
)
from tests.test_engine import busy, gpu

SHARE_60 = CardDemand(count=1, mem_mib=-1, mem_percent=60, cores=60, exclusive=False)
WHOLE = CardDemand(count=1, mem_mib=-1, mem_percent=100, cores=100, exclusive=True)
TWO_WHOLE = CardDemand(count=2, mem_mib=-1, mem_percent=100, cores=100, exclusive=True)


def fragmentation(cluster: Cluster, mix: WorkloadMix) -> list[float]:
    """Every node's fragmentation, in node order."""
    frag, _ = node_fragmentation(mix, cluster, np.arange(cluster.node_count, dtype=np.int64))
    return [float(f) for f in frag]


def free_share(cluster: Cluster, mix: WorkloadMix) -> list[float]:
    """Every node's free share (milli-GPU), in node order."""
    _, total = node_fragmentation(mix, cluster, np.arange(cluster.node_count, dtype=np.int64))
    return [float(t) for t in total]


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
