"""Trace replay: the Alibaba openb traces scheduled by the placement engine.

The traces are the CSV files of Alibaba's public GPU cluster trace
``cluster-trace-gpu-v2023`` (:data:`TRACE_SOURCE`), kept out of the repository:
``make traces`` fetches them into ``bench/traces/openb``.

The published method (FGD paper and its simulator):

1. load every pod of the trace;
2. inflate: append pods drawn uniformly with replacement until the summed GPU
   request reaches ``inflation`` x the cluster's capacity (a trace already past
   that is not inflated);
3. shuffle with the same seed;
4. schedule pods one at a time in that order until the arrived demand reaches
   the target; nothing leaves; a pod that fits nowhere fails;
5. report allocated milli-GPU as a share of capacity after each 1 % of arrived
   demand.

Each pod is a one-container gpuslice request: ``nvidia.com/gpu = num_gpu``,
cores ``gpu_milli / 10`` % and the same percentage of card memory, ``gpu_spec``
as the type include list; its CPU and memory must fit the node's as
kube-scheduler would require. Placement uses :class:`engine.Evaluator`, as the
extender does: scores of a node depend only on that node, so each pod class's
evaluation is kept and only the nodes changed since it was last seen are
evaluated again.

``placement`` says who places the pods. ``gpuslice`` (the default): the engine
chooses node and cards, as the extender does in device-plugin mode. In DRA mode
kube-scheduler's allocator chooses the cards (:mod:`gpuslice_scheduler.drafit`):
``dra-first-fit`` is DRA without the extender (kube-scheduler's own node scores,
cards first fit in device order); ``dra+extender`` has the extender choose the
node by the engine's score among the nodes where the claim fits, the cards still
first fit there. DRA has no count of pods per card: the DRA placements run with
no such limit (``split_count`` is not applied).
"""

from __future__ import annotations

import csv
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gpuslice_common.models import (
    ContainerGpuRequest,
    DeviceSelector,
    GpuPolicy,
    MemoryRequest,
    NodePolicy,
    PodGpuRequest,
    PodRef,
)
from gpuslice_scheduler import drafit
from gpuslice_scheduler.cluster import Bools, Cluster, Floats, Ints, Row
from gpuslice_scheduler.engine import Demand, Evaluator
from gpuslice_scheduler.fit import CardDemand, model_mask
from gpuslice_scheduler.fragmentation import SIZE_EXPONENT, WorkloadClass, WorkloadMix

# Device memory per model in MiB; requests are percentages, so only the ratio matters.
MODEL_MEMORY_MIB = {"P100": 16384, "T4": 15360, "V100M16": 16384, "V100M32": 32768, "A10": 24576}
DEFAULT_MEMORY_MIB = 24576
SPLIT_COUNT = 10  # HAMi's default deviceSplitCount


@dataclass(frozen=True)
class SimPolicy:
    gpu: GpuPolicy
    node: NodePolicy | None = None
    size_exponent: float = SIZE_EXPONENT
    starvation: bool = True


POLICIES: dict[str, SimPolicy] = {
    "fragmentation": SimPolicy(GpuPolicy.FRAGMENTATION),
    # FGD as published (a baseline in the same run): classes weighted by frequency
    # alone, and no price on the share a node's CPU or memory cannot feed.
    "fgd": SimPolicy(GpuPolicy.FRAGMENTATION, size_exponent=0.0, starvation=False),
    "binpack": SimPolicy(GpuPolicy.BINPACK, NodePolicy.BINPACK),
    "spread": SimPolicy(GpuPolicy.SPREAD, NodePolicy.SPREAD),
    "hami-default": SimPolicy(GpuPolicy.SPREAD, NodePolicy.BINPACK),
}


GPUSLICE = "gpuslice"
DRA_FIRST_FIT = "dra-first-fit"
DRA_EXTENDER = "dra+extender"
PLACEMENTS = (GPUSLICE, DRA_FIRST_FIT, DRA_EXTENDER)
NO_SLOT_LIMIT = 100  # every pod takes at least 1 % of a card's memory
# Where the openb traces come from: Alibaba's public GPU cluster trace.
TRACE_SOURCE = "https://github.com/alibaba/clusterdata/tree/master/cluster-trace-gpu-v2023/csv"


class TraceError(ValueError):
    """A trace file is missing, malformed or out of range; the message names the line."""


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class PodClass:
    """Pods of a trace that ask for exactly the same thing."""

    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]

    @property
    def gpu_demand(self) -> int:
        """Milli-GPU the pod asks for."""
        return self.num_gpu * self.gpu_milli

    def request(self) -> PodGpuRequest | None:
        if self.num_gpu == 0:
            return None
        share = math.ceil(self.gpu_milli / 10)
        container = ContainerGpuRequest(
            name="main",
            count=self.num_gpu,
            memory=MemoryRequest(percent=max(share, 1)),  # never 0 MiB: that is no limit
            cores=share,
        )
        return PodGpuRequest(
            pod=PodRef(uid="trace"),
            containers=(container,),
            selector=DeviceSelector(include_types=self.gpu_spec),
        )


def _int(row: dict[str, str], key: str, where: str, lo: int, hi: int) -> int:
    raw = (row.get(key) or "").strip()
    try:
        number = float(raw)
    except ValueError:
        raise TraceError(f"{where}: column {key!r} is not a number: {raw!r}") from None
    if not number.is_integer():  # also inf and nan, which int() cannot take
        raise TraceError(f"{where}: column {key!r} is not a whole number: {raw!r}")
    value = int(number)
    if not lo <= value <= hi:
        raise TraceError(f"{where}: column {key!r} = {value} is outside {lo}..{hi}")
    return value


def _rows(path: Path, required: Sequence[str]) -> Iterable[tuple[str, dict[str, str]]]:
    try:
        handle = path.open(newline="")
    except FileNotFoundError as exc:
        raise TraceError(
            f"cannot read {path}: {exc.strerror} (the openb traces are Alibaba's"
            f" cluster-trace-gpu-v2023, {TRACE_SOURCE}; `make traces` fetches them"
            " into bench/traces/openb)"
        ) from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror}") from None
    with handle:
        reader = csv.DictReader(handle)
        try:
            missing = [c for c in required if c not in (reader.fieldnames or [])]
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
            for row in reader:
                yield f"{path.name}:{reader.line_num}", row
        except (UnicodeDecodeError, csv.Error) as exc:
            where = f"{path}: near line {reader.line_num + 1}"
            raise TraceError(f"{where}: not a UTF-8 CSV file ({exc})") from None


def load_nodes(path: Path) -> list[TraceNode]:
    nodes = []
    for where, row in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model")):
        nodes.append(
            TraceNode(
                name=(row["sn"] or "").strip() or where,
                cpu_milli=_int(row, "cpu_milli", where, 0, 10**9),
                memory_mib=_int(row, "memory_mib", where, 0, 10**12),
                gpus=_int(row, "gpu", where, 0, 64),
                model=(row["model"] or "").strip() or "unknown",
            )
        )
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return nodes


def load_pods(path: Path) -> list[PodClass]:
    pods = []
    for where, row in _rows(path, ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli")):
        num_gpu = _int(row, "num_gpu", where, 0, 64)
        gpu_milli = _int(row, "gpu_milli", where, 0, 1000)
        if num_gpu > 1 and gpu_milli != 1000:
            raise TraceError(f"{where}: a pod with {num_gpu} GPUs must ask 1000 milli each")
        spec = tuple(s.strip() for s in (row.get("gpu_spec") or "").split("|") if s.strip())
        pods.append(
            PodClass(
                cpu_milli=_int(row, "cpu_milli", where, 0, 10**9),
                memory_mib=_int(row, "memory_mib", where, 0, 10**12),
                num_gpu=num_gpu,
                gpu_milli=gpu_milli if num_gpu else 0,
                gpu_spec=spec if num_gpu else (),
            )
        )
    if not pods:
        raise TraceError(f"{path}: no pods")
    return pods


def build_cluster(nodes: Sequence[TraceNode], split_count: int = SPLIT_COUNT) -> Cluster:
    def card(node: TraceNode, i: int) -> Row:
        memory = MODEL_MEMORY_MIB.get(node.model, DEFAULT_MEMORY_MIB)
        uuid = f"{node.name}-gpu{i}"
        return (uuid, node.model, -1, memory, 100, split_count, 0, 0, 0, False, True, True, False)

    return Cluster.from_rows(
        [(n.name, [card(n, i) for i in range(n.gpus)]) for n in nodes],
        node_cpu=[n.cpu_milli for n in nodes],
        node_mem=[n.memory_mib for n in nodes],
    )


def workload_mix(
    pods: Sequence[PodClass], size_exponent: float = SIZE_EXPONENT, starvation: bool = True
) -> WorkloadMix:
    """The trace's own pod distribution: what the fragmentation policy expects to come."""
    classes = []
    for pod, count in Counter(pods).items():
        request = pod.request()
        card = CardDemand.of(request.containers[0]) if request else None
        selector = request.selector if request else DeviceSelector()
        classes.append(WorkloadClass(count, card, selector, pod.cpu_milli, pod.memory_mib))
    return WorkloadMix.of(classes, size_exponent, starvation)


@dataclass(frozen=True)
class Derivation:
    """A workload made from a trace the way openb's variants were made from its default.

    ``sharing``: sharing pods (one card, less than all of it) are to hold this share
    of the GPU demand; GPU pods that do not share, drawn at random, are replaced by
    sharing pods drawn from the trace's own until they do (the pod count stays).
    ``cpu_scale``: every pod's CPU request is multiplied by this.
    """

    sharing: float | None = None
    cpu_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sharing is not None and not (
            math.isfinite(self.sharing) and 0.0 <= self.sharing <= 1.0
        ):
            raise TraceError(f"sharing share must be between 0 and 1, not {self.sharing}")
        if not (math.isfinite(self.cpu_scale) and 0.0 < self.cpu_scale <= 100.0):
            raise TraceError(f"CPU scale must be above 0 and at most 100, not {self.cpu_scale}")

    @property
    def suffix(self) -> str:
        """How a derived trace is named after its source: ``default-share60-cpu2.5x``."""
        # enough digits that two workloads are never one name (60.00000000000001 is 60)
        parts = [] if self.sharing is None else [f"share{100 * self.sharing:.12g}"]
        if self.cpu_scale != 1.0:
            parts.append(f"cpu{self.cpu_scale:.12g}x")
        return "".join(f"-{p}" for p in parts)

    def apply(self, pods: Sequence[PodClass]) -> list[PodClass]:
        out = list(pods)
        if self.sharing is not None:
            out = _raise_sharing(out, self.sharing, self.seed)
        if self.cpu_scale != 1.0:
            out = [
                replace(p, cpu_milli=math.ceil(p.cpu_milli * self.cpu_scale - 1e-9)) for p in out
            ]
        return out


def _sharing(pod: PodClass) -> bool:
    return pod.num_gpu == 1 and 0 < pod.gpu_milli < 1000


def _raise_sharing(pods: list[PodClass], share: float, seed: int) -> list[PodClass]:
    sharing = [p for p in pods if _sharing(p)]
    total = sum(p.gpu_demand for p in pods)
    shared = sum(p.gpu_demand for p in sharing)
    if shared >= share * total:
        return pods
    if not sharing:
        raise TraceError("the trace has no sharing pods to raise their share with")
    rng = np.random.default_rng(seed)
    others = [i for i, p in enumerate(pods) if p.num_gpu > 0 and not _sharing(p)]
    for k in rng.permutation(len(others)).tolist():
        if shared >= share * total:
            break
        i = others[k]
        new = sharing[int(rng.integers(len(sharing)))]
        total += new.gpu_demand - pods[i].gpu_demand
        shared += new.gpu_demand
        pods[i] = new
    return pods


def arrivals(pods: Sequence[PodClass], capacity: int, inflation: float, seed: int) -> list[int]:
    """Indexes into ``pods`` in arrival order: inflated with replacement, then shuffled."""
    rng = np.random.default_rng(seed)
    demand = np.asarray([p.gpu_demand for p in pods], dtype=np.int64)
    order = list(range(len(pods)))
    total, target = int(demand.sum()), inflation * capacity
    if demand.max() <= 0:
        raise TraceError("no pod in the trace asks for a GPU")
    while total < target:
        draw = int(rng.integers(len(pods)))
        order.append(draw)
        total += int(demand[draw])
    return [order[i] for i in rng.permutation(len(order))]


@dataclass
class RunResult:
    trace: str
    policy: str
    seed: int
    milli_gpu_allocation_ratio: float
    unallocated_gpus: float
    failed_pods: int
    failed_gpu_pods: int
    scheduled_pods: int
    arrived_pods: int
    curve: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    placement: str = GPUSLICE

    @property
    def label(self) -> str:
        """The policy for gpuslice's placement; the DRA model (and the extender's policy)."""
        if self.placement == GPUSLICE:
            return self.policy
        if self.placement == DRA_FIRST_FIT:
            return DRA_FIRST_FIT
        return f"{self.placement}/{self.policy}"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def replay(
    nodes: Sequence[TraceNode],
    pods: Sequence[PodClass],
    policy: str,
    seed: int,
    *,
    trace: str = "",
    inflation: float = 1.3,
    split_count: int = SPLIT_COUNT,
    progress: Callable[[float], None] | None = None,
    placement: str = GPUSLICE,
) -> RunResult:
    """Schedule the trace once; ``progress`` gets the arrived share (0-1) as it goes."""
    _check(policy, placement)
    started = time.perf_counter()
    dra = placement != GPUSLICE
    cluster = build_cluster(nodes, max(split_count, NO_SLOT_LIMIT) if dra else split_count)
    capacity = 1000 * cluster.card_count
    if capacity == 0:
        raise TraceError("the cluster has no GPU")
    chosen = POLICIES[policy]
    gpu_policy, node_policy = chosen.gpu, chosen.node
    mix = (
        workload_mix(pods, chosen.size_exponent, chosen.starvation)
        if gpu_policy is GpuPolicy.FRAGMENTATION
        else None
    )
    classes = list(dict.fromkeys(pods))
    class_of = {c: i for i, c in enumerate(classes)}
    demands = [
        Demand(c.request(), gpu_policy, node_policy, float(c.cpu_milli), float(c.memory_mib))
        for c in classes
    ]
    evaluator = Evaluator(cluster, mix, kinds=len(classes) + 1)
    model = DraPlacement(cluster, nodes, classes, seed) if dra else None

    order = arrivals(pods, capacity, inflation, seed)
    target = inflation * capacity
    arrived = allocated = 0
    failed = failed_gpu = scheduled = 0
    curve: list[float] = []
    next_mark, marks = 1, math.floor(inflation * 100 + 1e-9)  # one point per whole 1 %
    for count, index in enumerate(order, start=1):
        pod = pods[index]
        kind = class_of[pod]
        if model is None:
            ev = evaluator.evaluate(demands[kind])
            best = int(np.argmax(ev.score))
            found = bool(np.isfinite(ev.score[best]))
            cards = ev.chosen[0][best] if found and ev.chosen else np.zeros(0, dtype=np.int64)
        else:
            score = evaluator.evaluate(demands[kind]).score if placement == DRA_EXTENDER else None
            best, cards = model.place(kind, score)
            found = best >= 0
        if found:
            _take(cluster, pod, cards, best)
            allocated += pod.gpu_demand
            scheduled += 1
        else:
            failed += 1
            failed_gpu += pod.num_gpu > 0
        arrived += pod.gpu_demand
        while next_mark <= marks and arrived * 100 >= next_mark * capacity:
            curve.append(100.0 * allocated / capacity)
            next_mark += 1
        if progress is not None and count % 256 == 0:
            progress(min(1.0, arrived / target))
        if arrived >= target:
            break
    if progress is not None:
        progress(1.0)
    return RunResult(
        trace=trace,
        policy=policy,
        seed=seed,
        milli_gpu_allocation_ratio=round(100.0 * allocated / capacity, 3),
        unallocated_gpus=round((capacity - allocated) / 1000, 3),
        failed_pods=failed,
        failed_gpu_pods=failed_gpu,
        scheduled_pods=scheduled,
        arrived_pods=scheduled + failed,
        curve=[round(v, 3) for v in curve],
        wall_seconds=round(time.perf_counter() - started, 3),
        placement=placement,
    )


def _check(policy: str, placement: str) -> None:
    if policy not in POLICIES:
        raise TraceError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    if placement not in PLACEMENTS:
        raise TraceError(f"unknown placement {placement!r} (choose from {', '.join(PLACEMENTS)})")


class DraPlacement:
    """Node and cards as kube-scheduler's DRA allocator chooses them (:mod:`drafit`)."""

    def __init__(
        self, cluster: Cluster, nodes: Sequence[TraceNode], classes: Sequence[PodClass], seed: int
    ) -> None:
        self.cluster = cluster
        self.classes = classes
        self.cpu_cap = np.asarray([n.cpu_milli for n in nodes], dtype=np.float64)
        self.mem_cap = np.asarray([n.memory_mib for n in nodes], dtype=np.float64)
        self.rng = np.random.default_rng([seed, 1])  # its own stream: the arrivals stay the same
        self.allowed: dict[int, tuple[Bools, Ints, int]] = {}

    def _claim(self, kind: int) -> tuple[Bools, Ints, int]:
        if kind not in self.allowed:
            pod = self.classes[kind]
            share = math.ceil(pod.gpu_milli / 10)
            selector = DeviceSelector(include_types=pod.gpu_spec)
            allowed = model_mask(selector, self.cluster.models)[self.cluster.model_id]
            mem = np.maximum(self.cluster.cap_mem * max(share, 1) // 100, 1)
            self.allowed[kind] = (allowed, mem, share)
        return self.allowed[kind]

    def place(self, kind: int, extender_score: Floats | None) -> tuple[int, Ints]:
        """The node (-1 if none fits) and the cards of a pod of class ``kind``;
        ``extender_score``: the engine's score per node, None for kube-scheduler's own."""
        pod, cluster = self.classes[kind], self.cluster
        if pod.num_gpu:
            allowed, mem, share = self._claim(kind)
            fits = drafit.card_fit(cluster, allowed, mem, share, share >= 100)
        else:
            fits = np.zeros(0, dtype=np.bool_)
        feasible = drafit.fitting_nodes(cluster, fits, pod.num_gpu, pod.cpu_milli, pod.memory_mib)
        if extender_score is None:
            scores = drafit.kube_scores(
                cluster, self.cpu_cap, self.mem_cap, pod.cpu_milli, pod.memory_mib
            )
            node = drafit.first_fit_node(scores, feasible, self.rng)
        else:
            node = drafit.extender_node(extender_score, feasible)
        if node < 0 or not pod.num_gpu:
            return node, np.zeros(0, dtype=np.int64)
        return node, drafit.first_cards(cluster, fits, node, pod.num_gpu)


def _take(cluster: Cluster, pod: PodClass, cards: Ints, node: int) -> None:
    if pod.num_gpu == 0:
        cluster.node_cpu_free[node] -= pod.cpu_milli
        cluster.node_mem_free[node] -= pod.memory_mib
        cluster.touch([node])
        return
    share = math.ceil(pod.gpu_milli / 10)
    mem = np.maximum(cluster.cap_mem[cards] * max(share, 1) // 100, 1)  # as MemoryRequest.on_card
    count = cards.size
    cluster.take(
        cards,
        mem,
        np.full(count, share, dtype=np.int64),
        np.ones(count, dtype=np.int64),
        np.full(count, share == 100),
        node,
        pod.cpu_milli,
        pod.memory_mib,
    )


def parse_seeds(text: str) -> list[int]:
    """``42``, ``42-51`` or ``42,45,50-51`` as a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise TraceError(f"not a seed or seed range: {part.strip()!r} (e.g. 42-51)") from None
        if last < first or last - first > 10_000:
            raise TraceError(f"bad seed range: {part.strip()!r}")
        seeds.extend(range(first, last + 1))
    return seeds


RunArgs = tuple[Path, Path, str, int, float, int, "Derivation | None", str]


def _run_one(args: RunArgs, progress: Callable[[float], None] | None = None) -> RunResult:
    nodes_path, pods_path, policy, seed, inflation, split_count, derivation, placement = args
    pods = load_pods(pods_path)
    return replay(
        load_nodes(nodes_path),
        derivation.apply(pods) if derivation else pods,
        policy,
        seed,
        trace=trace_name(pods_path, derivation),
        inflation=inflation,
        split_count=split_count,
        progress=progress,
        placement=placement,
    )


def trace_name(pods_path: Path, derivation: Derivation | None = None) -> str:
    name = pods_path.stem.removeprefix("openb_pod_list_")
    return name + derivation.suffix if derivation else name


def replay_many(
    nodes_path: Path,
    pods_path: Path,
    policies: Sequence[str],
    seeds: Sequence[int],
    *,
    inflation: float = 1.3,
    split_count: int = SPLIT_COUNT,
    jobs: int = 1,
    derivation: Derivation | None = None,
    progress: Callable[[float], None] | None = None,
    placements: Sequence[str] = (GPUSLICE,),
) -> list[RunResult]:
    """Every (placement, policy, seed) run, in parallel processes when ``jobs`` > 1;
    the pods derived by ``derivation`` when given. ``dra-first-fit`` ignores the
    policy: it runs once per seed.

    ``progress`` gets the number of runs done so far (fractional while one runs alone).
    """
    for placement in placements:
        for policy in policies:
            _check(policy, placement)
    load_nodes(nodes_path)  # report a bad file or derivation before forking
    pods = load_pods(pods_path)
    if derivation is not None:
        derivation.apply(pods)
    work: list[RunArgs] = [
        (nodes_path, pods_path, p, s, inflation, split_count, derivation, where)
        for where in dict.fromkeys(placements)
        for p in (policies[:1] if where == DRA_FIRST_FIT else policies)
        for s in seeds
    ]
    results: list[RunResult] = []
    if jobs <= 1 or len(work) == 1:
        for i, item in enumerate(work):
            step = None if progress is None else (lambda f, i=i: progress(i + f))
            results.append(_run_one(item, step))
        return results
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for result in pool.map(_run_one, work):
            results.append(result)
            if progress is not None:
                progress(len(results))
    return results


def summarise(results: Sequence[RunResult]) -> dict[str, dict[str, float]]:
    """Per policy (:attr:`RunResult.label`), the mean over seeds of the headline numbers."""
    by_policy: dict[str, list[RunResult]] = {}
    for r in results:
        by_policy.setdefault(r.label, []).append(r)
    return {
        policy: {
            "seeds": len(runs),
            "milli_gpu_allocation_ratio": round(
                float(np.mean([r.milli_gpu_allocation_ratio for r in runs])), 3
            ),
            "unallocated_gpus": round(float(np.mean([r.unallocated_gpus for r in runs])), 3),
            "failed_pods": round(float(np.mean([r.failed_pods for r in runs])), 1),
            "wall_seconds": round(float(np.mean([r.wall_seconds for r in runs])), 3),
        }
        for policy, runs in by_policy.items()
    }
