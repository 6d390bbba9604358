"""A tenant pod with many GPU containers, each asking the largest count parse_pod allows
(64): parse_pod accepts any number of containers, and the engine allocates
nodes x sum(counts) int64 picks (all written to -1 by the core) per evaluation, and the
Evaluator keeps one such array per kind of pod (256 kinds)."""

from __future__ import annotations

import resource
import sys
import time

from gpuslice_common.requests import parse_pod
from gpuslice_scheduler.engine import Demand, Evaluator
from gpuslice_scheduler.fragmentation import default_mix
from tests.attack.common import cluster

containers = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 500
pod = {
    "metadata": {"uid": "u1", "name": "p", "namespace": "t"},
    "spec": {
        "containers": [
            {"name": f"c{i}", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "64"}}}
            for i in range(containers)
        ]
    },
}
t = time.perf_counter()
req = parse_pod(pod)
print(
    f"parse_pod accepted {len(req.containers)} containers x count 64 in {time.perf_counter() - t:.2f}s"
)
cl = cluster(nodes, 8)
ev = Evaluator(cl, default_mix())
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
e = ev.evaluate(Demand.of(req))
dt = time.perf_counter() - t
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
size = sum(c.nbytes for c in e.chosen)
print(
    f"{nodes} nodes: evaluate {dt:.2f}s, chosen arrays {size / 2**20:.0f} MiB kept in the Evaluator, "
    f"max RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB; feasible nodes: {int(e.feasible.sum())}"
)
