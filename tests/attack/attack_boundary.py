"""The core trusts every length and index it is handed; core._cluster checks only that each
array is contiguous with the right item size (a float64 array passes as int64). A Cluster
whose arrays disagree (any caller building one by hand) reads out of bounds."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from gpuslice_scheduler.engine import evaluate
from gpuslice_scheduler.fragmentation import default_mix
from tests.attack.common import cluster, demand

case = sys.argv[1]
c = cluster(2, 4)
if case == "model_id":  # a model index past the model table (mix.model_ok rows, type mask)
    c.model_id[3] = 1000
elif case == "node_start":  # the last node's cards run past the card arrays
    c = dataclasses.replace(c, node_start=np.array([0, 4, 4000], dtype=np.int64))
elif case == "float_caps":  # accepted: float64 has int64's item size
    c = dataclasses.replace(c, cap_mem=c.cap_mem.astype(np.float64))
e = evaluate(c, demand(count=1), np.arange(2), default_mix())
print(case, "->", e.feasible.tolist(), e.score.tolist(), e.chosen[0].tolist())
