"""WorkloadMix accepts a NaN (or inf) frequency: `total <= 0` is False for NaN. The core's
card scores become NaN, qsort gets a comparator that says a > b and b > a, and every
node's score is NaN (normalise gives all 0)."""

from __future__ import annotations

import math

import numpy as np

from gpuslice_scheduler.engine import evaluate
from gpuslice_scheduler.fit import CardDemand
from gpuslice_scheduler.fragmentation import WorkloadClass, WorkloadMix
from tests.attack.common import cluster, demand

for f in (math.nan, math.inf):
    mix = WorkloadMix.of(
        [
            WorkloadClass(f, CardDemand(1, -1, 50, 50, False)),
            WorkloadClass(1.0, CardDemand(1, -1, 100, 100, True)),
        ]
    )
    print("mix accepted, weights", mix.weight.tolist())
    e = evaluate(cluster(3, 16), demand(count=4), np.arange(3), mix)
    print(" scores", e.score.tolist(), "cards", e.chosen[0].tolist())
