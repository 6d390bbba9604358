"""The interleaving of two threads that both miss mix.core_structs[key]: the later store
drops the earlier builder's keep list while that builder still holds (and then passes to
gs_evaluate) the struct whose pointers it held. Simulated deterministically here."""

from __future__ import annotations

import gc

import numpy as np

from gpuslice_scheduler import core
from tests.attack.common import big_mix, cluster, demand

c = cluster(4, 8)
mix = big_mix(400)
key = tuple(c.models)

# thread B: misses, builds and stores S_B, is about to call gs_evaluate with it
s_b = core._mix(mix, c.models)
# thread A: had missed too (before B stored), finishes its build and stores S_A over S_B
keep_a: list = []
s_a = core.ffi.new("gs_mix_t *")
mix.core_structs[key] = (s_a, keep_a)  # what A's `mix.core_structs[key] = (struct, keep)` does
gc.collect()
# B now calls the core with S_B, whose buffers (weight, model_ok, ...) were just freed
orig = core._mix
core._mix = lambda m, models: s_b  # B's local reference, as in core.evaluate
d = demand(count=1)
ans = core.evaluate(
    c,
    d.request.containers,
    d.request.selector,
    d.gpu_policy,
    d.node_policy,
    0.0,
    0.0,
    np.arange(4),
    mix,
)
print("scores read through freed memory:", ans.score.tolist())
