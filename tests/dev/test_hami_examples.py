"""HAMi's NVIDIA example pods, run unchanged in what they ask, through one
``gpuslice dev up``: each gives the outcome it has under HAMi.

The pods are HAMi's ``examples/nvidia/*.yaml`` in this project's own form:
the same resources and annotations, each container running ``probe init``
(the fake CUDA driver's first call, through the interposer where the card is
shared) instead of an image's command. ``example.yaml`` and
``vllm_cross_vgpu.yaml`` are Deployments (the second with a claim and a model
server): the stack runs pods only, and their pod templates ask nothing the
pods here do not (``nvidia.com/gpu`` with ``gpumem``, or with
``gpumem-percentage`` and ``gpucores``), so they are left out.

The cluster: the two default nodes (A100-SXM4-80GB, Tesla T4), a static MIG
node (gpu-node-3: A100-SXM4-40GB cards holding two 3g.20gb instances each,
``migStrategy: mixed``) and a dynamic MIG node (gpu-node-4, ``operatingMode:
mig``). Pods run one after another, each after the one before has released
its devices, so every one finds the cluster empty.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import Native
from tests.dev.test_up import GPUSLICE, dev_env, survivors

PODS = """
metadata: {name: default-use}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 3000, nvidia.com/gpucores: 30}}}
---
metadata: {name: default-use-legacy}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init], resources: {limits: {nvidia.com/gpu: 2}}}
---
metadata:
  name: dynamic-mig-example
  annotations: {nvidia.com/vgpu-mode: mig, hami.io/gpu-scheduler-policy: binpack}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 2, nvidia.com/gpumem: 8000}}}
---
metadata: {name: mig-example}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/mig-3g.20gb: 1}}}
---
metadata:
  name: specify-card-type-not-use
  annotations: {nvidia.com/nouse-gputype: "1080,2080"}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init], resources: {limits: {nvidia.com/gpu: 2}}}
---
metadata:
  name: specify-card-type-to-use
  annotations: {nvidia.com/use-gputype: "A100,V100"}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init], resources: {limits: {nvidia.com/gpu: 2}}}
---
metadata:
  name: specify-scheduling-policy
  annotations: {hami.io/node-scheduler-policy: spread, hami.io/gpu-scheduler-policy: binpack}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init], resources: {limits: {nvidia.com/gpu: 1}}}
---
metadata:
  name: specify-uuid-not-use
  annotations: {nvidia.com/nouse-gpuuuid: GPU-03f69c50-207a-2038-9b45-23cac89cb67d}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init], resources: {limits: {nvidia.com/gpu: 2}}}
---
metadata:
  name: specify-uuid-to-use
  annotations:
    nvidia.com/use-gpuuuid: "GPU-03f69c50-207a-2038-9b45-23cac89cb67d,\\
      GPU-03f69c50-207a-2038-9b45-23cac89cb67e"
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init], resources: {limits: {nvidia.com/gpu: 1}}}
---
metadata: {name: use-as-normal-1}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init], resources: {limits: {nvidia.com/gpu: 1}}}
---
metadata: {name: use-as-normal-2}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init], resources: {limits: {nvidia.com/gpu: 1}}}
---
metadata: {name: use-exclusive-card}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 2, nvidia.com/gpumem-percentage: 100,
                          nvidia.com/gpucores: 100}}}
---
metadata: {name: use-memory-fraction}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 2, nvidia.com/gpumem-percentage: 50,
                          nvidia.com/gpucores: 30}}}
---
metadata: {name: use-sharing-card-1}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpumem-percentage: 40,
                          nvidia.com/gpucores: 60}}}
---
metadata: {name: use-sharing-card-2}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpumem-percentage: 60,
                          nvidia.com/gpucores: 40}}}
---
metadata: {name: more-mig-than-any-node-has}
spec:
  containers:
  - {name: main, image: cuda, command: [probe, init],
     resources: {limits: {nvidia.com/mig-3g.20gb: 5}}}
"""

STATIC_MIG_NODE, DYNAMIC_MIG_NODE = "gpu-node-3", "gpu-node-4"
# the pods that get whole cards or shares of them, and how many cards each asks
SHARED = {
    "default-use": 1,
    "default-use-legacy": 2,
    "specify-card-type-not-use": 2,
    "specify-card-type-to-use": 2,
    "specify-scheduling-policy": 1,
    "specify-uuid-not-use": 2,
    "use-as-normal-1": 1,
    "use-as-normal-2": 1,
    "use-exclusive-card": 2,
    "use-memory-fraction": 2,
    "use-sharing-card-1": 1,
    "use-sharing-card-2": 1,
}
CARD = r"[0-9a-f-]{8}"  # a UUID's last 8 characters


def test_hamis_example_pods_give_hamis_outcomes(native: Native, tmp_path: Path) -> None:
    workdir = tmp_path / "dev"
    pods = tmp_path / "hami-examples.yaml"
    pods.write_text(PODS)
    result = subprocess.run(
        [GPUSLICE, "dev", "up", "--gpu", "fake", "--plain", "--workdir", str(workdir),
         "--nodes", "4", "--static-mig-nodes", "1", "--mig-nodes", "1", str(pods)],
        env=dev_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    said = result.stdout + result.stderr
    assert result.returncode == 1, said  # the UUID-to-use pod cannot run
    assert "Traceback" not in said
    lines = [line.split("\t") for line in result.stdout.splitlines()]
    models = {row[0]: row[3] for row in lines if len(row) == 10 and row[1].isdigit()}
    assert models == {
        "gpu-node-1": "NVIDIA A100-SXM4-80GB",
        "gpu-node-2": "Tesla T4",
        STATIC_MIG_NODE: "NVIDIA A100-SXM4-40GB",
        DYNAMIC_MIG_NODE: "NVIDIA A100-SXM4-40GB",
    }, said
    rows = {row[0].removeprefix("default/"): row[1:] for row in lines if len(row) == 5}
    del rows["pod"]  # the header
    assert set(rows) == {*SHARED, "dynamic-mig-example", "mig-example",
                         "specify-uuid-to-use", "more-mig-than-any-node-has"}  # fmt: skip

    for name, cards in SHARED.items():
        phase, node, gpus, reason = rows[name]
        assert (phase, reason) == ("Succeeded", ""), (name, rows[name])
        # hami-core cards, as many distinct ones as asked; never the static
        # node's cards, which are its MIG instances' and not shared
        assert re.fullmatch(rf"{CARD}(,{CARD})*", gpus), (name, gpus)
        assert len(set(gpus.split(","))) == cards, (name, gpus)
        assert node != STATIC_MIG_NODE, name
    # use-gputype A100: an A100 (the 40GB MIG cards hold no instance as large
    # as a whole card, which is what a pod without gpumem asks)
    assert "A100" in models[rows["specify-card-type-to-use"][1]]
    assert "1080" not in models[rows["specify-card-type-not-use"][1]]

    # static MIG: one 3g.20gb instance of the static node, from its own resource
    phase, node, gpus, _ = rows["mig-example"]
    assert (phase, node) == ("Succeeded", STATIC_MIG_NODE)
    assert re.fullmatch(rf"{CARD}/3g\.20gb", gpus), gpus
    # dynamic MIG: an instance made on each of the mig node's two cards, the
    # smallest profile holding 8000 MiB
    phase, node, gpus, _ = rows["dynamic-mig-example"]
    assert (phase, node) == ("Succeeded", DYNAMIC_MIG_NODE)
    instances = gpus.split(",")
    assert all(re.fullmatch(rf"{CARD}/1g\.10gb", i) for i in instances), gpus
    assert len({i.split("/")[0] for i in instances}) == 2, gpus

    # UUIDs no node has: HAMi's CardUuidMismatch, the pod stays unscheduled
    phase, node, gpus, reason = rows["specify-uuid-to-use"]
    assert (phase, node, gpus) == ("Unschedulable", "-", "-")
    assert reason.startswith("0/4 nodes are available: "), reason
    for where in ("gpu-node-1", "gpu-node-2", DYNAMIC_MIG_NODE):
        assert f"{where}: CardUuidMismatch: " in reason, reason
    # kube-scheduler's resource fit: the static node has 4 such instances
    assert rows["more-mig-than-any-node-has"] == [
        "Unschedulable",
        "-",
        "-",
        "0/4 nodes are available: 4 Insufficient nvidia.com/mig-3g.20gb.",
    ]
    assert "2 of 16 pods did not succeed" in result.stdout
    assert survivors(workdir) == []


def test_more_mig_nodes_than_nodes_is_one_clear_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [GPUSLICE, "dev", "up", "--gpu", "fake", "--plain", "--workdir", str(tmp_path / "dev"),
         "--nodes", "2", "--static-mig-nodes", "1", "--mig-nodes", "2"],
        env=dev_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --mig-nodes 2 and --static-mig-nodes 1 are more than the 2 --nodes"
    )
    assert not (tmp_path / "dev").exists()  # nothing started
