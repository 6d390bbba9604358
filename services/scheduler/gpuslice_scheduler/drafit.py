"""Placement as kube-scheduler makes it for a DRA claim, over the engine's cluster arrays.

In DRA mode kube-scheduler's own allocator (``k8s.io/dynamic-resource-allocation/
structured``) picks a claim's devices on a node: a depth-first search over the
node's pools, slices and devices in their published order that takes the first
device passing the class and request selectors and, for a device that allows
multiple allocations, whose remaining capacity covers the request; it backtracks
only when a later device, request or constraint of the same pod cannot be met,
and keeps the first complete answer (no scoring of devices). gpuslice's slices
list one device per card in card order, so the model here is: each of the
request's ``count`` cards is the first card of the node, in card order, with
the type the pod asks for and enough free memory and cores. A card taken whole
(a pod asking 100 %) is as full as DRA makes a device whose capacity is used up.
DRA knows no count of pods per card, so none is applied here.

The node is chosen either by kube-scheduler alone or by gpuslice's extender:

- ``first_fit_node``: kube-scheduler's default scoring of the nodes where the
  claim fits (its DynamicResources plugin scores nothing as of 1.34): the
  NodeResourcesFit plugin's LeastAllocated score and NodeResourcesBalancedAllocation,
  both over CPU and memory, weight 1 each, integer arithmetic as theirs; among
  equal best nodes one at random, as kube-scheduler's selectHost does. Plugins
  that score the same on every node here (taints, affinity, image locality,
  spreading) are left out, and every node is scored (``percentageOfNodesToScore``
  100).
- ``extender_node``: the best score the engine gives among the nodes where the
  claim fits, as the extender's prioritize ranks them, if it outweighs
  kube-scheduler's own scores; the cards are still first fit on that node.
"""

from __future__ import annotations

import numpy as np

from gpuslice_scheduler.cluster import Bools, Cluster, Floats, Ints

MAX_NODE_SCORE = 100  # kube-scheduler's framework.MaxNodeScore


def card_fit(cluster: Cluster, allowed: Bools, mem: Ints, cores: int, whole: bool) -> Bools:
    """Per card: can one device of the claim go there (type, free memory and cores).

    ``allowed``: per card, the class and request selectors admit it; ``mem``: per
    card, the memory the claim consumes there; ``whole``: the claim takes the card
    whole (nothing else may be on it).
    """
    fits = allowed & cluster.healthy & cluster.present & ~cluster.cordoned & ~cluster.owned
    fits &= cluster.cap_mem - cluster.used_mem >= mem
    fits &= cluster.cap_cores - cluster.used_cores >= cores
    if whole:
        fits &= (cluster.used_mem == 0) & (cluster.used_cores == 0)
    return fits


def fitting_nodes(cluster: Cluster, fits: Bools, count: int, cpu: float, memory: float) -> Bools:
    """Per node: ``count`` of its cards fit and its free CPU and memory cover the pod.

    The claim's devices all ask the same, so first fit finds them exactly when
    ``count`` cards fit: no backtracking is needed.
    """
    ok = (cluster.node_cpu_free >= cpu) & (cluster.node_mem_free >= memory)
    if count == 0:
        return ok
    running = np.concatenate(([0], np.cumsum(fits, dtype=np.int64)))
    per_node = running[cluster.node_start[1:]] - running[cluster.node_start[:-1]]
    return ok & (per_node >= count)


def first_cards(cluster: Cluster, fits: Bools, node: int, count: int) -> Ints:
    """The first ``count`` fitting cards of ``node`` in card (device) order."""
    start = int(cluster.node_start[node])
    end = int(cluster.node_start[node + 1])
    return np.flatnonzero(fits[start:end])[:count].astype(np.int64) + start


def kube_scores(
    cluster: Cluster, cpu_cap: Floats, mem_cap: Floats, cpu: float, memory: float
) -> Ints:
    """kube-scheduler's LeastAllocated + BalancedAllocation score of each node for a pod."""
    total = np.zeros(cpu_cap.size, dtype=np.int64)
    fractions = []
    for cap, free, ask in (
        (cpu_cap, cluster.node_cpu_free, cpu),
        (mem_cap, cluster.node_mem_free, memory),
    ):
        capacity = cap.astype(np.int64)
        requested = (cap - free).astype(np.int64) + int(ask)
        known = capacity > 0
        safe = np.where(known, capacity, 1)
        least = np.where(
            known & (requested <= capacity), (capacity - requested) * MAX_NODE_SCORE // safe, 0
        )
        total += least
        fractions.append(np.where(known, np.minimum(requested / safe, 1.0), 0.0))
    least_allocated = total // 2  # mean over the two resources, integer as theirs
    std = np.abs(fractions[0] - fractions[1]) / 2  # standard deviation of two values
    balanced = ((1 - std) * MAX_NODE_SCORE).astype(np.int64)
    scores: Ints = least_allocated + balanced
    return scores


def first_fit_node(scores: Ints, feasible: Bools, rng: np.random.Generator) -> int:
    """kube-scheduler's choice: a best-scored feasible node, at random; -1 if none."""
    rows = np.flatnonzero(feasible)
    if rows.size == 0:
        return -1
    best = rows[scores[rows] == scores[rows].max()]
    return int(best[int(rng.integers(best.size))]) if best.size > 1 else int(best[0])


def extender_node(score: Floats, feasible: Bools) -> int:
    """The extender's choice: the best engine score among the feasible nodes; -1 if none."""
    masked = np.where(feasible & np.isfinite(score), score, -np.inf)
    best = int(np.argmax(masked))
    return best if np.isfinite(masked[best]) else -1
