"""Two threads evaluating with a workload mix neither has used before, at the same moment
(the extender's warm-up thread and the main thread after a cluster rebuild, both with the
learner's new mix): both miss mix.core_structs, both build, the later store drops the
other's keep list while it is used. Counts how often a thread's struct was replaced."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from gpuslice_scheduler import core
from tests.attack.common import big_mix, cluster, demand

if os.environ.get("FAST_SWITCH", "1") == "1":
    sys.setswitchinterval(1e-6)
c1 = cluster(64, 8)
c2 = cluster(64, 8)  # a rebuilt copy: same models, so the same key
d = demand(count=2)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
replaced = 0
lock = threading.Lock()


def run(barrier: threading.Barrier, cl, mixes) -> None:
    global replaced
    for mix in mixes:
        barrier.wait()
        core.evaluate(
            cl,
            d.request.containers,
            d.request.selector,
            d.gpu_policy,
            d.node_policy,
            0.0,
            0.0,
            np.arange(cl.node_count),
            mix,
        )


mixes = [big_mix(300) for _ in range(rounds)]


# detect overwrites: wrap each mix's dict
class Watch(dict):
    def __setitem__(self, k, v):
        global replaced
        if k in self:
            with lock:
                replaced += 1
        super().__setitem__(k, v)


for m in mixes:
    m.core_structs = Watch()
barrier = threading.Barrier(2)
ts = [threading.Thread(target=run, args=(barrier, cl, mixes)) for cl in (c1, c2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(
    f"{rounds} rounds: a thread's mix struct was overwritten (keep list dropped mid-use) {replaced} times"
)
