import numpy as np
from gpuslice_scheduler.engine import evaluate
from gpuslice_common.models import GpuPolicy
from tests.attack.common import cluster, demand

c = cluster(1, 2, used_mem=1)
e = evaluate(c, demand(count=1, mib=2**63 - 1, policy=GpuPolicy.BINPACK), np.arange(1))
print("feasible", e.feasible.tolist(), "cards", e.chosen[0].tolist())
